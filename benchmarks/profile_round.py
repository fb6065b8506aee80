"""Where an HF round and the personalized evaluation spend their time (paper MNIST config).

    python benchmarks/profile_round.py [--repeats 20] [--out benchmarks/results]

Times, in one process, the pieces of the batched engine's round (client sampling, the keyed
minibatch indices, the gather, the clients' local update) and the evaluation of all 50 users
(whole; its adaptation alone; whole with the users scored one by one; and the scoring's forward
passes alone, the adapted and the global model over every test split), a 2048^2 fp32 GEMM
beside them, and whether the evaluation's probe found batched scoring bit-exact on this CPU.
Median of ``--repeats`` after a warm-up call.

"products_alone": the matrix products that one round (and one evaluation) actually calls, taken
from a torch profile with their shapes, strides and scalars, replayed on random numbers with
nothing between them, in blocks alternated with the 2048^2 GEMM and the round: their rate against
the GEMM's, and what that bounds (ratios block by block, then their median). A round that did
nothing but its products would run at ``round_ceiling_share`` of the GEMM's rate by the round's
nominal FLOP count (speed.py's measure); an evaluation that did nothing but its products would
take ``evaluation_floor_of_round`` of a round.
Writes profile_round.json under --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
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


_PRODUCTS = ("aten::bmm", "aten::baddbmm", "aten::baddbmm_", "aten::mm", "aten::addmm", "aten::addmm_")


def recorded_products(fn) -> list:
    """The matrix products ``fn()`` calls (those no other product calls), as (name, shapes,
    strides, scalars, profiled microseconds), in order, from a torch profile."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad(), profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        fn()
    products = []
    for event in prof.events():
        if event.name not in _PRODUCTS or any(child.name in _PRODUCTS for child in event.cpu_children):
            continue
        scalars = [v for v in event.concrete_inputs if isinstance(v, (int, float)) and not isinstance(v, bool)]
        products.append((event.name, event.input_shapes, event.structured_input_strides, scalars, event.cpu_time_total))
    return products


def _operand(shape, strides) -> torch.Tensor:
    extent = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
    return torch.randn(extent).as_strided(shape, strides)


def product_flop(name: str, shapes) -> int:
    """2 m k n (times the batch) of one recorded product."""
    a, b = (shapes[0], shapes[1]) if name in ("aten::bmm", "aten::mm") else (shapes[1], shapes[2])
    batch = a[0] if len(a) == 3 else 1
    return 2 * batch * a[-2] * a[-1] * b[-1]


def replay(products: list):
    """A function that calls ``products`` again on random operands of their shapes and strides,
    one set of operands per (name, shapes, strides): like the round, which reads the same weights
    and inputs in several products, the replay finds its operands in cache, not in fresh memory."""
    calls = []
    shared: dict = {}
    for name, shapes, strides, scalars, _ in products:
        key = (name, str(shapes), str(strides))
        if key not in shared:
            shared[key] = [_operand(shape, stride) for shape, stride in zip(shapes, strides) if shape]
        operands = shared[key]
        if name in ("aten::bmm", "aten::mm"):
            op = torch.bmm if name == "aten::bmm" else torch.mm
            out = operands[2] if len(operands) > 2 else None
            calls.append(lambda op=op, a=operands[0], b=operands[1], out=out: op(a, b, out=out))
        else:
            op = torch.baddbmm if "bmm" in name else torch.addmm
            beta, alpha = (scalars + [1, 1])[:2]
            calls.append(lambda op=op, o=operands, beta=beta, alpha=alpha: op(*o[:3], beta=beta, alpha=alpha))

    def run() -> None:
        for call in calls:
            call()

    return run


def products_alone(round_fn, evaluation_fn, nominal_flop: float, blocks: int, repeats: int) -> dict:
    """The round's and the evaluation's products replayed alone, alternated with a 2048^2 GEMM in
    ``blocks`` blocks of ``repeats`` calls each: medians over the blocks, and the bounds they set."""
    a = torch.randn(2048, 2048)
    found = {"round": recorded_products(round_fn), "evaluation": recorded_products(evaluation_fn)}
    runs = {part: replay(products) for part, products in found.items()}
    samples: dict = {"gemm_gflops": [], "round_ms": []}
    for part in runs:
        samples[f"{part}_products_ms"] = []
    for _ in range(blocks):
        samples["gemm_gflops"].append(2 * 2048**3 / (median_ms(lambda: a @ a, repeats) / 1000) / 1e9)
        for part, run in runs.items():
            samples[f"{part}_products_ms"].append(median_ms(run, repeats))
        samples["round_ms"].append(median_ms(round_fn, repeats))
    gemm = statistics.median(samples["gemm_gflops"])
    result = {
        "blocks": blocks,
        "gemm_gflops": gemm,
        "round_ms": statistics.median(samples["round_ms"]),
        "round_nominal_gflop": nominal_flop / 1e9,
    }
    for part, products in found.items():
        flop = sum(product_flop(name, shapes) for name, shapes, _, _, _ in products)
        ms = statistics.median(samples[f"{part}_products_ms"])
        result[part] = {
            "products": len(products),
            "gflop": flop / 1e9,
            # inside the call, by the profile (one call, the profiler's own cost per operator included)
            "profiled_in_call_ms": sum(us for *_, us in products) / 1000,
            "products_ms": ms,
            "products_gflops": flop / (ms / 1000) / 1e9,
            "share_of_gemm_rate": flop / (ms / 1000) / 1e9 / gemm,
        }
    # Ratios block by block (each block's own GEMM and round), then their median: the machine's
    # pace moves between blocks. A round of nothing but its products: the nominal FLOP count over
    # their time alone, against the GEMM's rate.
    blocks_of = list(zip(samples["gemm_gflops"], samples["round_products_ms"], samples["evaluation_products_ms"]))
    result["round_ceiling_share"] = statistics.median(
        nominal_flop / (products / 1000) / 1e9 / gemm_rate for gemm_rate, products, _ in blocks_of
    )
    result["round_products_of_round"] = statistics.median(
        products / whole for (_, products, _), whole in zip(blocks_of, samples["round_ms"])
    )
    result["evaluation_floor_of_round"] = statistics.median(
        evaluation / whole for (_, _, evaluation), whole in zip(blocks_of, samples["round_ms"])
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--product-blocks", type=int, default=8, help="alternated blocks of the products' replay")
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
    nominal = speed.flops_per_round(algorithm.network, "hf", 10)
    results["products_alone"] = products_alone(
        lambda: engine.train_round(next(rounds)),
        lambda: algorithm.evaluate(0, engine.state, users),
        nominal,
        args.product_blocks,
        max(3, r // 4),
    )
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
