"""Speed of the per-client path vs the batched engine on the paper's MNIST config.

    python benchmarks/speed.py [--repeats 25] [--full-run] [--device cpu|cuda] [--out benchmarks/results]
    python benchmarks/speed.py --paired hf exact [--repeats 100]   # one method against another

Measures training ms/round (fedavg, fo, hf, exact), personalized-evaluation ms (all 50
users), peak memory, an in-run large-GEMM GFLOP/s figure and the fraction of it each variant
reaches (FLOPs counted from the model's shapes), and how ms/round scales with clients per
round and with the number of users. Each (method, path) is measured in its own process so
peak memory is its own. Writes speed.md and speed.json under --out. ``--paired A B`` alternates
A's and B's rounds in one process instead and reports the median ratio of B's round to A's.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedml_perfedavg.algorithms.registry import create_algorithm  # noqa: E402
from fedml_perfedavg.core.types import UserSplit  # noqa: E402
from fedml_perfedavg.data.loading import FederatedData  # noqa: E402
from fedml_perfedavg.engine.batched import BatchedSimulation  # noqa: E402
from fedml_perfedavg.models import create_model  # noqa: E402
from fedml_perfedavg.run.config import resolve  # noqa: E402
from fedml_perfedavg.run.fedml_args import to_fedml_args  # noqa: E402

METHODS = {
    "fedavg": ("FedAvgUpdate", "hf"),
    "fo": ("PerFedAvg", "fo"),
    "hf": ("PerFedAvg", "hf"),
    "exact": ("PerFedAvg", "exact"),
}
# fwd+bwd passes of one batch per local step; exact's Hessian-vector product (forward-over-reverse)
# costs about two more fwd+bwd passes.
PASSES_PER_STEP = {"fedavg": 1, "fo": 2, "hf": 4, "exact": 4}
ROUNDS_PER_BLOCK = 5  # timed rounds between two timed GEMMs
MNIST_ROOT = os.environ.get("PERFEDAVG_MNIST_ROOT", str(REPO.parent / "shared" / "datasets"))


def median_ms(fn, repeats: int, warmup: int = 2) -> float:
    return statistics.median(samples_ms(fn, repeats, warmup))


def samples_ms(fn, repeats: int, warmup: int = 2) -> list:
    """Milliseconds of each of ``repeats`` calls after ``warmup`` calls."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def gemm_gflops(device: str, size: int = 2048, repeats: int = 7) -> float:
    a = torch.randn(size, size, device=device)
    ms = median_ms(lambda: a @ a, repeats)
    return 2 * size**3 / (ms / 1000) / 1e9


def config_for(method: str, clients: int = 10, users: int = 50, device: str = "cpu"):
    optimizer, variant = METHODS[method]
    # n > 50 replicates the paper split's 50 users (load_users): the config only sets sampling,
    # so the paper split's own check (enough MNIST images for n users) does not apply to it.
    split = {} if users == 50 else {"partition_method": "replicated_paper_users"}
    return resolve(
        {},
        dict(
            federated_optimizer=optimizer,
            perfedavg_variant=variant,
            client_num_in_total=users,
            client_num_per_round=clients,
            local_steps=10,
            show_progress=False,
            data_cache_dir=MNIST_ROOT,
            using_gpu=device != "cpu",
            **split,
        ),
    )


def load_users(users: int, device: str):
    from fedml_perfedavg.run.runner import load_split

    if (Path(MNIST_ROOT) / "MNIST" / "raw").exists():
        data = load_split(config_for("hf"))
        source = "real MNIST, paper split"
    else:  # same shapes and sizes, random pixels
        g = torch.Generator().manual_seed(0)
        split = [
            UserSplit(
                torch.rand(n, 1, 28, 28, generator=g),
                torch.randint(0, 10, (n,), generator=g),
                torch.rand(m, 1, 28, 28, generator=g),
                torch.randint(0, 10, (m,), generator=g),
            )
            for n, m in [(980, 160)] * 25 + [(490, 80)] * 25
        ]
        data = FederatedData(split, 10, (1, 28, 28))
        source = "synthetic, MNIST shapes"
    base = data.to(torch.device(device)).users
    return [base[i % len(base)] for i in range(users)], source  # larger n: users replicated


def bare_engine(
    algorithm, users, model: torch.nn.Module, try_hand_batched: bool = True, compile_local_update: bool = False
) -> BatchedSimulation:
    """The batched engine over ``algorithm`` from ``model``'s state, with a driver that samples
    with the algorithm and records nothing."""

    class Driver:
        def sample_clients(self, round_idx):
            return algorithm.sample_clients(round_idx)

        def round_finished(self, round_idx, global_state):
            pass

    return BatchedSimulation(
        algorithm,
        users,
        model.state_dict(),
        Driver(),
        try_hand_batched=try_hand_batched,
        compile_local_update=compile_local_update,
    )


def method_engine(
    method: str, users, device: str = "cpu", clients: int = 10, n: int = 50, compile_local_update: bool = False
):
    """(engine, algorithm): ``method``'s batched engine on the paper's MLP over ``users``' data,
    built as every benchmark builds it (seed 0, a bare driver)."""
    torch.manual_seed(0)
    model = create_model("mlp", (1, 28, 28), 10).to(torch.device(device))
    algorithm = create_algorithm(METHODS[method][0], model, config_for(method, clients, n, device))
    return bare_engine(algorithm, users, model, compile_local_update=compile_local_update), algorithm


def flops_per_round(model: torch.nn.Module, method: str, clients: int, steps: int = 10, batch: int = 40) -> float:
    weights = sum(p.numel() for n, p in model.named_parameters() if n.endswith("weight"))
    forward = 2 * batch * weights
    return 3 * forward * PASSES_PER_STEP[method] * steps * clients


def measure_one(method: str, path: str, repeats: int, device: str, clients: int = 10, users: int = 50) -> dict:
    """Train ms/round and evaluation ms for one (method, path) in this process."""
    dev = torch.device(device)
    config = config_for(method, clients, users, device)
    user_data, source = load_users(users, device)
    torch.manual_seed(0)
    model = create_model("mlp", (1, 28, 28), 10).to(dev)
    from fedml_perfedavg.fedml_bridge.trainer_aggregator import create_fedml_pair

    args = to_fedml_args(config)
    algorithm = create_algorithm(config.train.federated_optimizer, model, config)
    trainer, aggregator = create_fedml_pair(algorithm, model, args)

    # "batched": the default engine (hand-batched gradients where the model is a Linear chain);
    # "vmap": the same engine with torch.func's vmap only, the path any other model takes.
    engine = bare_engine(algorithm, user_data, model, try_hand_batched=path == "batched")
    state = {"round": 0}

    def per_client_round():
        # What FedML's sp loop does per round: for each sampled client, load w, train, read back.
        r = state["round"] = state["round"] + 1
        args.round_idx = r
        w = aggregator.get_model_params()
        updates = []
        for c in algorithm.sample_clients(r):
            trainer.set_model_params(copy.deepcopy(w))
            trainer.set_id(c)
            trainer.train((user_data[c].train_x, user_data[c].train_y), dev, args)
            updates.append((len(user_data[c].train_y), trainer.get_model_params()))
        aggregator.set_model_params(aggregator.on_after_aggregation(aggregator.aggregate(updates)))

    def batched_round():
        state["round"] += 1
        engine.train_round(state["round"])

    state_dict = model.state_dict()
    eval_ms = median_ms(
        lambda: algorithm.evaluate(0, state_dict, user_data, batched=path != "per_client"), max(5, repeats)
    )
    # Rounds are timed in blocks, each block followed by a timed 2048^2 GEMM in this process, and
    # the fraction of the GEMM rate is taken block by block: a machine whose speed drifts (this
    # one moves by 30-50% within the hour) is compared with itself at that moment. A block's first
    # round is not timed: the GEMM before it has just evicted the round's data from the caches,
    # which no round of a run sees.
    train_round = per_client_round if path == "per_client" else batched_round
    gemm = torch.randn(2048, 2048, device=dev)
    for _ in range(2):
        train_round()
        gemm @ gemm
    train_samples, fractions, gemm_rates = [], [], []
    for _ in range(max(1, repeats // ROUNDS_PER_BLOCK)):
        block = samples_ms(train_round, ROUNDS_PER_BLOCK, warmup=1)
        gemm_ms = samples_ms(lambda: gemm @ gemm, 1, warmup=0)[0]
        rate = 2 * 2048**3 / (gemm_ms / 1000) / 1e9
        train_samples += block
        gemm_rates.append(rate)
        fractions.append(flops_per_round(model, method, clients) / 1e9 / (statistics.median(block) / 1000) / rate)
    train_ms = statistics.median(train_samples)
    peak = (
        torch.cuda.max_memory_allocated() / 2**20
        if dev.type == "cuda"
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    )
    return {
        "method": method,
        "path": path,
        "clients": clients,
        "users": users,
        "train_ms": train_ms,
        "train_ms_min": min(train_samples),
        "train_ms_max": max(train_samples),
        "eval_ms": eval_ms,
        "peak_mb": peak,
        "gflop_per_round": flops_per_round(model, method, clients) / 1e9,
        "gemm_gflops_in_run": statistics.median(gemm_rates),
        "gemm_fraction": statistics.median(fractions),
        "gemm_fraction_min": min(fractions),
        "gemm_fraction_max": max(fractions),
        "data": source,
    }


def measure_paired(first: str, second: str, rounds: int, device: str) -> dict:
    """Two methods' batched engines in one process, their rounds alternated: each pair of rounds
    meets the same machine state, so their ratio holds where the machine's speed drifts."""
    user_data, source = load_users(50, device)
    engines = [method_engine(method, user_data, device)[0] for method in (first, second)]
    times: list = [[], []]
    for round_idx in range(rounds + 2):  # two untimed rounds each first
        for engine, samples in zip(engines, times):
            ms = samples_ms(lambda: engine.train_round(round_idx), 1, warmup=0)[0]
            if round_idx >= 2:
                samples.append(ms)
    ratios = [b / a for a, b in zip(*times)]
    return {
        "first": first,
        "second": second,
        "rounds": rounds,
        "data": source,
        "date": time.strftime("%Y-%m-%d"),
        "first_ms": statistics.median(times[0]),
        "second_ms": statistics.median(times[1]),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "second_not_slower_share": sum(r <= 1 for r in ratios) / len(ratios),
    }


def run_isolated(method: str, path: str, repeats: int, device: str, clients: int = 10, users: int = 50) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--one",
            method,
            path,
            "--repeats",
            str(repeats),
            "--device",
            device,
            "--clients",
            str(clients),
            "--users",
            str(users),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def full_run_seconds(device: str) -> dict:
    """A 1000-round HF run, evaluation every 10 rounds, through the normal runner."""
    import tempfile

    from fedml_perfedavg.run.runner import run

    config = resolve(
        {},
        dict(
            comm_round=1000,
            frequency_of_the_test=10,
            data_cache_dir=MNIST_ROOT,
            show_progress=False,
            using_gpu=device != "cpu",
        ),
    )
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(config, tmp)
    return {
        "wall_seconds": time.perf_counter() - start,
        "personalized_accuracy": result.summary["personalized_accuracy"],
    }


def write_report(results: dict, out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "speed.json").write_text(json.dumps(results, indent=2))
    gemm = results["gemm_gflops"]
    lines = [
        f"# Speed: per-client path vs batched engine ({results['device']})",
        "",
        f"Measured {results['date']} with `{results['command']}` on {results['machine']}; "
        f"data: {results['rows'][0]['data']}. Paper MNIST config: n=50, 10 clients/round, tau=10, "
        f"batches 40, MLP 784-80-60-10. Median of {results['repeats']} after warm-up.",
        f"Large GEMM (2048^2 fp32) in the parent process: {gemm:.0f} GFLOP/s. Each row's process times a "
        f"2048^2 GEMM after each block of {ROUNDS_PER_BLOCK} timed rounds (and one untimed round first); `% of "
        "GEMM` is the median over the blocks of the rounds' rate (GFLOP from the model's shapes; median "
        "round of the block) over that GEMM's rate, with the blocks' min-max.",
        "",
        "| method | path | train ms/round | spread (min-max) | GFLOP/round | in-run GEMM GFLOP/s | "
        "% of GEMM (min-max) | eval ms (50 users) | eval / round | peak MB |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results["rows"]:
        spread = f"{r['train_ms_min']:.1f}-{r['train_ms_max']:.1f}" if "train_ms_min" in r else "-"
        lines.append(
            f"| {r['method']} | {r['path']} | {r['train_ms']:.1f} | {spread} | {r['gflop_per_round']:.2f} | "
            f"{r['gemm_gflops_in_run']:.0f} | {100 * r['gemm_fraction']:.0f}% "
            f"({100 * r['gemm_fraction_min']:.0f}-{100 * r['gemm_fraction_max']:.0f}) | {r['eval_ms']:.1f} | "
            f"{r['eval_ms'] / r['train_ms']:.2f} | {r['peak_mb']:.0f} |"
        )
    lines += [
        "",
        "Paths: `per_client` is FedML's loop (one client after the other); `vmap` the batched engine with "
        "torch.func's vmap over the clients (any model); `batched` the default engine, which for a chain of "
        "Linear layers and activations (the paper's MLP) computes every client's gradients as batched matrix "
        "products (`fedml_perfedavg/core/hand_batched.py`).",
        "",
        "| method | batched speed-up over per-client (train) |",
        "| --- | --- |",
    ]
    by = {(r["method"], r["path"]): r for r in results["rows"]}
    for m in METHODS:
        if (m, "per_client") in by and (m, "batched") in by:
            lines.append(
                f"| {m} | {by[(m, 'per_client')]['train_ms'] / by[(m, 'batched')]['train_ms']:.2f}x "
                f"(vmap alone: {by[(m, 'per_client')]['train_ms'] / by[(m, 'vmap')]['train_ms']:.2f}x) |"
            )
    if results.get("scaling"):
        lines += [
            "",
            "Scaling (HF, batched engine): training cost follows the work (clients per round); evaluation follows n.",
            "",
            "| users n | clients/round | train ms/round | ms per client | eval ms (all users) |",
            "| --- | --- | --- | --- | --- |",
        ]
        for r in results["scaling"]:
            lines.append(
                f"| {r['users']} | {r['clients']} | {r['train_ms']:.1f} | {r['train_ms'] / r['clients']:.1f} | "
                f"{r['eval_ms']:.1f} |"
            )
    if results.get("full_run"):
        f = results["full_run"]
        lines += [
            "",
            f"Full 1000-round HF run, evaluation every 10 rounds (`make run`-style, batched engine): "
            f"**{f['wall_seconds']:.0f} s** wall, final personalized accuracy {f['personalized_accuracy']:.4f}.",
        ]
    (out_dir / "speed.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=25, help="timed rounds per (method, path)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--full-run", action="store_true", help="also time a 1000-round HF run")
    parser.add_argument("--no-scaling", action="store_true")
    parser.add_argument(
        "--paired",
        nargs=2,
        metavar=("METHOD", "METHOD"),
        choices=list(METHODS),
        help="only this: two methods' rounds alternated in one process (--repeats pairs); "
        "writes paired_<first>_<second>.json under --out",
    )
    parser.add_argument("--one", nargs=2, metavar=("METHOD", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--clients", type=int, default=10, help=argparse.SUPPRESS)
    parser.add_argument("--users", type=int, default=50, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure_one(*args.one, args.repeats, args.device, args.clients, args.users)))
        return
    command = "python benchmarks/speed.py " + " ".join(sys.argv[1:])
    if args.paired:
        result = dict(measure_paired(*args.paired, args.repeats, args.device), command=command)
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / f"paired_{args.paired[0]}_{args.paired[1]}.json").write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        return
    rows = [run_isolated(m, p, args.repeats, args.device) for m in METHODS for p in ("per_client", "vmap", "batched")]
    scaling = (
        []
        if args.no_scaling
        else [
            run_isolated("hf", "batched", max(3, args.repeats // 2), args.device, clients, users)
            for users, clients in [(50, 10), (50, 20), (50, 50), (200, 10), (1000, 10)]
        ]
    )
    results = {
        "date": time.strftime("%Y-%m-%d"),
        "command": command.strip(),
        "device": args.device,
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}"
        + (f", {torch.cuda.get_device_name()}" if args.device.startswith("cuda") else ""),
        "repeats": args.repeats,
        "gemm_gflops": gemm_gflops(args.device),
        "rows": rows,
        "scaling": scaling,
        "full_run": full_run_seconds(args.device) if args.full_run else None,
    }
    write_report(results, Path(args.out))
    print((Path(args.out) / "speed.md").read_text())


if __name__ == "__main__":
    main()
