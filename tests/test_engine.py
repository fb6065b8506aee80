"""The batched engine gives the per-client path's model and evaluation (float64, and on MNIST)."""
import copy

import pytest
import torch

from fedml_perfedavg.config import SCHEMA, ConfigError, resolve
from fedml_perfedavg.engine import BatchedSimulation
from fedml_perfedavg.evaluation import UserSplit, personalized_evaluation, personalized_evaluation_batched
from fedml_perfedavg.models import MLP
from fedml_perfedavg.registry import algorithm_factory
from fedml_perfedavg.sampling import sample_clients

from .conftest import needs_mnist

CASES = [("FedAvg", "hf"), ("PerFedAvg", "fo"), ("PerFedAvg", "hf"), ("PerFedAvg", "exact")]


def _setup(optimizer, variant, seed=0):
    torch.manual_seed(seed)
    users = [UserSplit(torch.randn(n, 6, dtype=torch.float64), torch.randint(0, 3, (n,)),
                       torch.randn(9, 6, dtype=torch.float64), torch.randint(0, 3, (9,))) for n in (20, 24, 30, 20, 26)]
    config = resolve({}, dict(federated_optimizer=optimizer, perfedavg_variant=variant, client_num_in_total=5,
                              client_num_per_round=3, local_steps=3, batch_size=5, meta_batch_size=4,
                              hessian_batch_size=6, alpha=0.2, beta=0.1, delta=1e-4, comm_round=3,
                              frequency_of_the_test=1, show_progress=False))
    model = MLP(6, 3, (5, 4)).double()
    args = config.to_fedml_args()
    return config, users, model, args


def _per_client_rounds(config, users, model, args):
    trainer, aggregator = algorithm_factory(config.federated_optimizer)(model, config, args)
    for r in range(config.comm_round):
        args.round_idx = r
        w = aggregator.get_model_params()
        updates = []
        for c in sample_clients(config.random_seed, r, config.client_num_in_total, config.client_num_per_round):
            trainer.set_model_params(copy.deepcopy(w))
            trainer.set_id(c)
            trainer.train((users[c].train_x, users[c].train_y), torch.device("cpu"), args)
            updates.append((len(users[c].train_y), trainer.get_model_params()))
        aggregator.set_model_params(aggregator.aggregate(updates))
    return aggregator.get_model_params()


@pytest.mark.parametrize("optimizer,variant", CASES)
def test_batched_engine_equals_per_client_path_float64(optimizer, variant):
    config, users, model, args = _setup(optimizer, variant)
    reference = _per_client_rounds(config, users, copy.deepcopy(model), args)
    _, users, model, args = _setup(optimizer, variant)
    trainer, aggregator = algorithm_factory(config.federated_optimizer)(model, config, args)
    engine = BatchedSimulation(config, users, trainer, aggregator)
    for r in range(config.comm_round):
        engine.train_round(r)
    got = aggregator.get_model_params()
    start = _setup(optimizer, variant)[2].state_dict()
    assert any(not torch.allclose(got[k], start[k]) for k in got)  # it did train
    for k in got:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-10, atol=1e-12)


def test_compiled_local_update_gives_the_eager_result(monkeypatch):
    calls = []
    real_compile = torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or real_compile(fn, **kw))
    config, users, model, args = _setup("PerFedAvg", "hf")
    reference = _per_client_rounds(config, users, copy.deepcopy(model), args)
    compiled = resolve({}, {**{k.name: config.values[k.name] for k in SCHEMA if k.section == "train_args"},
                            "frequency_of_the_test": 1, "show_progress": False, "compile_local_update": True})
    _, users, model, args = _setup("PerFedAvg", "hf")
    trainer, aggregator = algorithm_factory(compiled.federated_optimizer)(model, compiled, args)
    engine = BatchedSimulation(compiled, users, trainer, aggregator)
    assert calls == [{"mode": "default", "dynamic": False}]  # on the CPU; "reduce-overhead" on CUDA
    for r in range(compiled.comm_round):
        engine.train_round(r)
    got = aggregator.get_model_params()
    for k in got:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-9, atol=1e-11)
    with pytest.raises(ConfigError, match="device_args.compile_local_update=True: only the batched engine"):
        resolve({}, {"compile_local_update": True, "simulation_engine": "fedml"})


@pytest.mark.parametrize("chunk", [2, 64])
def test_batched_evaluation_equals_per_user_evaluation(chunk, monkeypatch):
    import fedml_perfedavg.evaluation as evaluation

    monkeypatch.setattr(evaluation, "USERS_PER_CHUNK", chunk)
    config, users, model, args = _setup("PerFedAvg", "hf")
    trainer, _ = algorithm_factory("PerFedAvg")(model, config, args)
    params = {k: p.detach() for k, p in model.named_parameters()}
    kwargs = dict(alpha=0.3, adapt_steps=2, batch_size=5, seed=1, round_idx=4)
    a = personalized_evaluation(model, trainer.loss_fn, params, users, **kwargs)
    b = personalized_evaluation_batched(model, trainer.loss_fn, params, users, **kwargs)
    assert a.per_user_accuracy == b.per_user_accuracy and a.per_user_accuracy_before == b.per_user_accuracy_before
    assert a.per_user_loss == pytest.approx(b.per_user_loss, rel=1e-12)


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

    config, users, model, args = _setup("PerFedAvg", "hf")
    trainer, aggregator = algorithm_factory("PerFedAvg")(model, config, args)
    engine = BatchedSimulation(config, users, trainer, aggregator)
    monkeypatch.setattr(torch.utils.data, "DataLoader", CountingLoader)
    monkeypatch.setattr(copy, "deepcopy", counting_deepcopy)
    engine.run()
    assert calls == {"DataLoader": 0, "deepcopy": 0}


@needs_mnist
def test_batched_engine_matches_fedml_loop_on_mnist(mnist_root, tmp_path):
    from fedml_perfedavg.config import load_yaml
    from fedml_perfedavg.runner import load_data, run

    from .test_simulation import HF_YAML

    def config(engine):
        return resolve(load_yaml(HF_YAML), dict(data_cache_dir=mnist_root, show_progress=False, comm_round=3,
                                                frequency_of_the_test=1, simulation_engine=engine, beta=0.05))

    data = load_data(config("fedml"))
    fedml_run = run(config("fedml"), str(tmp_path / "fedml"), data=data)
    batched_run = run(config("batched"), str(tmp_path / "batched"), data=data)
    a, b = fedml_run.aggregator.get_model_params(), batched_run.aggregator.get_model_params()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)
    assert abs(fedml_run.summary["personalized_accuracy"] - batched_run.summary["personalized_accuracy"]) < 0.005


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device here (CI has none)")
@pytest.mark.parametrize("optimizer,variant", CASES)
def test_batched_engine_on_cuda_equals_per_client_path_on_cpu(optimizer, variant):
    config, users, model, args = _setup(optimizer, variant)
    reference = _per_client_rounds(config, users, copy.deepcopy(model), args)
    _, users, model, args = _setup(optimizer, variant)
    cuda = torch.device("cuda")
    users = [UserSplit(*(t.to(cuda) for t in u)) for u in users]
    trainer, aggregator = algorithm_factory(config.federated_optimizer)(model.to(cuda), config, args)
    engine = BatchedSimulation(config, users, trainer, aggregator)
    for r in range(config.comm_round):
        engine.train_round(r)
    got = aggregator.get_model_params()
    for k in got:
        torch.testing.assert_close(got[k], reference[k], rtol=1e-9, atol=1e-11)
