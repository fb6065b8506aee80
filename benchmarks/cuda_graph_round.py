"""The batched engine's captured rounds on a GPU (``device_args.capture_rounds``, issue 80 item 5):
their bits against the eager engine's, their speed, and the Table 1 MNIST grid on them.

    python benchmarks/cuda_graph_round.py --mnist-root DIR [--out DIR]
    python benchmarks/cuda_graph_round.py --device cpu --synthetic --rounds 2 --block-rounds 1 \\
        --grid-rounds 1 --full-rounds 2      # the same steps, not captured (tests)

Uses the plugin's algorithm objects and engines directly (FedML is not needed where the GPU is);
each run's data is its seed's paper split of MNIST (float32 on the device), each model
``torch.manual_seed(seed)`` then the paper's MLP. Every round is the engine's whole round: the
host's keyed sampling and minibatch indices, the local training (eager, or one graph replayed),
the divergence guard, the update screen, the average and the round's training figures.

1. ``methods``: for FedAvg, FO, HF and exact, one run eager and one captured for --rounds rounds
   from the same start: the largest difference of their models and whether every round's training
   figures are equal; the first captured round's seconds (warm-up and capture); ms a round of
   each, alternating timed blocks (synchronised at each block's end).
2. ``grid``: the seeds of the MNIST tau=10 cell as one computation (engine/grid.py), eager and
   captured: the largest difference of their models after --rounds rounds, then ms a round of
   all runs, alternating blocks.
3. ``full``: the Table 1 MNIST cells' --full-methods, all seeds, --full-rounds rounds, captured
   (in grid mode where the runs share a computation), each run evaluated every
   ``frequency_of_the_test`` rounds and at the end (the personalized evaluation, on the device):
   wall seconds of each group and its runs' final accuracies.
Writes ``cuda_graph_round.json`` and ``cuda_graph_round.md`` under --out.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from fedml_perfedavg.algorithms.base import initial_global_state  # noqa: E402
from fedml_perfedavg.algorithms.registry import create_algorithm  # noqa: E402
from fedml_perfedavg.core.types import UserSplit  # noqa: E402
from fedml_perfedavg.data.loading import load_federated  # noqa: E402
from fedml_perfedavg.engine.batched import BatchedSimulation  # noqa: E402
from fedml_perfedavg.engine.grid import GridSimulation, why_not_together  # noqa: E402
from fedml_perfedavg.models import create_model  # noqa: E402
from fedml_perfedavg.run.config import Config, load  # noqa: E402
from cuda_check import Driver, synchronize  # noqa: E402  (the round driver that takes each round's figures)

METHODS = ("fedavg", "fo", "hf", "exact")


def config_of(cell: str, method: str, seed: int, root: str, rounds: int = 1000) -> Config:
    path = REPO / "yaml_configs" / f"{cell}_{method}.yaml"
    return load(str(path), [f"random_seed={seed}", f"data_cache_dir={root}", f"comm_round={rounds}"])


def synthetic_users(n: int, samples: int, seed: int) -> List[UserSplit]:
    g = torch.Generator().manual_seed(seed)
    return [
        UserSplit(
            torch.randint(0, 256, (samples, 1, 28, 28), generator=g, dtype=torch.uint8),
            torch.randint(0, 10, (samples,), generator=g),
            torch.randint(0, 256, (samples // 4, 1, 28, 28), generator=g, dtype=torch.uint8),
            torch.randint(0, 10, (samples // 4,), generator=g),
        )
        for _ in range(n)
    ]


class Runs:
    """Each seed's users on the device, loaded once."""

    def __init__(self, root: str, device: torch.device, synthetic: bool) -> None:
        self.root, self.device, self.synthetic = root, device, synthetic
        self._users: Dict[tuple, List[UserSplit]] = {}

    def users(self, config: Config) -> List[UserSplit]:
        key = (config.common.random_seed, config.data.images_per_class)
        if key not in self._users:
            if self.synthetic:
                users = synthetic_users(config.train.client_num_in_total, 200, config.common.random_seed)
            else:
                users = load_federated(
                    config.data.dataset,
                    self.root,
                    config.train.client_num_in_total,
                    config.data.partition_method,
                    config.common.random_seed,
                    images_per_class=config.data.images_per_class,
                    test_images_per_class=config.data.test_images_per_class,
                ).users
            self._users[key] = [UserSplit(*(t.to(self.device) for t in u)) for u in users]
        return self._users[key]

    def engine(self, config: Config, capture: bool) -> BatchedSimulation:
        torch.manual_seed(config.common.random_seed)
        model = create_model("mlp", (1, 28, 28), 10, list(config.model.hidden_sizes))
        algorithm = create_algorithm(config.train.federated_optimizer, model, config)
        state = {k: v.to(self.device) for k, v in initial_global_state(algorithm, model).items()}
        return BatchedSimulation(algorithm, self.users(config), state, Driver(algorithm), capture_rounds=capture)


def block_ms(step: Callable[[int], object], rounds: List[int], device: torch.device) -> float:
    """ms a round over a block of rounds, one synchronisation at its end."""
    synchronize(device)
    start = time.perf_counter()
    for r in rounds:
        step(r)
    synchronize(device)
    return (time.perf_counter() - start) * 1000 / len(rounds)


def alternated(
    eager: Callable[[int], object], captured: Callable[[int], object], first: int, args, size: int, device
) -> Dict:
    """Median ms a round, eager and captured, over ``args.blocks`` alternating blocks of ``size``
    rounds from round ``first``; each block's figures under ``blocks``."""
    samples: Dict[str, List[float]] = {"eager": [], "captured": []}
    counter = iter(range(first, 10**6))
    for _ in range(args.blocks):
        for name, step in (("eager", eager), ("captured", captured)):
            samples[name].append(block_ms(step, [next(counter) for _ in range(size)], device))
    return {**{f"{name}_ms": statistics.median(v) for name, v in samples.items()}, "blocks": samples}


def is_captured(simulation: object) -> bool:
    """Whether an engine or a grid replays a captured graph."""
    captured = getattr(simulation, "captured", None)
    return captured is not None and captured.graphs > 0


def max_difference(a: dict, b: dict) -> float:
    return max(float((a[k].double() - b[k].double()).abs().max()) for k in a)


def methods(runs: Runs, args, device) -> Dict[str, dict]:
    out = {}
    for method in METHODS:
        config = config_of("mnist_tau10_alpha0.01", method, 0, args.mnist_root)
        eager, captured = runs.engine(config, False), runs.engine(config, True)
        for r in range(args.rounds):
            eager.train_round(r)
        synchronize(device)
        started = time.perf_counter()
        captured.train_round(0)
        synchronize(device)
        first_round_s = time.perf_counter() - started
        for r in range(1, args.rounds):
            captured.train_round(r)
        row = {
            "captured": is_captured(captured),
            "first_captured_round_s": first_round_s,
            "max_abs_diff_after_rounds": max_difference(eager.state, captured.state),
            "training_figures_equal": eager.driver.training == captured.driver.training,
            "rounds_compared": args.rounds,
        }
        row.update(alternated(eager.train_round, captured.train_round, args.rounds, args, args.block_rounds, device))
        out[method] = row
        print(method, json.dumps({k: v for k, v in row.items() if k != "blocks"}), flush=True)
    return out


def grid(runs: Runs, args, device) -> Dict[str, dict]:
    out = {}
    for method in METHODS:
        configs = [config_of("mnist_tau10_alpha0.01", method, s, args.mnist_root) for s in range(args.seeds)]
        eager = GridSimulation([runs.engine(c, False) for c in configs])
        captured = GridSimulation([runs.engine(c, True) for c in configs])
        for r in range(args.rounds):  # the same rounds first (the graph captured in the first)
            eager.train_round(r)
            captured.train_round(r)
        difference = max(max_difference(e.state, c.state) for e, c in zip(eager.engines, captured.engines))
        row = alternated(eager.train_round, captured.train_round, args.rounds, args, args.grid_rounds, device)
        row.update(captured=is_captured(captured), max_abs_diff_after_rounds=difference)
        out[method] = row
        print("grid", method, json.dumps({k: v for k, v in row.items() if k != "blocks"}), flush=True)
    return out


def full_group(cell: str, method: str, args, runs: Optional[Runs] = None) -> dict:
    """One Table 1 group (a cell's method, every seed), captured, in grid mode where the runs can
    share a computation (else one after the other), evaluated as a run is; its row."""
    device = torch.device(args.device)
    runs = runs or Runs(args.mnist_root, device, args.synthetic)
    configs = [config_of(cell, method, s, args.mnist_root, args.full_rounds) for s in range(args.seeds)]
    engines = [runs.engine(c, True) for c in configs]
    together = GridSimulation(engines) if why_not_together(engines) is None else None
    every = configs[0].validation.frequency_of_the_test
    synchronize(device)
    started = time.perf_counter()
    evaluations = 0
    for r in range(args.full_rounds):
        if together is not None:
            together.train_round(r)
        else:
            for engine in engines:
                engine.train_round(r)
        if r % every == 0 or r == args.full_rounds - 1:
            results = [e.algorithm.evaluate(r, e.state, e.users) for e in engines]
            evaluations += 1
    synchronize(device)
    accuracies = [100 * result.personalized_accuracy for result in results]
    captured = is_captured(together) if together is not None else all(is_captured(e) for e in engines)
    return {
        "rounds": args.full_rounds,
        "seeds": args.seeds,
        "captured": captured,
        "grid_mode": together is not None,
        "evaluations": evaluations,
        "wall_s": time.perf_counter() - started,
        "personalized_accuracy_percent": accuracies,
        "mean_percent": statistics.mean(accuracies),
        "before_adaptation_percent": [100 * r.accuracy_before_adaptation for r in results],
    }


def full(runs: Runs, args, device) -> Dict[str, dict]:
    groups = [
        (cell, method)
        for cell in args.full_cells
        for method in args.full_methods
        if (REPO / "yaml_configs" / f"{cell}_{method}.yaml").exists()
    ]
    out: Dict[str, dict] = {}
    started = time.perf_counter()
    # One after the other: 8 groups side by side, a process each, on the H200 finished none in 400 s
    # where one alone takes 99 s (benchmarks/results/HISTORY.md, "Captured rounds").
    for cell, method in groups:
        out[f"{cell}_{method}"] = full_group(cell, method, args, runs)
        print("full", cell, method, json.dumps(out[f"{cell}_{method}"]), flush=True)
        Path(args.out, "cuda_graph_round_full_so_far.json").write_text(json.dumps(out, indent=1) + "\n")
    if out:
        out["all_groups"] = {"groups": len(groups), "wall_s": time.perf_counter() - started}
    return out


def markdown(results: dict) -> str:
    lines = [
        f"# Captured rounds on {results['device']} ({results['date']}, torch {results['torch']})",
        "",
        f"Command: `{results['command']}`",
        "",
        "| method | captured | first captured round s | max abs diff | figures equal | eager ms | captured ms "
        "| eager / captured |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for method, r in results["methods"].items():
        lines.append(
            f"| {method} | {r['captured']} | {r['first_captured_round_s']:.2f} | {r['max_abs_diff_after_rounds']:.3g} "
            f"| {r['training_figures_equal']} | {r['eager_ms']:.2f} | {r['captured_ms']:.2f} "
            f"| {r['eager_ms'] / r['captured_ms']:.2f} |"
        )
    lines += ["", f"Grid mode, {results['seeds']} seeds of the MNIST tau=10 cell, ms a round of all runs:", ""]
    lines += [
        "| method | captured | eager ms | captured ms | eager / captured | max abs diff |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for method, r in results["grid"].items():
        lines.append(
            f"| {method} | {r['captured']} | {r['eager_ms']:.2f} | {r['captured_ms']:.2f} "
            f"| {r['eager_ms'] / r['captured_ms']:.2f} "
            f"| {r['max_abs_diff_after_rounds']:.3g} |"
        )
    if results["full"]:
        lines += ["", "Table 1 MNIST cells captured, every seed, evaluated as a run is:", ""]
        lines += [
            "| cell and method | captured | seeds | rounds | wall s | personalized accuracy % (mean) |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        for name, r in results["full"].items():
            if name == "all_groups":
                lines.append(f"| all {r['groups']} groups | | | | {r['wall_s']:.1f} | |")
                continue
            lines.append(
                f"| {name} | {r['captured']} | {r['seeds']} | {r['rounds']} | {r['wall_s']:.1f} "
                f"| {r['mean_percent']:.2f} "
                f"({', '.join(f'{a:.2f}' for a in r['personalized_accuracy_percent'])}) |"
            )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist-root", default=str(REPO.parent / "shared" / "datasets"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--synthetic", action="store_true", help="random uint8 users of 200 images (tests)")
    parser.add_argument("--rounds", type=int, default=20, help="rounds compared, eager against captured")
    parser.add_argument("--blocks", type=int, default=5, help="alternating timed blocks of each kind")
    parser.add_argument("--block-rounds", type=int, default=20, help="rounds in a timed block")
    parser.add_argument("--grid-rounds", type=int, default=10, help="rounds in a timed block of the grid")
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--full-rounds", type=int, default=1000, help="0: no full cells")
    parser.add_argument("--full-cells", nargs="*", default=["mnist_tau10_alpha0.01"])
    parser.add_argument("--full-methods", nargs="*", default=["hf"], help="those with a YAML in the cell")
    parser.add_argument("--sections", nargs="*", default=["methods", "grid", "full"])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    runs = Runs(args.mnist_root, device, args.synthetic)
    results: Dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(
            ["python", "benchmarks/cuda_graph_round.py", *(argv if argv is not None else sys.argv[1:])]
        ),
        "seeds": args.seeds,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sections = {"methods": methods, "grid": grid, "full": full if args.full_rounds else lambda *_: {}}
    for name, section in sections.items():
        if name not in args.sections:
            results[name] = {}
            continue
        try:
            results[name] = section(runs, args, device)
        except Exception as err:  # noqa: BLE001 - a lease is short: keep what the other sections measure
            results[name] = {}
            results[f"{name}_error"] = f"{type(err).__name__}: {err}"[:4000]
            print(f"{name}: {results[f'{name}_error']}", flush=True)
        (out / "cuda_graph_round.json").write_text(json.dumps(results, indent=1) + "\n")  # each section kept
    table = markdown(results)
    (out / "cuda_graph_round.md").write_text(table)
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
