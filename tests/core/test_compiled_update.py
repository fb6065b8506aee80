"""The hand-batched local update compiled one step at a time (core/compiled_update.py)."""

import pytest
import torch

from fedml_perfedavg.core.client_maths import LocalBatches, LocalUpdateConfig, mean_figures
from fedml_perfedavg.core.compiled_update import CompiledLocalUpdate
from fedml_perfedavg.core.functional import functional_network, parameters_of
from fedml_perfedavg.core.hand_batched import IndexedInputs, hand_batched_gradients
from fedml_perfedavg.models import MLP


# Traced whole by torch.compile (fullgraph) and run through AOTAutograd's graph, without inductor's
# C++ code (20-40 s of compiling a variant on a fresh machine): the engine's test
# (tests/engine/test_batched.py) runs HF's step through inductor itself.
@pytest.mark.backend
def test_each_variant_compiled_a_step_at_a_time_is_the_eager_update(monkeypatch):
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, mode, **kw: real_compile(fn, backend="aot_eager", **kw))
    gathers: list = []  # the steps whose inputs were gathered, in order
    real_step = IndexedInputs.step
    monkeypatch.setattr(IndexedInputs, "step", lambda self, t, buffer=None: gathers.append(t) or real_step(self, t))
    for variant in ("sgd", "fo", "exact"):  # HF's: the engine's test (tests/engine/test_batched.py)
        gathers.clear()
        _check_variant(variant, gathers)


def _check_variant(variant, gathers):
    torch.manual_seed(4)
    model = MLP(12, 3, (7,)).double()
    chain, why = hand_batched_gradients(functional_network(model), (12,))
    assert chain is not None, why
    clients, steps, batch = 4, 3, 6
    data, labels = torch.randn(50, 12, dtype=torch.float64), torch.randint(0, 3, (50,))
    index = [torch.randint(0, 50, (steps, clients, batch)) for _ in range(3)]
    lazy = LocalBatches(*(t for i in index for t in (IndexedInputs(data, i), labels[i])))
    gathered = LocalBatches(*(t for i in index for t in (data[i], labels[i])))
    start = {k: v.expand(clients, *v.shape) for k, v in parameters_of(model).items()}
    config = LocalUpdateConfig(variant=variant, alpha=0.3, beta=0.2, delta=1e-3, local_steps=steps)
    expected_figures: list = []
    expected = chain.local_update(start, gathered, config, expected_figures)

    compiled = CompiledLocalUpdate(chain, config)
    for _ in range(2):  # the second call replays the first one's graph
        figures: list = []
        got = compiled(start, lazy, figures)
        for k in expected:
            torch.testing.assert_close(
                got[k], expected[k], rtol=1e-12, atol=1e-14, msg=lambda m, k=k: f"{variant} {k}: {m}"
            )
        got_figures, expected_means = mean_figures(figures), mean_figures(expected_figures)
        torch.testing.assert_close(got_figures, expected_means, rtol=1e-12, atol=1e-14, msg=lambda m: f"{variant}: {m}")
    assert not torch.equal(got["net.1.weight"], start["net.1.weight"]), variant  # it did train
    # each step gathers the roles it reads, once: D alone for SGD, D and D' for FO, all three for exact (and HF)
    roles = {"sgd": 1, "fo": 2, "exact": 3}[variant]
    assert gathers == [t for _ in range(2) for t in range(steps) for _ in range(roles)], variant
