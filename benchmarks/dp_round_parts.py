"""Where DP-SGD's HF round spends its time on the batched engine's DP chain path (the quick start's
config, sigma 1, C 1, 10 clients a round): the round's private draws and their stacking
(``Minibatches.round_batches``), then the clients' local steps; the median of rounds 1-5, and a
checksum of round 5's models (equal across thread counts, and across versions that change no bits).

    python benchmarks/dp_round_parts.py [--threads 2] [--mnist-root ../shared/datasets]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, REPO)

DP = {
    "dp_args.enable_dp": True,
    "dp_args.dp_solution_type": "dpsgd",
    "dp_args.noise_multiplier": 1.0,
    "dp_args.max_grad_norm": 1.0,
    "dp_args.delta": 1e-5,
}


class _Driver:
    def __init__(self, algorithm) -> None:
        self.algorithm = algorithm

    def sample_clients(self, round_idx: int):
        return self.algorithm.sample_clients(round_idx)

    def round_finished(self, round_idx: int, state) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--mnist-root", default=os.path.join(REPO, "..", "shared", "datasets"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from fedml_perfedavg.algorithms import create_algorithm
    from fedml_perfedavg.engine.batched import BatchedSimulation
    from fedml_perfedavg.models import create_model
    from fedml_perfedavg.run.config import load_yaml, resolve
    from fedml_perfedavg.run.runner import load_split

    overrides = {"data_cache_dir": args.mnist_root, "show_progress": False, **DP}
    config = resolve(load_yaml(os.path.join(REPO, "yaml_configs", "quickstart_mnist_hf.yaml")), overrides)
    users = load_split(config).users
    torch.manual_seed(0)
    model = create_model("mlp", (1, 28, 28), 10, [80, 60])
    algorithm = create_algorithm(config.train.federated_optimizer, model, config)
    state = {k: v.detach() for k, v in model.state_dict().items()}
    algorithm.probe_model(state, users[0].train_x[:40], users[0].train_y[:40])
    engine = BatchedSimulation(algorithm, users, state, _Driver(algorithm))
    params, _ = algorithm.split_state(engine.state)
    draws, steps = [], []
    for round_idx in range(6):
        clients = algorithm.sample_clients(round_idx)
        start = time.perf_counter()
        batches = engine.minibatches.round_batches(round_idx, clients, engine.gathers_lazily)
        drawn = time.perf_counter()
        with torch.no_grad():
            trained, _ = engine.step(params, batches)
        del batches  # as the engine's round lets its draws go: the next round's reuse their memory
        done = time.perf_counter()
        if round_idx:
            draws.append(drawn - start)
            steps.append(done - drawn)
    checksum = float(sum(v.double().sum() for v in trained.values()))
    print(
        f"{args.threads} threads: draws and stacking {1000 * statistics.median(draws):.1f} ms, "
        f"steps {1000 * statistics.median(steps):.1f} ms; round 5's checksum {checksum!r}"
    )


if __name__ == "__main__":
    main()
