"""Where an HF round and the personalized evaluation spend their time (paper MNIST config).

    python benchmarks/profile_round.py [--repeats 20] [--out benchmarks/results]

Times, in one process, the pieces of the batched engine's round (client sampling, the keyed
minibatch indices, the gather, the clients' local update) and of the evaluation of all 50 users
(the adaptation batches, the vmapped adaptation, the scoring), a 2048^2 fp32 GEMM beside them,
and whether two cheaper ways to score give the same bits: the global model's forward pass over
every user's test data at once, and a vmapped forward pass of the adapted models. Median of
``--repeats`` after a warm-up call. Writes profile_round.json under --out.
"""
from __future__ import annotations

import argparse
import datetime
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.func import vmap

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from scale import hf_engine  # noqa: E402

from fedml_perfedavg.core import evaluation  # noqa: E402
from fedml_perfedavg.core.functional import logits_of  # noqa: E402
from fedml_perfedavg.core.sampling import Purpose, generator_for  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    engine, algorithm, users, source = hf_engine(50, 10)
    for round_idx in range(3):  # a trained model, not the initial one, for the scoring checks
        engine.train_round(round_idx)
    clients = algorithm.sample_clients(3)
    index = engine.batch_index(3, clients)
    batches = engine.gather(index)
    params, _ = algorithm.split_state(engine.state)
    rounds = iter(range(10, 10 ** 6))
    r = args.repeats
    with torch.no_grad():
        step_ms = median_ms(lambda: engine.step(dict(params), batches), r)
    size = 2048
    a = torch.randn(size, size)
    gemm_ms = median_ms(lambda: a @ a, 7)
    cfg = algorithm.settings.evaluation
    ids = list(range(len(users)))
    adapted = list(evaluation._adapted_in_chunks(algorithm.loss_fn, params, users, ids, cfg, 0, cfg.alpha))
    results = {
        "round": {"sample_clients_ms": median_ms(lambda: algorithm.sample_clients(3), r),
                  "batch_indices_ms": median_ms(lambda: engine.batch_index(3, clients), r),
                  "gather_ms": median_ms(lambda: engine.gather(index), r),
                  "local_update_ms": step_ms,
                  "train_round_ms": median_ms(lambda: engine.train_round(next(rounds)), r)},
        "gemm_gflops": 2 * size ** 3 / (gemm_ms / 1000) / 1e9,
        "evaluation": {
            "evaluate_ms": median_ms(lambda: algorithm.evaluate(0, engine.state, users), max(5, r // 3)),
            "adaptation_batches_ms": median_ms(lambda: [evaluation.adaptation_batches(
                u.train_x, u.train_y, cfg.adapt_steps, cfg.batch_size, generator_for(cfg.seed, 0, i, Purpose.EVALUATION))
                for i, u in enumerate(users)], max(5, r // 3)),
            "adaptation_ms": median_ms(lambda: list(evaluation._adapted_in_chunks(
                algorithm.loss_fn, params, users, ids, cfg, 0, cfg.alpha)), max(5, r // 3)),
            "scoring_ms": median_ms(lambda: evaluation._score(algorithm.network, params, iter(adapted), users),
                                    max(5, r // 3)),
        },
    }
    # Would a batched scoring give the same bits? The global model over all test data at once:
    together = logits_of(algorithm.network, params, torch.cat([u.test_x for u in users]))
    offsets = torch.tensor([0] + [len(u.test_y) for u in users]).cumsum(0).tolist()
    before_equal = all(torch.equal(logits_of(algorithm.network, params, u.test_x), together[offsets[i]:offsets[i + 1]])
                       for i, u in enumerate(users))
    by_size: dict = {}
    for i, u in enumerate(users):
        by_size.setdefault(len(u.test_y), []).append(i)
    after_equal = True
    for members in by_size.values():
        stacked = {k: torch.stack([adapted[i][k] for i in members]) for k in params}
        out = vmap(lambda p, x: logits_of(algorithm.network, p, x))(stacked, torch.stack([users[i].test_x
                                                                                         for i in members]))
        after_equal &= all(torch.equal(out[j], logits_of(algorithm.network, adapted[i], users[i].test_x))
                           for j, i in enumerate(members))
    results["scoring_bits"] = {"global_model_all_users_at_once_equal": before_equal,
                               "adapted_models_vmapped_equal": after_equal}
    results.update(date=datetime.date.today().isoformat(), data=source, threads=torch.get_num_threads(),
                   command="python benchmarks/profile_round.py " + " ".join(sys.argv[1:]))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_round.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
