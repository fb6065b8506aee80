"""DP-SGD in a run (dp_args.dp_solution_type: dpsgd): every use counted, epsilon as Opacus
computes it, reported each evaluation and in summary.json, the budget enforced at start, and
what would read a user's data outside the mechanism refused."""

import statistics
import time

import pytest
import torch

from fedml_perfedavg.core.accounting import prv_epsilon
from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.core.sampling import sample_clients
from fedml_perfedavg.engine.batched import BatchedSimulation
from fedml_perfedavg.run.runner import run

from tests.helpers_tiny import killed_at_round, tiny_config, tiny_data
from tests.helpers import needs_mnist

DP = {
    "dp_args.enable_dp": True,
    "dp_args.dp_solution_type": "dpsgd",
    "dp_args.noise_multiplier": 1.1,
    "dp_args.max_grad_norm": 1.0,
    "dp_args.delta": 1e-5,
}


def _config(**overrides):
    return tiny_config(**{"client_num_per_round": 3, "checkpoint_every": 0, **DP, **overrides})


@pytest.mark.parametrize("variant, roles", [("hf", 3), ("fo", 2)])
def test_every_use_is_counted_and_epsilon_is_opacus_on_those_uses(tmp_path, variant, roles):
    from opacus.accountants import RDPAccountant

    config = _config(perfedavg_variant=variant)
    result = run(config, str(tmp_path / "run"), data=tiny_data())
    privacy = result.summary["privacy"]
    assert result.summary["train_history"] == []  # the local steps' losses are the private data's: not released
    rounds, tau, evaluations = config.train.comm_round, config.train.local_steps, [0, 2, 4, 5]
    assert [e["round"] for e in result.summary["history"]] == evaluations
    sampled = {u: 0 for u in range(6)}
    for r in range(rounds):
        for c in sample_clients(config.common.random_seed, r, 6, 3):
            sampled[c] += 1
    assert sum(sampled.values()) == rounds * 3
    total = sum(entry["uses"] for entry in privacy["per_user"].values())
    assert total == rounds * 3 * tau * roles + len(evaluations) * 6 * config.validation.adapt_steps
    for user, entry in privacy["per_user"].items():
        uses = sampled[int(user)] * tau * roles + len(evaluations) * config.validation.adapt_steps
        assert entry["uses"] == uses and entry["sample_rate"] == pytest.approx(8 / 24)
        accountant = RDPAccountant()
        accountant.history = [(1.1, 8 / 24, uses)]
        assert entry["epsilon_rdp"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-9)
        assert entry["epsilon"] == pytest.approx(prv_epsilon({8 / 24: uses}, 1.1, 1e-5), rel=1e-12)
        assert entry["epsilon"] < entry["epsilon_rdp"]  # the tight figure, below its RDP bound
    assert privacy["epsilon"] == max(e["epsilon"] for e in privacy["per_user"].values())
    assert {k: privacy[k] for k in ("accountant", "epsilon_from", "delta", "noise_multiplier", "max_grad_norm")} == {
        "accountant": "opacus.prv",
        "epsilon_from": "opacus.prv",
        "delta": 1e-5,
        "noise_multiplier": 1.1,
        "max_grad_norm": 1.0,
    }
    # each evaluation's record: the RDP bound of the largest (what a running record shows, cheap)
    epsilons = [e["epsilon"] for e in result.summary["history"]]
    largest_bound = max(e["epsilon_rdp"] for e in privacy["per_user"].values())
    assert epsilons == sorted(epsilons) and epsilons[-1] == pytest.approx(largest_bound, rel=1e-12)
    log = (tmp_path / "run" / "run.log").read_text()
    assert f"round 5: epsilon {largest_bound:.4g} at delta 1e-05" in log


def test_training_time_leaves_out_the_accountants_preparation(tmp_path, monkeypatch):
    """The ledger's preparation (importing Opacus and SciPy: seconds) happens before the run's
    clock starts, so train_seconds, the per-round cost benchmarks read, holds training alone (here
    two rounds of a tiny model: a small part of the second the preparation is made to take)."""
    from fedml_perfedavg.core import accounting

    prepare = accounting.prepare

    def slow_prepare(*args, **kwargs):
        time.sleep(1.0)
        return prepare(*args, **kwargs)

    monkeypatch.setattr(accounting, "prepare", slow_prepare)
    history = run(_config(comm_round=2), str(tmp_path / "run"), data=tiny_data()).summary["history"]
    assert 0 < history[-1]["train_seconds"] < 1.0, history


def test_the_noise_and_the_clipping_change_the_model(tmp_path):
    data = tiny_data()
    plain = run(tiny_config(checkpoint_every=0), str(tmp_path / "plain"), data=data).final_state
    a = run(_config(), str(tmp_path / "a"), data=data).final_state
    b = run(_config(random_seed=1), str(tmp_path / "b"), data=data).final_state
    again = run(_config(), str(tmp_path / "again"), data=data).final_state
    assert all(torch.equal(a[k], again[k]) for k in a)  # keyed: a seed gives the same model
    assert not all(torch.equal(a[k], plain[k]) for k in a)
    assert not all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("variant, clip", [("hf", "fixed"), ("hf", "adaptive"), ("exact", "fixed")])
def test_the_per_client_path_gives_the_batched_engines_model_and_epsilons(tmp_path, monkeypatch, variant, clip):
    data = tiny_data()
    config = lambda: _config(**{"dp_args.clip": clip, "perfedavg_variant": variant})  # noqa: E731
    batched = run(config(), str(tmp_path / "batched"), data=data)
    monkeypatch.setattr(BatchedSimulation, "clients_per_computation", 1)
    original = BatchedSimulation.__init__

    def one_by_one(self, *args, **kwargs):
        original(self, *args, **kwargs)
        self.batched = False  # every client through algorithm.client_update, as FedML's loops call it

    monkeypatch.setattr(BatchedSimulation, "__init__", one_by_one)
    alone = run(config(), str(tmp_path / "alone"), data=data)
    for k in batched.final_state:
        assert torch.allclose(batched.final_state[k], alone.final_state[k], atol=1e-6, rtol=0)
    assert batched.summary["privacy"] == alone.summary["privacy"]
    if clip == "adaptive":  # each client's bounds, kept by the engine (clients together) or by client_update
        bounds = batched.summary["dp_clip_bounds"]
        assert len(bounds) == 6 and bounds.keys() == alone.summary["dp_clip_bounds"].keys()
        for user, own in bounds.items():
            assert own == pytest.approx(alone.summary["dp_clip_bounds"][user], rel=1e-6)


def test_adaptive_clipping_counts_the_same_uses_and_each_user_keeps_its_own_bounds(tmp_path, capsys):
    """The noised count rides on the same use at sigma (core/adaptive_clipping.py): the same
    uses and epsilons as a fixed C; each trained user's three bounds (D, D', D'') moved from C
    by its own norms, in summary.json; the gradient's noise raised to sigma_grad."""
    data = tiny_data()
    fixed = run(_config(comm_round=3), str(tmp_path / "fixed"), data=data)
    adaptive = run(_config(comm_round=3, **{"dp_args.clip": "adaptive"}), str(tmp_path / "adaptive"), data=data)
    assert adaptive.summary["privacy"]["per_user"] == fixed.summary["privacy"]["per_user"]
    assert adaptive.summary["privacy"]["epsilon"] == fixed.summary["privacy"]["epsilon"]
    settings = adaptive.summary["privacy"]
    assert settings["clip"] == "adaptive" and settings["target_quantile"] == 0.5
    assert settings["gradient_noise_multiplier"] == pytest.approx(1.1 * (16 / 15) ** 0.5)
    trained = {c for r in range(3) for c in sample_clients(0, r, 6, 3)}
    bounds = adaptive.summary["dp_clip_bounds"]
    assert set(bounds) == {str(c) for c in trained} and "dp_clip_bounds" not in fixed.summary
    assert all(len(own) == 3 and all(b > 0 and b != 1.0 for b in own) for own in bounds.values())
    assert len({tuple(own) for own in bounds.values()}) == len(bounds)  # each user's own
    assert not all(torch.equal(fixed.final_state[k], adaptive.final_state[k]) for k in fixed.final_state)
    log = (tmp_path / "adaptive" / "run.log").read_text()
    assert "C adaptive from 1 toward quantile 0.5 of each user's norms" in log
    # each evaluation records the median user's bounds (run.log, history, wandb)
    last = adaptive.summary["history"][-1]
    for role, name in enumerate(("dp_clip_bound_d", "dp_clip_bound_d_prime", "dp_clip_bound_d_second")):
        assert last[name] == pytest.approx(statistics.median(own[role] for own in bounds.values()))
    assert "dp_clip_bound_d" not in fixed.summary["history"][-1]
    # `fedml-perfedavg show` gives each user's bounds beside its epsilon
    from fedml_perfedavg.run.show import main as show

    capsys.readouterr()
    assert show([str(tmp_path / "adaptive")]) == 0
    shown = capsys.readouterr().out
    some = sorted(trained)[0]
    assert "epsilon  uses  clip bounds D/D'/D''" in shown
    assert "/".join(f"{b:.3g}" for b in bounds[str(some)]) in shown, shown
    untrained = set(range(6)) - trained
    assert shown.count("- (not trained)") == len(untrained)


def test_the_personalization_step_clips_at_the_users_own_d_bound():
    from fedml_perfedavg.core.evaluation import personalization_dp

    from fedml_perfedavg.algorithms.base import AlgorithmSettings

    settings = AlgorithmSettings.from_config(_config(**{"dp_args.clip": "adaptive"}))
    own = personalization_dp(settings.evaluation, 4, {4: 0.25})
    assert own.max_grad_norm == 0.25 and not own.adaptive and own.noise_multiplier == 1.1
    assert own.noise_std == pytest.approx(1.1 * 0.25)  # no count is released: the noise is sigma's
    assert personalization_dp(settings.evaluation, 5, {4: 0.25}).max_grad_norm == 1.0  # not trained yet: C


def test_an_evaluation_personalizes_each_user_at_its_own_bound():
    """The algorithm's evaluation reads each user's D bound from its state: a user whose bound is
    tiny adapts (almost) nowhere, the others as with C; a user without a state at C."""
    from fedml_perfedavg.algorithms.base import AlgorithmSettings
    from fedml_perfedavg.algorithms.perfedavg import PerFedAvg
    from fedml_perfedavg.core.adaptive_clipping import STATE_KEY
    from fedml_perfedavg.models import create_model

    config = _config(**{"dp_args.clip": "adaptive"})
    model = create_model("mlp", (1, 4, 4), 3, [5])
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    users = tiny_data().users
    algorithm = PerFedAvg(model, AlgorithmSettings.from_config(config))
    before = algorithm.evaluate(0, state, users, batched=False)
    algorithm.client_states.put(2, {STATE_KEY: torch.tensor([1e-9, 5.0, 5.0], dtype=torch.float64)})
    assert algorithm.evaluation_clip_bounds(range(6)) == {0: 1.0, 1: 1.0, 2: 1e-9, 3: 1.0, 4: 1.0, 5: 1.0}
    after = algorithm.evaluate(0, state, users, batched=False)
    assert after.per_user_loss[2] != before.per_user_loss[2]
    assert [after.per_user_loss[u] for u in (0, 1, 3, 4, 5)] == [before.per_user_loss[u] for u in (0, 1, 3, 4, 5)]


def test_a_budget_the_plan_would_pass_is_refused_at_start_naming_the_epsilon(tmp_path):
    """By the tight figure: the RDP bound passes 10 in round 2 already, PRV's in round 4."""
    with pytest.raises(
        ConfigError,
        match=r"dp_args.max_epsilon=10.0: this run would reach epsilon [0-9.]+ \(user \d\) .*passed in round 4\. "
        r"Allowed: comm_round <= 4, or a larger dp_args.noise_multiplier",
    ):
        run(_config(**{"dp_args.max_epsilon": 10.0}), str(tmp_path / "over"), data=tiny_data())
    with pytest.raises(ConfigError, match=r"passed in round 2\. Allowed: comm_round <= 2,"):
        run(
            _config(**{"dp_args.max_epsilon": 10.0, "dp_args.accountant": "rdp"}),
            str(tmp_path / "rdp"),
            data=tiny_data(),
        )
    generous = run(_config(**{"dp_args.max_epsilon": 200.0}), str(tmp_path / "within"), data=tiny_data())
    privacy = generous.summary["privacy"]
    assert privacy["max_epsilon"] == 200.0 and privacy["epsilon"] <= 200.0 and privacy["left_out"] == []


def test_a_budget_that_no_round_fits_says_so_and_what_to_change(tmp_path):
    """It once said "Allowed: comm_round <= 0", a run of no rounds."""
    with pytest.raises(ConfigError) as err:
        run(_config(**{"dp_args.max_epsilon": 0.01}), str(tmp_path / "over"), data=tiny_data())
    text = str(err.value)
    assert "dp_args.max_epsilon=0.01: no round fits in the budget; round 0 alone reaches epsilon" in text
    assert "Allowed: a max_epsilon of at least" in text and "dp_args.noise_multiplier" in text
    assert "comm_round <= 0" not in text


@pytest.mark.parametrize("clip", ["fixed", "adaptive"])
def test_a_resumed_run_keeps_its_privacy_record(tmp_path, monkeypatch, clip):
    data = tiny_data()
    config = _config(checkpoint_every=2, **{"dp_args.clip": clip})
    full = run(config, str(tmp_path / "full"), data=data)
    restore = killed_at_round(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        run(config, str(tmp_path / "resumed"), data=data)
    restore()
    resumed = run(config, str(tmp_path / "resumed"), data=data, resume=True)
    assert resumed.summary["privacy"] == full.summary["privacy"]
    assert resumed.summary.get("dp_clip_bounds") == full.summary.get("dp_clip_bounds")  # the users' bounds too
    assert all(torch.equal(full.final_state[k], resumed.final_state[k]) for k in full.final_state)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"stationarity_every": 2}, r"validation_args.stationarity_every=2 with dp_args.dp_solution_type='dpsgd'"),
        ({"random_iterate": True}, r"validation_args.random_iterate=True with dp_args.dp_solution_type='dpsgd'"),
        ({"federated_optimizer": "FedAvgARUBA"}, r"train_args.federated_optimizer='FedAvgARUBA' with dp_args"),
        ({"dp_args.sensitivity": 1.0}, r"dp_args.sensitivity=1.0: a key of FedML's ldp/cdp"),
        (
            {"dp_args.clip": "adaptive", "training_type": "cross_silo", "backend": "GRPC", "insecure": True},
            r"dp_args.clip='adaptive' with comm_args.silo_data='shared': each user's clip bound is a state of its own",
        ),
    ],
)
def test_what_would_read_data_outside_the_mechanism_is_refused(overrides, message):
    with pytest.raises(ConfigError, match=message):
        _config(**overrides)


def test_an_algorithm_says_itself_why_dp_sgd_cannot_reach_its_maths(monkeypatch):
    """The config's rule asks the algorithm class (algorithms/base.py's dp_refusal), as its
    construction does: a registered algorithm with maths of its own is refused at start in its words,
    with no name of it written in the rules."""
    from fedml_perfedavg.algorithms import registry
    from fedml_perfedavg.algorithms.fedavg_aruba import FedAvgARUBA

    class OwnStatistics(FedAvgARUBA):
        dp_refusal_reason = "its clients send their gradient statistics in the clear"

    class OwnStatisticsPlain(FedAvgARUBA):
        dp_refusal_reason = None

    monkeypatch.setattr(registry, "_REGISTERED", {})
    registry.register("OwnStatistics", OwnStatistics)
    registry.register("OwnStatisticsPlain", OwnStatisticsPlain)
    with pytest.raises(ConfigError, match=r"'OwnStatistics' with dp_args.* in the clear$"):
        _config(federated_optimizer="OwnStatistics")
    with pytest.raises(ConfigError, match=r"'OwnStatisticsPlain' with dp_args.*: its client maths is its own"):
        _config(federated_optimizer="OwnStatisticsPlain")
    with pytest.raises(ConfigError, match=r"'FedAvgARUBA' with dp_args.*: ARUBA learns per-coordinate step sizes"):
        _config(federated_optimizer="FedAvgARUBA")


def test_fedavg_takes_one_use_per_step(tmp_path):
    config = _config(federated_optimizer="FedAvgUpdate")
    privacy = run(config, str(tmp_path / "fedavg"), data=tiny_data()).summary["privacy"]
    total = sum(entry["uses"] for entry in privacy["per_user"].values())
    assert total == config.train.comm_round * 3 * config.train.local_steps + 4 * 6


def test_a_model_with_batchnorm_is_refused_at_start_naming_dp_args(tmp_path):
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(16, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 3)
    )
    with pytest.raises(ConfigError, match=r"dp_args.dp_solution_type='dpsgd': .*BatchNorm1d.*GroupNorm or LayerNorm"):
        run(_config(), str(tmp_path / "bn"), data=tiny_data(), model=model)
    assert not (tmp_path / "bn" / "summary.json").exists()  # refused before any round


def _docs_dp_example():
    """The ``dp_args`` YAML block of docs/security.md's DP-SGD section."""
    import re

    import yaml

    from tests.helpers import REPO

    text = (REPO / "docs" / "security.md").read_text()
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S) if "dpsgd" in b]
    return yaml.safe_load(block)["dp_args"]


@pytest.mark.backend
@pytest.mark.parametrize("sigma", [None, 1.0], ids=["docs", "sigma-1"])
def test_the_docs_dp_example_fits_the_deployment_the_docs_describe(mnist_root, sigma):
    """Issue 55 item 9: docs/security.md's DP-SGD values, in the deployment of docs/deployment.md
    (four organizations, two a round, the YAML's 1000 rounds), pass the start-time budget check,
    at the epsilon the docs give (6.01, user 3, PRV; 6.41 by RDP); sigma 1.0, the example before,
    is refused."""
    from fedml_perfedavg.algorithms import create_algorithm
    from fedml_perfedavg.core.ledger import planned_epsilon
    from fedml_perfedavg.models import create_model
    from fedml_perfedavg.run.privacy_plan import central_ledger  # (FedML's import, hence here)
    from fedml_perfedavg.run.config import load_yaml, resolve
    from fedml_perfedavg.run.runner import load_split
    from fedml_perfedavg.run.schedule import RoundSchedule

    from tests.helpers import REPO, SILO_YAML

    dp = {f"dp_args.{key}": value for key, value in _docs_dp_example().items()}
    if sigma is not None:
        dp["dp_args.noise_multiplier"] = sigma
    deployment = {"client_num_in_total": 4, "client_num_per_round": 2, "data_cache_dir": mnist_root}
    config = resolve(load_yaml(SILO_YAML), {**deployment, "training_type": "simulation", "backend": "sp", **dp})
    assert config.train.comm_round == 1000 and dp["dp_args.max_epsilon"] == 8.0
    model = create_model("mlp", (1, 28, 28), 10, [80, 60])
    algorithm = create_algorithm(config.train.federated_optimizer, model, config)
    users = load_split(config).users
    if sigma is not None:
        with pytest.raises(ConfigError, match=r"this run would reach epsilon 138\.2 \(user 3\)"):
            central_ledger(config, algorithm, users)
        return
    ledger = central_ledger(config, algorithm, users)
    epsilon, user = planned_epsilon(
        ledger, range(1000), algorithm.sample_clients, RoundSchedule.from_config(config).evaluates, range(4)
    )
    assert (round(epsilon, 2), user) == (6.01, 3)
    assert "6.01 (users 0-3: 2.64, 2.57, 5.63, 6.01" in (REPO / "docs" / "security.md").read_text()


@pytest.mark.backend  # a benchmark's smoke run: a few PRV calls
def test_the_accountants_benchmark_runs_and_its_tight_figures_sit_below_the_bounds(tmp_path):
    import importlib.util
    import json

    from tests.helpers import REPO

    spec = importlib.util.spec_from_file_location("accountants", REPO / "benchmarks" / "accountants.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "accountants.json").read_text())
    assert len(rows) == len(module.HISTORIES) and all(0 < r["prv"] < r["rdp"] for r in rows)
    assert (tmp_path / "accountants.md").read_text().count("\n") == len(rows) + 2


@needs_mnist
def test_the_tradeoff_benchmark_keeps_each_run_and_reports_fixed_and_adaptive_clipping(
    mnist_root, tmp_path, monkeypatch
):
    """benchmarks/dp_tradeoff.py on a 2-round grid: every run kept as it ends (a second call runs
    none again), the table with each clip setting, its epsilon and the adaptive bounds."""
    import importlib.util
    import json
    import sys

    from tests.helpers import REPO

    spec = importlib.util.spec_from_file_location("dp_tradeoff", REPO / "benchmarks" / "dp_tradeoff.py")
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "dp_tradeoff", module)  # its workers' function is pickled by name
    spec.loader.exec_module(module)
    results = tmp_path / "cells.json"
    grid = ["--mnist-root", mnist_root, "--rounds", "2", "--every", "1", "--sigmas", "8", "--clips", "1", "adaptive"]
    module.main([*grid, "--seeds", "0", "--workers", "1", "--results", str(results)])
    cells = json.loads(results.read_text())
    assert len(cells) == 3 and {c["clip"] for c in cells.values()} == {"1", "adaptive", None}
    fixed, adaptive = (cells[f"rounds=2 sigma=8.0 clip={c} seed=0"] for c in ("1", "adaptive"))
    assert fixed["epsilon"] == adaptive["epsilon"] > 0  # the same uses at sigma
    assert len(adaptive["bounds_median"]) == 3 and "bounds_median" not in fixed
    stamp = results.stat().st_mtime_ns
    module.main([*grid, "--seeds", "0", "--workers", "1", "--results", str(results)])  # nothing left to run
    assert results.stat().st_mtime_ns == stamp
    table = (tmp_path / "dp_tradeoff_2.md").read_text()
    assert "| 8.0 | 1 | 1 |" in table and "| 8.0 | adaptive | 1 |" in table and "| no DP |" in table
    assert (tmp_path / "dp_tradeoff_2.png").stat().st_size > 0
    # another instance's run lands beside these (onto what the file holds, under a lock)
    module.keep(str(results), "another instance's cell", {"rounds": 2})
    assert set(json.loads(results.read_text())) == {*cells, "another instance's cell"}


@pytest.mark.parametrize("clip", ["fixed", "adaptive"])
def test_a_rounds_private_draws_on_two_threads_are_one_threads_bit_for_bit(clip):
    """The engine draws each client's Poisson minibatches and noise on torch's threads side by
    side (engine/minibatches.py): each client's own keyed generator, so the same numbers, stacked
    in the same order, as one after the other."""
    from fedml_perfedavg.algorithms.base import AlgorithmSettings
    from fedml_perfedavg.algorithms.perfedavg import PerFedAvg
    from fedml_perfedavg.engine.minibatches import Minibatches
    from fedml_perfedavg.engine.plan import resolve_plan
    from fedml_perfedavg.models import create_model

    algorithm = PerFedAvg(
        create_model("mlp", (1, 4, 4), 3, [5]), AlgorithmSettings.from_config(_config(**{"dp_args.clip": clip}))
    )
    users = tiny_data().users
    minibatches = Minibatches(algorithm, users, resolve_plan(algorithm, (1, 4, 4)))
    before = torch.get_num_threads()
    try:
        drawn = []
        for threads in (1, 2):
            torch.set_num_threads(threads)
            drawn.append(minibatches.round_batches(3, [5, 0, 2, 4]))
    finally:
        torch.set_num_threads(before)
    one, two = drawn
    for field in one._fields:
        a, b = getattr(one, field), getattr(two, field)
        if isinstance(a, dict):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), field
        else:
            assert (a is None and b is None) or torch.equal(a, b), field
