"""Any nn.Module as a pure function: dropout off, BatchNorm with batch statistics, the user's
module untouched; the batched (vmapped) local update equals the per-client one for such models."""

import copy

import torch
from torch import nn
from torch.func import vmap

from fedml_perfedavg.core.client_maths import LocalBatches, LocalUpdateConfig, local_update
from fedml_perfedavg.core.functional import functional_network, make_loss_fn, parameters_of


class BatchNormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Dropout(0.5), nn.Linear(4 * 4 * 4, 3)
        )

    def forward(self, x):
        return self.body(x)


def _batches(steps=2, batch=6, clients=None):
    g = torch.Generator().manual_seed(0)
    shape = (clients, steps, batch) if clients else (steps, batch)
    x = lambda: torch.randn(*shape, 1, 6, 6, generator=g, dtype=torch.float64)  # noqa: E731
    y = lambda: torch.randint(0, 3, shape, generator=g)  # noqa: E731
    return LocalBatches(x(), y(), x(), y(), x(), y())


def test_batchnorm_and_dropout_model_is_deterministic_and_left_untouched():
    torch.manual_seed(0)
    model = BatchNormNet().double().train()
    before = copy.deepcopy(model.state_dict())
    network = functional_network(model)
    loss = make_loss_fn(network)
    batches = _batches()
    config = LocalUpdateConfig(variant="exact", alpha=0.1, beta=0.1, local_steps=2)
    a = local_update(loss, parameters_of(model), batches, config)
    b = local_update(loss, parameters_of(model), batches, config)
    assert all(torch.equal(a[k], b[k]) for k in a)  # dropout off: the same function twice
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())  # running stats untouched
    assert model.training and any(isinstance(m, nn.BatchNorm2d) and m.track_running_stats for m in model.modules())
    # BatchNorm uses each batch's own statistics: shifting the whole batch changes nothing
    x = batches.x[0]
    params = parameters_of(model)
    out = torch.func.functional_call(network, params, (x,))
    shifted = torch.func.functional_call(network, params, (x + 3.0,))
    torch.testing.assert_close(out, shifted, rtol=1e-6, atol=1e-6)


def test_vmapped_update_of_a_batchnorm_model_equals_the_per_client_one():
    torch.manual_seed(1)
    model = BatchNormNet().double()
    loss = make_loss_fn(functional_network(model))
    stacked = _batches(clients=3)
    config = LocalUpdateConfig(variant="hf", alpha=0.1, beta=0.1, delta=1e-5, local_steps=2)
    params = parameters_of(model)
    together = vmap(lambda b: local_update(loss, params, b, config))(stacked)
    for c in range(3):
        alone = local_update(loss, params, LocalBatches(*(t[c] for t in stacked)), config)
        for k in alone:
            torch.testing.assert_close(together[k][c], alone[k], rtol=1e-10, atol=1e-12)
