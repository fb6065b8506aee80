"""An HF round on a GPU with its local update captured as one CUDA graph (issue 57 item 2): how far
the launch-bound eager round comes down when a round's clients' whole local update and their plain
average replay as one graph, against the batched engine's eager round on the same machine.

    python benchmarks/cuda_graph_round.py --mnist-root DIR [--rounds 30] [--out DIR]
    python benchmarks/cuda_graph_round.py --device cpu --synthetic --rounds 3   # the same steps, not captured

A prototype measurement, not the plugin's engine: the graph holds the label gathers, the
hand-batched local update of every client (the paper's MLP, HF, tau 10, batches of 40) and the
uniform average written back into the global model; each round the host draws the keyed minibatch
indices (the algorithm's own) and copies them in. What the engine's round does besides (the update
screen, the divergence guard, per-client state dicts, the driver) is not in it. Writes
``cuda_graph_round.json`` under --out: ms a round of the eager engine and of the graph (timed over
a block of rounds, one synchronisation at its end, and synchronised every round), the host's
share (drawing the indices), and the largest difference of the global model after --rounds rounds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Dict

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cuda_check  # noqa: E402  (its config, data and engine)

from fedml_perfedavg.core.types import input_dtype  # noqa: E402
from fedml_perfedavg.models import create_model  # noqa: E402


class CapturedRounds:
    """The rounds of ``engine`` (hand-batched, plain average) as one graph replayed per round."""

    def __init__(self, engine, capture: bool) -> None:
        self.engine, self.algorithm = engine, engine.algorithm
        assert engine.hand_batched is not None, engine.plan.describe()
        params, _ = self.algorithm.split_state(engine.state)
        self.w = {k: v.detach().clone() for k, v in params.items()}  # the global model, updated in place
        index = self.index_of(0)
        self.clients = index.shape[1]
        device = engine.minibatches.training_data[0].device
        self.index = index.to(device)  # (roles, clients, steps, batch): the graph's one input
        # two pinned host buffers in turn, each reused only once its last copy to the device ran
        on_cuda = device.type == "cuda"
        self.hosts = [torch.empty_like(index).pin_memory() if on_cuda else torch.empty_like(index) for _ in range(2)]
        self.copied: list = [None, None]
        self.graph = None
        if capture:
            start = {k: v.clone() for k, v in self.w.items()}
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up outside the graph (cuBLAS handles, the oracle's buffers)
                for _ in range(3):
                    self.step()
            torch.cuda.current_stream().wait_stream(stream)
            self.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self.graph):
                self.step()
            for k, v in self.w.items():  # the warm-up trained it: back to the start
                v.copy_(start[k])

    def index_of(self, round_idx: int) -> torch.Tensor:
        clients = self.algorithm.sample_clients(round_idx)
        return torch.stack(self.engine.minibatches.batch_index(round_idx, clients))

    def step(self) -> None:
        batches = self.engine.minibatches.gather(list(self.index), lazy_inputs=True)  # the engine's own gathers
        start = {k: v.unsqueeze(0).expand(self.clients, *v.shape) for k, v in self.w.items()}
        trained = self.engine.train_from(start, batches)
        for k, v in trained.items():
            self.w[k].copy_(v.mean(0))

    def round(self, round_idx: int) -> None:
        turn = round_idx % 2
        if self.copied[turn] is not None:
            self.copied[turn].synchronize()
        self.hosts[turn].copy_(self.index_of(round_idx))
        self.index.copy_(self.hosts[turn], non_blocking=True)
        if self.index.is_cuda:
            self.copied[turn] = torch.cuda.Event()
            self.copied[turn].record()
        if self.graph is not None:
            self.graph.replay()
        else:
            self.step()


def fresh_engine(users, device):
    config = cuda_check.config_for("hf")
    torch.manual_seed(0)
    model = create_model("mlp", tuple(users[0].train_x.shape[1:]), 10, [80, 60]).to(input_dtype(users[0].train_x))
    return cuda_check.engine_for(config, users, model, device)[1]


def block_ms(fn, rounds: range, device) -> float:
    """ms a round over a block of rounds, one synchronisation at its end."""
    cuda_check.synchronize(device)
    start = time.perf_counter()
    for r in rounds:
        fn(r)
    cuda_check.synchronize(device)
    return (time.perf_counter() - start) * 1000 / len(rounds)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mnist-root", default=str(cuda_check.REPO.parent / "shared" / "datasets"))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--synthetic", action="store_true")
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--blocks", type=int, default=5, help="alternating timed blocks of each kind")
    parser.add_argument("--block-rounds", type=int, default=20, help="rounds in a timed block")
    parser.add_argument("--out", default=str(cuda_check.REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    users = (
        cuda_check.on(cuda_check.synthetic_users(50, 200, torch.float32), device)
        if args.synthetic
        else cuda_check.mnist_users(args.mnist_root, device)
    )
    capture = device.type == "cuda"
    results: Dict[str, object] = {
        "device": torch.cuda.get_device_name(device) if capture else "cpu",
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "command": " ".join(["python", "benchmarks/cuda_graph_round.py", *(argv or sys.argv[1:])]),
        "captured": capture,
    }
    # the same rounds, eager engine against the graph, from the same start
    eager = fresh_engine(users, device)
    for r in range(args.rounds):
        eager.train_round(r)
    started = time.perf_counter()
    try:
        graph = CapturedRounds(fresh_engine(users, device), capture)
    except Exception as err:  # noqa: BLE001 - a step the graph cannot hold: say which, time the steps uncaptured
        results["capture_error"] = f"{type(err).__name__}: {err}"[:2000]
        print(results["capture_error"], flush=True)
        results["captured"] = False
        graph = CapturedRounds(fresh_engine(users, device), False)
    results["capture_s"] = time.perf_counter() - started
    for r in range(args.rounds):
        graph.round(r)
    reference, _ = eager.algorithm.split_state(eager.state)
    results["max_abs_diff_after_rounds"] = max(float((graph.w[k] - reference[k]).abs().max()) for k in reference)
    results["rounds_compared"] = args.rounds
    print(json.dumps(results, indent=1), flush=True)
    # speed, alternating blocks of rounds (the host behind a lent GPU drifts)
    blocks: Dict[str, list] = {"eager_ms": [], "graph_block_ms": [], "graph_synchronised_ms": [], "host_index_ms": []}
    counter = iter(range(args.rounds, 10**6))
    size = args.block_rounds
    for _ in range(args.blocks):
        blocks["eager_ms"].append(block_ms(eager.train_round, [next(counter) for _ in range(size)], device))
        blocks["graph_block_ms"].append(block_ms(graph.round, [next(counter) for _ in range(size)], device))
        per_round = [block_ms(graph.round, [next(counter)], device) for _ in range(size)]
        blocks["graph_synchronised_ms"].append(statistics.median(per_round))
        start = time.perf_counter()
        for _ in range(size):
            graph.index_of(next(counter))
        blocks["host_index_ms"].append((time.perf_counter() - start) * 1000 / size)
    results.update({k: statistics.median(v) for k, v in blocks.items()})
    results["blocks"] = blocks
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, "cuda_graph_round.json").write_text(json.dumps(results, indent=1) + "\n")
    print(json.dumps({k: v for k, v in results.items() if k != "blocks"}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
