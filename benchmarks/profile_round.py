"""Where an HF round and the personalized evaluation spend their time (paper MNIST config).

    python benchmarks/profile_round.py [--repeats 20] [--out benchmarks/results]

Times, in one process, the pieces of the batched engine's round (client sampling, the keyed
minibatch indices, the gather, the clients' local update) and the evaluation of all 50 users
(whole; its adaptation alone; whole with the users scored one by one; and the scoring's forward
passes alone, the adapted and the global model over every test split), a 2048^2 fp32 GEMM
beside them, and whether the evaluation's probe found batched scoring bit-exact on this CPU.
Median of ``--repeats`` after a warm-up call. Writes profile_round.json under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import speed  # noqa: E402
from scale import hf_engine  # noqa: E402

from fedml_perfedavg.core import evaluation  # noqa: E402


def median_ms(fn, repeats: int) -> float:
    return speed.median_ms(fn, repeats, warmup=1)


def scoring_inputs(algorithm, params, users, ids, cfg) -> list:
    """(adapted models, stacked test inputs) per test-split size, as the evaluation scores them."""
    by_size: dict = {}
    for position, user in enumerate(users):
        by_size.setdefault(len(user.test_y), []).append(position)
    groups = []
    for members in by_size.values():
        group = [users[i] for i in members]
        adapted = evaluation._adapt_together(
            algorithm.loss_fn, params, group, [ids[i] for i in members], cfg, 0, cfg.alpha
        )
        groups.append((adapted, evaluation._stacked_test_splits(group, None)[0]))
    return groups


def scoring_passes(chain, params, groups) -> None:
    """The evaluation's two batched forward passes per test-split size, nothing else."""
    with torch.no_grad():
        for adapted, x in groups:
            chain.logits(adapted, x), evaluation._global_logits(chain, params, x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    engine, algorithm, users, source = hf_engine(50, 10)
    for round_idx in range(3):  # a trained model, not the initial one, for the scoring checks
        engine.train_round(round_idx)
    clients = algorithm.sample_clients(3)
    index = engine.minibatches.batch_index(3, clients)
    batches = engine.minibatches.gather(index)
    params, _ = algorithm.split_state(engine.state)
    rounds = iter(range(10, 10**6))
    r = args.repeats
    with torch.no_grad():
        step_ms = median_ms(lambda: engine.step(dict(params), batches), r)
    size = 2048
    a = torch.randn(size, size)
    gemm_ms = median_ms(lambda: a @ a, 7)
    cfg = algorithm.settings.evaluation
    ids = list(range(len(users)))
    chain, groups = (
        algorithm.paths.hand_batched_form(tuple(users[0].test_x.shape[1:])),
        scoring_inputs(algorithm, params, users, ids, cfg),
    )
    results = {
        "round": {
            "sample_clients_ms": median_ms(lambda: algorithm.sample_clients(3), r),
            "batch_indices_ms": median_ms(lambda: engine.minibatches.batch_index(3, clients), r),
            "gather_ms": median_ms(lambda: engine.minibatches.gather(index), r),
            "local_update_ms": step_ms,
            "train_round_ms": median_ms(lambda: engine.train_round(next(rounds)), r),
        },
        "gemm_gflops": 2 * size**3 / (gemm_ms / 1000) / 1e9,
        "evaluation": {
            "evaluate_ms": median_ms(lambda: algorithm.evaluate(0, engine.state, users), max(5, r // 3)),
            # the users adapted together (one vmapped gradient), then scored user by user (the
            # path of a network that is not a Linear chain, or of a CPU whose batched kernels differ)
            "adaptation_ms": median_ms(
                lambda: evaluation._adapt_together(algorithm.loss_fn, params, users, ids, cfg, 0, cfg.alpha),
                max(5, r // 3),
            ),
            "evaluate_scoring_user_by_user_ms": median_ms(
                lambda: evaluation.evaluate(algorithm.network, params, users, cfg, 0, loss_fn=algorithm.loss_fn),
                max(5, r // 3),
            ),
            # the scoring's forward passes alone (adapted and global model over every test split):
            # matrix products and activations, a floor for the evaluation with the same numbers
            "scoring_passes_ms": median_ms(lambda: scoring_passes(chain, params, groups), max(5, r // 3)),
        },
        "scoring_together_is_bit_exact_here": chain.scores_exactly,
        # where only the global model's batched pass is exact, evaluate scores it alone together
        "global_scoring_together_is_bit_exact_here": chain.scores_global_exactly,
    }
    results.update(
        date=datetime.date.today().isoformat(),
        data=source,
        threads=torch.get_num_threads(),
        command="python benchmarks/profile_round.py " + " ".join(sys.argv[1:]),
    )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "profile_round.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
