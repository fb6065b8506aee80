"""The batched engine on a GPU: equivalence with the CPU, then speed.

    python benchmarks/cuda_check.py [--mnist-root ../shared/datasets] [--rounds 1000] [--out benchmarks/results]
    python benchmarks/cuda_check.py --compile-only   # torch.compile (CUDA graphs) of the HF round; run it
                                                     # twice: the second run reuses the compiler's cache
    python benchmarks/cuda_check.py --device cpu --synthetic --rounds 3   # the same code on the CPU (tests)

Uses the plugin's algorithm objects and batched engine directly (no FedML loop):
1. equivalence, float64: the batched engine on CUDA vs the per-client maths on the CPU
   (``algorithm.local_update`` per sampled client, plain average), 3 rounds, FedAvg/FO/HF/exact,
   the models and the rounds' training figures (mean loss and accuracy of the local steps);
   and the batched personalized evaluation on CUDA vs the per-user one on the CPU;
2. speed, float32 on real MNIST (paper config): ms per training round of each method (its
   training figures taken every round, as a run does; HF once more without recording them) and
   ms of one personalized evaluation of all 50 users, CUDA-synchronised medians;
3. a full run: Per-FedAvg (HF), tau=10, K rounds, evaluation every 10 rounds, on the GPU; its
   wall time and final personalized accuracy.
Writes cuda.md and cuda.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from fedml_perfedavg.algorithms.registry import create_algorithm  # noqa: E402
from fedml_perfedavg.core.types import UserSplit  # noqa: E402
from fedml_perfedavg.engine.batched import BatchedSimulation  # noqa: E402
from fedml_perfedavg.models import create_model  # noqa: E402
from fedml_perfedavg.run.config import load_yaml, resolve  # noqa: E402

HF_YAML = REPO / "yaml_configs" / "mnist_tau10_alpha0.01_hf.yaml"
METHODS = ("fedavg", "fo", "hf", "exact")


class Driver:
    """The engine's round driver: the algorithm's sampling; at the end of a round, the round's
    training figures taken as a run's driver takes them (one read of the device a round)."""

    def __init__(self, algorithm) -> None:
        self.algorithm = algorithm
        self.training: Dict[int, dict] = {}

    def sample_clients(self, round_idx: int) -> List[int]:
        return self.algorithm.sample_clients(round_idx)

    def round_finished(self, round_idx: int, state) -> None:
        self.training[round_idx] = self.algorithm.training.take(round_idx)


def training_difference(got: Dict[int, dict], reference: Dict[int, dict]) -> float:
    """The largest difference of the rounds' mean training loss and accuracy."""
    return max(abs(got[r][key] - reference[r][key]) for r in reference for key in ("train_loss", "train_accuracy"))


def config_for(method: str, **overrides):
    return resolve(
        load_yaml(str(HF_YAML)),
        {
            "federated_optimizer": "FedAvgUpdate" if method == "fedavg" else "PerFedAvg",
            "perfedavg_variant": "hf" if method == "fedavg" else method,
            "show_progress": False,
            **overrides,
        },
    )


def engine_for(
    config,
    users: List[UserSplit],
    model: torch.nn.Module,
    device: torch.device,
    try_hand_batched: bool = True,
    compile_local_update: bool = False,
    record_training: bool = True,
):
    algorithm = create_algorithm(config.train.federated_optimizer, model, config)
    state = {k: v.to(device) for k, v in model.state_dict().items()}
    engine = BatchedSimulation(
        algorithm, users, state, Driver(algorithm), compile_local_update, try_hand_batched, record_training
    )
    return algorithm, engine


def synthetic_users(n: int, samples: int, dtype: torch.dtype) -> List[UserSplit]:
    g = torch.Generator().manual_seed(0)
    return [
        UserSplit(
            torch.rand(samples, 1, 28, 28, generator=g, dtype=dtype),
            torch.randint(0, 10, (samples,), generator=g),
            torch.rand(samples // 4, 1, 28, 28, generator=g, dtype=dtype),
            torch.randint(0, 10, (samples // 4,), generator=g),
        )
        for _ in range(n)
    ]


def on(users: List[UserSplit], device: torch.device) -> List[UserSplit]:
    return [UserSplit(*(t.to(device) for t in u)) for u in users]


def equivalence(device: torch.device) -> Dict[str, float]:
    """float64: the engine on ``device`` (both paths) against each client updated alone on the CPU."""
    out = {}
    users = synthetic_users(10, 80, torch.float64)
    for method in METHODS:
        config = config_for(
            method,
            client_num_in_total=10,
            client_num_per_round=4,
            local_steps=3,
            beta=0.05,
            batch_size=16,
            meta_batch_size=16,
            hessian_batch_size=16,
        )
        torch.manual_seed(0)
        model = create_model("mlp", (1, 28, 28), 10, [80, 60]).double()
        algorithm = create_algorithm(config.train.federated_optimizer, model, config)
        reference = {k: v.clone() for k, v in model.state_dict().items()}
        reference_training = {}
        for r in range(3):
            updates = [
                algorithm.client_update(r, c, reference, users[c].train_x, users[c].train_y)
                for c in algorithm.sample_clients(r)
            ]
            reference = algorithm.aggregate(r, updates, reference)
            reference_training[r] = algorithm.training.take(r)
        for try_hand_batched in (True, False):
            _, engine = engine_for(config, on(users, device), model, device, try_hand_batched)
            got = engine.run(0, 3)
            path = "default" if try_hand_batched else "vmap"
            out[f"train_{method}_{path}_max_abs_diff"] = max(
                float((got[k].cpu() - reference[k]).abs().max()) for k in reference
            )
            out[f"training_figures_{method}_{path}_max_abs_diff"] = training_difference(
                engine.driver.training, reference_training
            )
        if method == "hf":
            cpu = algorithm.evaluate(0, reference, users, batched=False)
            dev = algorithm.evaluate(0, {k: v.to(device) for k, v in reference.items()}, on(users, device))
            out["evaluation_per_user_accuracy_equal"] = cpu.per_user_accuracy == dev.per_user_accuracy
            out["evaluation_max_abs_loss_diff"] = max(abs(a - b) for a, b in zip(cpu.per_user_loss, dev.per_user_loss))
    return out


def mnist_users(root: str, device: torch.device) -> List[UserSplit]:
    from fedml_perfedavg.data.loading import load_federated

    return on(load_federated("mnist", root, 50, "paper", 0).users, device)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_ms(fn, device: torch.device, repeats: int = 20, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    synchronize(device)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        synchronize(device)
        samples.append((time.perf_counter() - start) * 1000)
    return statistics.median(samples)


def speed(users: List[UserSplit], device: torch.device, repeats: int = 20) -> Dict[str, float]:
    """float32 ms per training round of each method on both engine paths, and one evaluation."""
    out = {}
    for method in METHODS:
        for try_hand_batched in (True, False):
            config = config_for(method)
            torch.manual_seed(0)
            model = create_model("mlp", (1, 28, 28), 10, [80, 60])
            algorithm, engine = engine_for(config, users, model, device, try_hand_batched)
            counter = iter(range(10**6))
            path = "default" if try_hand_batched else "vmap"
            out[f"train_{method}_{path}_ms_per_round"] = timed_ms(
                lambda: engine.train_round(next(counter)), device, repeats
            )
            if method == "hf" and try_hand_batched:
                # an engine recording no training figures: what recording them costs
                _, plain = engine_for(config, users, model, device, record_training=False)
                out["train_hf_default_no_training_figures_ms_per_round"] = timed_ms(
                    lambda: plain.train_round(next(counter)), device, repeats
                )
                out["evaluation_50_users_ms"] = timed_ms(
                    lambda: algorithm.evaluate(0, engine.state, users), device, max(2, repeats // 2)
                )
    return out


def compiled_speed(users: List[UserSplit], device: torch.device, repeats: int = 20) -> Dict[str, float]:
    """HF with ``device_args.compile_local_update`` (CUDA graphs on a GPU): the first round's
    seconds (compiling; shorter when the compiler's on-disk cache holds this graph), then ms per
    round, and the distance to the eager result after 3 rounds."""
    out, states = {}, {}
    for compiled in (False, True):
        config = config_for("hf")
        torch.manual_seed(0)
        model = create_model("mlp", (1, 28, 28), 10, [80, 60])
        _, engine = engine_for(config, users, model, device, compile_local_update=compiled)
        start = time.perf_counter()
        engine.train_round(0)
        synchronize(device)
        if compiled:
            out["compiled_hf_first_round_s"] = time.perf_counter() - start
        for r in (1, 2):
            engine.train_round(r)
        states[compiled] = {k: v.detach().clone() for k, v in engine.state.items()}
        if compiled:
            counter = iter(range(3, 10**6))
            out["compiled_hf_ms_per_round"] = timed_ms(lambda: engine.train_round(next(counter)), device, repeats)
    out["compiled_vs_eager_max_abs_diff_after_3_rounds"] = max(
        float((states[True][k] - states[False][k]).abs().max()) for k in states[True]
    )
    return out


def full_run(users: List[UserSplit], device: torch.device, rounds: int) -> Dict[str, float]:
    """Per-FedAvg (HF), tau=10: K rounds with the evaluation every 10 rounds, wall time and accuracy."""
    config = config_for("hf", comm_round=rounds)
    torch.manual_seed(config.common.random_seed)
    model = create_model("mlp", (1, 28, 28), 10, [80, 60])
    algorithm, engine = engine_for(config, users, model, device)
    start = time.perf_counter()
    for r in range(rounds):
        engine.train_round(r)
        if r % 10 == 0 or r == rounds - 1:
            result = algorithm.evaluate(r, engine.state, users)
    synchronize(device)
    return {
        "full_run_rounds": rounds,
        "full_run_seconds": time.perf_counter() - start,
        "full_run_personalized_accuracy": result.personalized_accuracy,
        "full_run_accuracy_before_adaptation": result.accuracy_before_adaptation,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist-root", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu: the same checks on the CPU")
    parser.add_argument("--synthetic", action="store_true", help="synthetic users instead of MNIST (tests)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument(
        "--compile-only",
        action="store_true",
        help="only measure device_args.compile_local_update on HF; writes cuda_compile.json",
    )
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cuda_check: no CUDA device here (--device cpu runs the same checks on the CPU)", file=sys.stderr)
        return 2
    device = torch.device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    prefix = "cuda" if device.type == "cuda" else "cpu_check"
    results = {
        "device": name,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", "benchmarks/cuda_check.py", *(argv if argv is not None else sys.argv[1:])]),
    }
    users = (
        on(synthetic_users(50, 200, torch.float32), device) if args.synthetic else mnist_users(args.mnist_root, device)
    )
    os.makedirs(args.out, exist_ok=True)
    if args.compile_only:
        results.update(compiled_speed(users, device, args.repeats))
        Path(args.out, f"{prefix}_compile.json").write_text(json.dumps(results, indent=1))
        print(json.dumps(results, indent=1))
        return 0
    results.update(equivalence(device))
    print(json.dumps(results, indent=1), flush=True)
    results.update(speed(users, device, args.repeats))
    print(json.dumps(results, indent=1), flush=True)
    results.update(full_run(users, device, args.rounds))
    Path(args.out, f"{prefix}.json").write_text(json.dumps(results, indent=1))
    lines = [
        f"# CUDA check ({results['date']}, {results['device']}, torch {results['torch']})",
        "",
        f"Command: `{results['command']}`",
        "",
        "| measure | value |",
        "| --- | --- |",
    ]
    lines += [
        f"| {k} | {v:.6g} |" if isinstance(v, float) else f"| {k} | {v} |"
        for k, v in results.items()
        if k not in ("device", "torch", "python", "date", "command")
    ]
    Path(args.out, f"{prefix}.md").write_text("\n".join(lines) + "\n")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
