"""The batched engine gives the per-client path's model and evaluation (float64, and on MNIST)."""

import copy

import pytest
import torch
from torch import nn

from fedml_perfedavg.algorithms.base import initial_global_state
from fedml_perfedavg.algorithms.registry import create_algorithm
from fedml_perfedavg.core.types import UserSplit
from fedml_perfedavg.engine.batched import BatchedSimulation
from fedml_perfedavg.engine.plan import batchable_maths, roles_read
from fedml_perfedavg.models import MLP
from fedml_perfedavg.run.config import ConfigError, resolve

from tests.helpers_tiny import DP_SGD

CASES = [("FedAvgUpdate", "hf"), ("PerFedAvg", "fo"), ("PerFedAvg", "hf"), ("PerFedAvg", "exact")]
SMALL = dict(
    client_num_in_total=6,
    client_num_per_round=3,
    local_steps=3,
    batch_size=5,
    meta_batch_size=4,
    hessian_batch_size=6,
    alpha=0.2,
    beta=0.1,
    delta=1e-4,
    comm_round=3,
    frequency_of_the_test=1,
    show_progress=False,
)


class Driver:
    """A round driver that samples with the algorithm and records the global states."""

    def __init__(self, algorithm):
        self.algorithm, self.states = algorithm, []

    def sample_clients(self, round_idx):
        return self.algorithm.sample_clients(round_idx)

    def round_finished(self, round_idx, state):
        self.states.append(state)


def _setup(optimizer, variant, seed=0, **overrides):
    torch.manual_seed(seed)
    users = [
        UserSplit(
            torch.randn(n, 6, dtype=torch.float64),
            torch.randint(0, 3, (n,)),
            torch.randn(9, 6, dtype=torch.float64),
            torch.randint(0, 3, (9,)),
        )
        for n in (20, 24, 30, 20, 26, 22)
    ]
    config = resolve({}, dict(SMALL, federated_optimizer=optimizer, perfedavg_variant=variant, **overrides))
    model = MLP(6, 3, (5, 4)).double()
    return config, users, model


def per_client_rounds(algorithm, users, state, rounds):
    """Reference: every client updated alone, one after the other."""
    for r in range(rounds):
        updates = [
            algorithm.client_update(r, c, state, users[c].train_x, users[c].train_y)
            for c in algorithm.sample_clients(r)
        ]
        state = algorithm.aggregate(r, updates, state)
    return state


@pytest.mark.parametrize("try_hand_batched", [True, False], ids=["hand-batched", "vmap"])
@pytest.mark.parametrize("optimizer,variant", CASES)
def test_batched_engine_equals_per_client_path_float64(optimizer, variant, try_hand_batched, caplog):
    config, users, model = _setup(optimizer, variant)
    algorithm = create_algorithm(optimizer, model, config)
    start = copy.deepcopy(model.state_dict())
    reference = per_client_rounds(algorithm, users, start, config.train.comm_round)
    with caplog.at_level("INFO"):
        engine = BatchedSimulation(
            create_algorithm(optimizer, model, config),
            users,
            start,
            Driver(algorithm),
            try_hand_batched=try_hand_batched,
        )
    assert ("hand-batched matrix products" in caplog.text) == try_hand_batched  # the MLP is a Linear/ELU chain
    got = engine.run(0, config.train.comm_round)
    assert engine.batched
    assert any(not torch.allclose(got[k], start[k]) for k in got)  # it did train
    for k in got:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-10, atol=1e-12)


@pytest.mark.backend  # torch.compile: 60 s alone with a cold inductor cache (a fresh machine), 13 s warm
@pytest.mark.parametrize("hand_batched", [True, False], ids=["chain-step", "vmapped"])
def test_compiled_local_update_gives_the_eager_result(monkeypatch, caplog, hand_batched):
    calls = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or real_compile(fn, **kw))
    # two local steps: the second starts from the moved w (the vmapped path's graph unrolls them:
    # its compile time grows with tau, 56 s at three steps, 42 at two, on the 2-core machine)
    config, users, model = _setup("PerFedAvg", "hf", compile_local_update=True, local_steps=2)
    model = MLP(6, 3, (5,)).double()  # one hidden Linear/ELU: a third fewer kernels for the C++ compiler
    algorithm, one_by_one = (create_algorithm("PerFedAvg", model, config) for _ in range(2))
    start = copy.deepcopy(model.state_dict())
    reference = per_client_rounds(one_by_one, users, start, config.train.comm_round)
    with caplog.at_level("INFO"):
        engine = BatchedSimulation(
            algorithm, users, start, Driver(algorithm), compile_local_update=True, try_hand_batched=hand_batched
        )
    # on the CPU; "reduce-overhead" on CUDA. A Linear chain compiles its own step, once for every
    # step and round (core/compiled_update.py), any other model its vmapped update whole.
    if hand_batched:
        assert calls == [{"mode": "default", "dynamic": False, "fullgraph": True}]
        assert engine.compiled_update is not None and "each local step compiled" in caplog.text
    else:
        assert calls == [{"mode": "default", "dynamic": False}]
        assert engine.compiled_update is None and "compiled whole" in caplog.text
    got = engine.run(0, config.train.comm_round)
    for k in got:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-9, atol=1e-11)
    # the compiled step records the clients' training figures, as each client alone does
    compiled, alone = (
        algorithm.training.take(config.train.comm_round - 1),
        one_by_one.training.take(config.train.comm_round - 1),
    )
    assert compiled["train_clients"] == alone["train_clients"] == 3
    assert compiled["train_loss"] == pytest.approx(alone["train_loss"], rel=1e-9)
    assert compiled["train_accuracy"] == pytest.approx(alone["train_accuracy"], abs=1e-12)
    with pytest.raises(ConfigError, match="device_args.compile_local_update=True: only the batched engine"):
        resolve({}, {"compile_local_update": True, "simulation_engine": "fedml"})


@pytest.mark.parametrize("model_kind", ["mlp", "batchnorm"])
def test_fedavg_aruba_batched_equals_per_client_path_float64(model_kind, caplog):
    # Its clients send back squared-gradient sums in buffers: the engine vmaps whole states.
    config, users, model = _setup("FedAvgARUBA", "hf", aruba_epsilon=0.05, aruba_zeta=0.5)
    if model_kind == "batchnorm":
        users = [UserSplit(u.train_x.repeat(1, 6), u.train_y, u.test_x.repeat(1, 6), u.test_y) for u in users]
        model = ConvBatchNorm().double()
    algorithm = create_algorithm("FedAvgARUBA", model, config)
    start = initial_global_state(algorithm, model)
    reference = per_client_rounds(algorithm, users, start, config.train.comm_round)
    with caplog.at_level("INFO"):
        engine = BatchedSimulation(algorithm, users, start, Driver(algorithm))
    assert "client maths is its own" in caplog.text
    got = engine.run(0, config.train.comm_round)
    assert engine.batched
    for k in got:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-10, atol=1e-12)
    lr = [k for k in got if k.startswith("aruba_lr__")]
    assert lr and all(not torch.allclose(got[k], start[k]) for k in lr)  # the rates were learned
    assert float(got["aruba_tasks"]) == 3 * config.train.comm_round


class ConvBatchNorm(nn.Module):
    """A small model with BatchNorm, as FedML's resnets have."""

    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 3, 3), nn.BatchNorm2d(3), nn.ReLU(), nn.Flatten())
        self.head = nn.Linear(3 * 4 * 4, 3)

    def forward(self, x):
        return self.head(self.features(x.reshape(-1, 1, 6, 6)))


@pytest.mark.parametrize("optimizer,variant", CASES)
def test_batchnorm_model_batched_equals_per_client_and_keeps_its_buffers(optimizer, variant):
    config, users, _ = _setup(optimizer, variant)
    users = [UserSplit(u.train_x.repeat(1, 6), u.train_y, u.test_x.repeat(1, 6), u.test_y) for u in users]
    model = ConvBatchNorm().double()
    algorithm = create_algorithm(optimizer, model, config)
    start = copy.deepcopy(model.state_dict())
    reference = per_client_rounds(algorithm, users, start, config.train.comm_round)
    engine = BatchedSimulation(create_algorithm(optimizer, model, config), users, start, Driver(algorithm))
    got = engine.run(0, config.train.comm_round)
    assert engine.batched
    for k in got:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-10, atol=1e-12)
    for k in ("features.1.running_mean", "features.1.running_var", "features.1.num_batches_tracked"):
        assert torch.equal(got[k], start[k])  # batch statistics are used; running ones travel unchanged
    assert not torch.allclose(got["features.1.weight"], start["features.1.weight"])
    batched = algorithm.evaluate(0, got, users, batched=True)
    per_user = algorithm.evaluate(0, got, users, batched=False)
    assert batched.per_user_accuracy == per_user.per_user_accuracy


class DataDependent(nn.Module):
    """A model vmap cannot batch: Python control flow on a tensor's value."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x):
        out = self.linear(x)
        return out if float(out.detach().sum()) > -1e9 else -out


def test_a_model_vmap_cannot_batch_falls_back_to_the_per_client_path(caplog):
    config, users, _ = _setup("PerFedAvg", "fo")
    model = DataDependent().double()
    algorithm = create_algorithm("PerFedAvg", model, config)
    start = copy.deepcopy(model.state_dict())
    [why] = algorithm.probe_model(start, users[0].train_x[:1], users[0].train_y[:1])
    assert "data-dependent control flow" in why.lower() and not algorithm.paths.vmappable
    reference = per_client_rounds(algorithm, users, start, config.train.comm_round)
    engine = BatchedSimulation(algorithm, users, start, Driver(algorithm))
    got = engine.run(0, config.train.comm_round)
    assert not engine.batched
    for k in got:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-12, atol=1e-14)


def test_compiling_clients_computed_one_by_one_is_said_not_silently_ignored(monkeypatch, caplog):
    monkeypatch.setattr(torch, "compile", lambda *a, **k: pytest.fail("nothing here is compiled"))
    config, users, _ = _setup("PerFedAvg", "fo")
    model = DataDependent().double()
    algorithm = create_algorithm("PerFedAvg", model, config)
    start = copy.deepcopy(model.state_dict())
    algorithm.probe_model(start, users[0].train_x[:1], users[0].train_y[:1])
    with caplog.at_level("WARNING"):
        engine = BatchedSimulation(algorithm, users, start, Driver(algorithm), compile_local_update=True)
    assert not engine.batched and engine.compiled_update is None
    assert "device_args.compile_local_update=True compiles nothing here: clients one by one" in caplog.text


def test_engine_makes_no_dataloader_or_deep_copy_per_step(monkeypatch):
    calls = {"DataLoader": 0, "deepcopy": 0}

    class CountingLoader(torch.utils.data.DataLoader):
        def __init__(self, *a, **k):
            calls["DataLoader"] += 1
            super().__init__(*a, **k)

    real_deepcopy = copy.deepcopy

    def counting_deepcopy(*a, **k):
        calls["deepcopy"] += 1
        return real_deepcopy(*a, **k)

    config, users, model = _setup("PerFedAvg", "hf")
    algorithm = create_algorithm("PerFedAvg", model, config)
    engine = BatchedSimulation(algorithm, users, copy.deepcopy(model.state_dict()), Driver(algorithm))
    # The name wherever it is bound: modules that imported it (``from torch.utils.data import
    # DataLoader``, as data/fedml_format.py does) would not see a patch of torch's module alone.
    import sys

    real_loader = torch.utils.data.DataLoader
    for module in [torch.utils.data, *(m for n, m in list(sys.modules.items()) if n.startswith("fedml_perfedavg"))]:
        if getattr(module, "DataLoader", None) is real_loader:
            monkeypatch.setattr(module, "DataLoader", CountingLoader)
    monkeypatch.setattr(copy, "deepcopy", counting_deepcopy)
    engine.run(0, config.train.comm_round)
    assert calls == {"DataLoader": 0, "deepcopy": 0}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")
@pytest.mark.parametrize("optimizer,variant", CASES)
def test_batched_engine_on_cuda_equals_per_client_path_on_cpu(optimizer, variant):
    config, users, model = _setup(optimizer, variant)
    algorithm = create_algorithm(optimizer, model, config)
    start = copy.deepcopy(model.state_dict())
    reference = per_client_rounds(algorithm, users, start, config.train.comm_round)
    cuda = torch.device("cuda")
    users = [UserSplit(*(t.to(cuda) for t in u)) for u in users]
    cuda_algorithm = create_algorithm(optimizer, model.to(cuda), config)
    engine = BatchedSimulation(cuda_algorithm, users, {k: v.to(cuda) for k, v in start.items()}, Driver(cuda_algorithm))
    got = engine.run(0, config.train.comm_round)
    for k in got:
        torch.testing.assert_close(got[k].cpu(), reference[k], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize(
    "optimizer,variant,roles,whole",
    [
        ("PerFedAvg", "fo", {0, 1}, False),
        ("PerFedAvg", "hf", {0, 1, 2}, False),
        ("PerFedAvg", "exact", {0, 1, 2}, False),
        ("FedAvgUpdate", "hf", {0}, False),
        ("FedAvgARUBA", "hf", {0}, True),
    ],
)
def test_the_algorithm_declares_what_the_engine_gathers_and_returns(optimizer, variant, roles, whole):
    config, users, model = _setup(optimizer, variant)
    algorithm = create_algorithm(optimizer, model, config)
    engine = BatchedSimulation(algorithm, users, initial_global_state(algorithm, model), Driver(algorithm))
    assert engine.plan.roles_read == roles and engine.plan.whole_state is whole
    [index] = algorithm.batch_indices(0, [0], [len(users[0].train_y)])
    batches = engine.minibatches.gather(index)
    for role in (1, 2):  # a role never read is D's tensors, not a gather of its own
        assert (batches[2 * role] is batches[0]) is (role not in roles)


def test_an_algorithm_with_its_own_maths_gets_every_role_unless_it_says_otherwise():
    from tests.algorithms import sign_sgd  # noqa: F401  registers SignSGD

    config, _, model = _setup("PerFedAvg", "fo")
    algorithm = create_algorithm("SignSGD", model, resolve({}, dict(SMALL, federated_optimizer="SignSGD")))
    assert batchable_maths(algorithm) is None and roles_read(algorithm) == {0, 1, 2}


def test_a_round_larger_than_one_computation_trains_in_pieces_with_the_same_result(monkeypatch):
    config, users, model = _setup("PerFedAvg", "hf", client_num_per_round=5)
    algorithm = create_algorithm("PerFedAvg", model, config)
    start = copy.deepcopy(model.state_dict())
    reference = per_client_rounds(algorithm, users, start, config.train.comm_round)
    engine = BatchedSimulation(create_algorithm("PerFedAvg", model, config), users, start, Driver(algorithm))
    calls = []
    original = engine._batched_updates
    monkeypatch.setattr(engine, "clients_per_computation", 2)
    monkeypatch.setattr(
        engine, "_batched_updates", lambda r, clients: calls.append(len(clients)) or original(r, clients)
    )
    got = engine.run(0, config.train.comm_round)
    assert calls == [2, 2, 1] * config.train.comm_round  # 5 clients a round: three computations
    for k in got:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-10, atol=1e-12)


def test_the_logged_plan_says_how_clients_users_and_gradients_are_computed(caplog):
    """One line at the start names every decision: the clients' path, the evaluation's, and the
    gradient oracle (forward-over-reverse unless the model has no forward-mode derivative)."""
    from fedml_perfedavg.core.client_maths import ReverseModeGradients

    config, users, model = _setup("PerFedAvg", "exact")
    algorithm = create_algorithm("PerFedAvg", model, config)
    with caplog.at_level("INFO"):
        BatchedSimulation(algorithm, users, initial_global_state(algorithm, model), Driver(algorithm))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("batched engine:"))
    assert "chain of Linear layers" in line
    assert "evaluation: users adapted together, scored together by the hand-batched form" in line
    assert line.endswith("client maths: torch.func gradients, Hessian-vector products forward-over-reverse")
    algorithm.paths.forward_ad = False  # what the probe finds of a model with no forward-mode derivative
    assert isinstance(algorithm.paths.gradient_oracle(algorithm.loss_fn), ReverseModeGradients)
    caplog.clear()
    with caplog.at_level("INFO"):
        BatchedSimulation(
            algorithm, users, initial_global_state(algorithm, model), Driver(algorithm), try_hand_batched=False
        )
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("batched engine:"))
    assert "vmapped with torch.func" in line and line.endswith("Hessian-vector products reverse-over-reverse")


def test_dp_sgds_draws_are_kept_from_round_to_round_and_let_go_when_the_run_ends():
    """The private chain's rounds reuse one round's draw memory for the next (RoundBuffers), and
    the engine lets it go when its run ends: a grid prepares all its runs before the first starts."""
    config, users, model = _setup("PerFedAvg", "hf", **DP_SGD)
    algorithm = create_algorithm("PerFedAvg", model, config)
    engine = BatchedSimulation(algorithm, users, initial_global_state(algorithm, model), Driver(algorithm))
    assert engine.gathers_lazily  # the private chain, its inputs gathered use by use
    engine.train_round(0)
    kept = dict(engine.minibatches._private_buffers._kept)
    assert kept and all(name.startswith("noise ") for name in kept)  # no inputs kept: they are gathered
    engine.train_round(1)
    assert all(engine.minibatches._private_buffers._kept[name][0] is kept[name][0] for name in kept)
    engine.run(2, 3)
    assert engine.minibatches._private_buffers._kept == {}
