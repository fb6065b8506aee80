"""Issue 80 item 1: the whole local update (all tau steps) traced as one graph by torch.compile,
against the engine's compiled step (``device_args.compile_local_update``) and the eager path.

    python benchmarks/whole_loop_compile.py [--method hf] [--gather before|inside] [--blocks 8]

Three batched engines on the paper's MNIST config (10 of 50 users a round, tau 10, batches of 40):
eager; the engine's compiled local update (one step a call, core/compiled_update.py); and a
whole-loop variant of it defined here: the tau steps unrolled in one compiled function, the
minibatches gathered before the call (``before``) or inside the graph, a step at a time
(``inside``). Prints the compile times (the first round's), the largest difference of the
whole-loop model from the eager one after a round, and the median over ``--blocks`` blocks of 5
alternated rounds of compiled/eager for both compiled paths. A prototype that measures, not a path
of the engine.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

import speed  # noqa: E402
from fedml_perfedavg.core.client_maths import FunctionalSteps, LocalBatches, step_direction  # noqa: E402
from fedml_perfedavg.core.compiled_update import CompiledLocalUpdate  # noqa: E402
from fedml_perfedavg.core.hand_batched import IndexedInputs  # noqa: E402
from fedml_perfedavg.core.types import gather_inputs, model_inputs  # noqa: E402


class WholeLoop(CompiledLocalUpdate):
    """The local update's tau steps as one compiled function (no training figures)."""

    def __init__(self, oracle, config, gather_inside: bool) -> None:
        self.oracle, self.config, self.gather_inside = oracle, config, gather_inside
        self._loop = torch.compile(self._all_steps, dynamic=False, fullgraph=True)

    def _all_steps(self, w, roles):
        for t in range(self.config.train.local_steps):
            tensors = []
            for x, y in roles:
                if isinstance(x, tuple):  # (stored data, index): step t's rows gathered in the graph
                    data, index = x
                    rows = index[t]
                    x_t = model_inputs(data.index_select(0, rows.reshape(-1))).view(1, *rows.shape, *data.shape[1:])
                else:
                    x_t = x[t : t + 1]
                tensors += [x_t, y[t : t + 1]]
            steps = FunctionalSteps(self.oracle, LocalBatches(*tensors), self.config.step)
            direction = step_direction(steps, w, 0, self.config.train.alpha, self.config.delta, None)
            w = steps.move(w, direction, self.config.train.beta)
        return w

    def __call__(self, params, batches, figures=None):
        assert figures is None
        roles = []
        for role in range(3):
            if role >= self.config.step.batch_roles:
                roles.append(roles[0])
                continue
            x, y = batches[2 * role], batches[2 * role + 1]
            if isinstance(x, IndexedInputs):
                gathered = gather_inputs(x.data, x.index.reshape(-1)).view(*x.index.shape, *x.data.shape[1:])
                x = (x.data, x.index) if self.gather_inside else gathered
            roles.append((x, y))
        return self._loop({k: v.contiguous() for k, v in params.items()}, roles)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--method", default="hf", choices=["hf", "fo", "exact"])
    parser.add_argument("--gather", default="before", choices=["before", "inside"])
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(2)
    users, _ = speed.load_users(50, "cpu")
    eager = speed.method_engine(args.method, users)[0]
    step = speed.method_engine(args.method, users, compile_local_update=True)[0]
    whole = speed.method_engine(args.method, users, compile_local_update=True)[0]
    whole.reports_training = False
    whole.compiled_update = WholeLoop(whole.hand_batched, whole.algorithm.standard_update, args.gather == "inside")
    seconds = []
    for engine in (step, whole):
        start = time.perf_counter()
        engine.train_round(0)
        seconds.append(time.perf_counter() - start)
    eager.train_round(0)
    difference = max(float((eager.state[k] - whole.state[k]).abs().max()) for k in eager.state)
    counter = iter(range(1, 10**6))
    by_step, by_loop = [], []
    for _ in range(args.blocks):
        e = speed.median_ms(lambda: eager.train_round(next(counter)), 5, warmup=0)
        by_step.append(speed.median_ms(lambda: step.train_round(next(counter)), 5, warmup=0) / e)
        by_loop.append(speed.median_ms(lambda: whole.train_round(next(counter)), 5, warmup=0) / e)
    print(
        f"{args.method}, gathered {args.gather}: compile {seconds[0]:.1f} s (a step) and {seconds[1]:.1f} s (the "
        f"loop); the loop's model {difference:.1e} from eager after a round; compiled/eager: a step "
        f"{statistics.median(by_step):.3f}, the whole loop {statistics.median(by_loop):.3f} (medians of "
        f"{args.blocks} blocks of 5 alternated rounds; eager {e:.1f} ms)"
    )


if __name__ == "__main__":
    main()
