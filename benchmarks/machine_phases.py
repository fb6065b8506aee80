"""What this machine's slow ("loud") phases slow down: a diagnostic, sampled over time.

    python benchmarks/machine_phases.py [--samples 30] [--out benchmarks/results]

Every couple of seconds, in one process: the HF finite-difference Hessian-vector product of a
paper-sized step (10 clients, batches of 40, MLP 784-80-60-10, hand-batched) with 2 torch threads
and with 1, a 2048^2 fp32 GEMM with 2 threads, and a copy of 8 MB (cache-sized) and of 64 MB
(memory-sized). A phase that slows the 2-thread product but not the 1-thread one, the GEMM or the
copies is one in which the two threads' many short parallel sections cost more, not one short of
arithmetic or memory bandwidth. Writes machine_phases.json under --out.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "benchmarks"))

from speed import median_ms  # noqa: E402

from fedml_perfedavg.core.hand_batched import hand_batched_gradients  # noqa: E402
from fedml_perfedavg.models import create_model  # noqa: E402


def median_seconds(fn, repeats: int) -> float:
    return median_ms(fn, repeats, warmup=1) / 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", type=int, default=30)
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()
    torch.manual_seed(0)
    network = create_model("mlp", (1, 28, 28), 10)
    chain, why = hand_batched_gradients(network, (1, 28, 28))
    assert chain is not None, why
    clients, batch = 10, 40
    params = {k: v.detach().expand(clients, *v.shape).contiguous() for k, v in network.named_parameters()}
    direction = {k: 0.01 * torch.randn_like(v) for k, v in params.items()}
    out = {k: torch.empty_like(v) for k, v in params.items()}
    x = torch.rand(clients, batch, 784)
    y = torch.nn.functional.one_hot(torch.randint(0, 10, (clients, batch)), 10).float()
    hvp = lambda: chain.finite_difference_hvp(params, direction, x, y, 1e-3, out=out)  # noqa: E731
    gemm = torch.randn(2048, 2048)
    small, large = torch.randn(2 * 2**20), torch.randn(16 * 2**20)
    small_out, large_out = torch.empty_like(small), torch.empty_like(large)
    threads = torch.get_num_threads()
    rows = []
    for _ in range(args.samples):
        torch.set_num_threads(2)
        row = {
            "time": time.strftime("%H:%M:%S"),
            "hvp_ms_2_threads": 1e3 * median_seconds(hvp, 50),
            "gemm_gflops_2_threads": 2 * 2048**3 / median_seconds(lambda: gemm @ gemm, 3) / 1e9,
            "copy_8mb_gb_s": 2 * small.numel() * 4 / median_seconds(lambda: small_out.copy_(small), 20) / 1e9,
            "copy_64mb_gb_s": 2 * large.numel() * 4 / median_seconds(lambda: large_out.copy_(large), 5) / 1e9,
        }
        torch.set_num_threads(1)
        row["hvp_ms_1_thread"] = 1e3 * median_seconds(hvp, 50)
        torch.set_num_threads(threads)
        rows.append(row)
        print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
        time.sleep(1)
    result = {
        "date": time.strftime("%Y-%m-%d"),
        "command": "python benchmarks/machine_phases.py " + " ".join(sys.argv[1:]),
        "samples": rows,
    }
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "machine_phases.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
