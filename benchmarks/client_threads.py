"""Issue 80 item 2: a round's clients split over 2 threads of one intra-op thread each, against all
of them in one computation on torch's 2 threads (OpenMP inside each op), rounds alternated.

    python benchmarks/client_threads.py [--method hf] [--clients 10] [--users 50] [--rounds 30]

Three batched engines over the paper's MNIST split (``speed.method_engine``): one trains the round's
clients together on 2 threads; the other two each train half of them, side by side on a 2-thread
pool under ``torch.set_num_threads(1)``, from the same global model. Prints whether the halves give
the clients' bits of the whole, and the median ratio split/whole over the alternated rounds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from speed import load_users, method_engine  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="hf")
    parser.add_argument("--clients", type=int, default=10)
    parser.add_argument("--users", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(2)
    users, _ = load_users(args.users, "cpu")
    whole, algorithm = method_engine(args.method, users, clients=args.clients, n=len(users))
    halves = [method_engine(args.method, users, clients=args.clients, n=len(users))[0] for _ in range(2)]
    pool = ThreadPoolExecutor(2)

    def together(round_idx: int) -> list:
        return whole.train_clients(round_idx, algorithm.sample_clients(round_idx), whole.state)

    def split(round_idx: int) -> list:
        clients = algorithm.sample_clients(round_idx)
        half = len(clients) // 2
        torch.set_num_threads(1)
        try:
            parts = [
                pool.submit(engine.train_clients, round_idx, share, whole.state)
                for engine, share in zip(halves, (clients[:half], clients[half:]))
            ]
            return parts[0].result() + parts[1].result()
        finally:
            torch.set_num_threads(2)

    for round_idx in range(3):  # warm-up
        together(round_idx)
        split(round_idx)
    same = all(torch.equal(a[1][k], b[1][k]) for a, b in zip(together(5), split(5)) for k in a[1])
    ratios = []
    for round_idx in range(args.rounds):
        start = time.perf_counter()
        together(round_idx)
        middle = time.perf_counter()
        split(round_idx)
        ratios.append((time.perf_counter() - middle) / (middle - start))
    print(
        f"{args.method}, {args.clients} clients of {args.users} users: same bits {same}; split/whole "
        f"{statistics.median(ratios):.3f} (median of {args.rounds} alternated rounds, "
        f"{min(ratios):.2f}-{max(ratios):.2f})"
    )


if __name__ == "__main__":
    main()
