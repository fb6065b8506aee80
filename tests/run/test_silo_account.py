"""Issue 75, rule 4: a data owner's DP-SGD account belongs to its data, not to a run. A new run id,
a new run folder or a changed config counts the earlier runs' uses against the budget, and every
run keys its noise with a secret of its own, so two runs never share noise."""

import json
import os
import stat

import pytest
import torch

from fedml_perfedavg.algorithms.base import private_batches
from fedml_perfedavg.algorithms.registry import create_algorithm
from fedml_perfedavg.core.accounting import rdp_epsilon
from fedml_perfedavg.core.errors import ConfigError
from fedml_perfedavg.models import create_model
from fedml_perfedavg.run.privacy_plan import own_account
from fedml_perfedavg.run.silo_account import ACCOUNT, NOISE_KEY, SiloAccount, data_digest
from fedml_perfedavg.run.silo_record import SiloProgress
from fedml_perfedavg.silo.outcome import SiloOutcome

from tests.helpers_tiny import tiny_config, tiny_data
from tests.run.test_privacy_run import DP

RANK, USER = 3, 2


def _config(**overrides):
    return tiny_config(**{"client_num_per_round": 6, "checkpoint_every": 0, **DP, **overrides})


def _algorithm(config):
    return create_algorithm(config.train.federated_optimizer, create_model("mlp", (1, 4, 4), 3, [5]), config)


def _identity(run_id):
    return {"run_id": run_id, "fingerprint": "f" * 16, "user": USER}


def _start(config, run_dir, run_id, accounts):
    """A silo's DP-SGD set-up, as its process makes it (assembly), and the noise of its round 4."""
    algorithm = _algorithm(config)
    ledger, problem, run = own_account(
        config, algorithm, str(run_dir), RANK, tiny_data().users[USER], _identity(run_id)
    )
    user = tiny_data().users[USER]
    draws = private_batches(algorithm, 4, USER, user.train_x, user.train_y)
    noise = torch.cat([n.reshape(-1) for n in draws.noise.values()])
    return algorithm, ledger, problem, run, noise


def _train_all_rounds(config, algorithm, ledger, run, run_dir, run_id):
    """Spend the whole run's plan and keep it, as the silo does after each round."""
    for round_idx in range(config.train.comm_round):
        ledger.trained(round_idx, [USER])
    progress = SiloProgress(str(run_dir), RANK, _identity(run_id), algorithm, ledger, run)
    progress.save(SiloOutcome(USER))


@pytest.fixture
def accounts(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDML_PERFEDAVG_ACCOUNTS", str(tmp_path / "accounts"))
    return tmp_path / "accounts"


def test_a_new_run_counts_the_earlier_runs_uses_and_draws_other_noise(tmp_path, accounts):
    config = _config()
    algorithm, ledger, problem, run, first_noise = _start(config, tmp_path / "a", "run-a", accounts)
    assert problem is None and ledger.earlier == {}
    # one DP-SGD policy: the keyed one reaches the evaluation's personalization step too
    keyed = algorithm.settings.privacy
    assert keyed.secret is not None and algorithm.settings.evaluation.privacy is keyed
    folder = accounts / data_digest(tiny_data().users[USER])
    key = folder / NOISE_KEY
    assert len(key.read_bytes()) == 32 and stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(folder).st_mode) == 0o700
    _train_all_rounds(config, algorithm, ledger, run, tmp_path / "a", "run-a")
    one_run = ledger.this_run(USER)
    assert sum(one_run.values()) == config.train.comm_round * config.train.local_steps * 3  # HF: D, D', D''

    # the same run's process started again (its progress.pt): the same secret, the same noise, no earlier uses
    _, again, _, run_again, noise_again = _start(config, tmp_path / "a", "run-a", accounts)
    assert run_again.key == run.key and torch.equal(noise_again, first_noise) and again.earlier == {}

    # a new run id, a new run folder (or --overwrite, a changed config): the first run's uses count
    for run_dir, run_id in ((tmp_path / "a", "run-b"), (tmp_path / "c", "run-a")):
        _, second, _, other, noise = _start(config, run_dir, run_id, accounts)
        assert other.key != run.key and second.earlier == {USER: one_run}
        assert not torch.equal(noise, first_noise)  # a run's secret of its own: no shared noise
        second.trained(0, [USER])
        assert sum(second.uses[USER].values()) == sum(one_run.values()) + config.train.local_steps * 3
        assert second.bound(USER) > rdp_epsilon(one_run, 1.1, 1e-5)
        assert second.report()["per_user"][str(USER)]["earlier_uses"] == sum(one_run.values())
    record = json.loads((folder / ACCOUNT).read_text())
    assert record["data_sha256"] == data_digest(tiny_data().users[USER]) and len(record["runs"]) == 1


def test_a_budget_one_run_fits_refuses_the_second_naming_the_earlier_runs(tmp_path, accounts):
    probe = _config()
    algorithm, ledger, _, run, _ = _start(probe, tmp_path / "probe", "probe", accounts)
    plan = ledger.copy()
    for round_idx in range(probe.train.comm_round):
        plan.trained(round_idx, [USER])
        if round_idx % 2 == 1 or round_idx == probe.train.comm_round - 1:
            plan.evaluated(round_idx, [USER])
    one_run = plan.epsilon(USER)
    for path in accounts.iterdir():  # start the account afresh: only the budgeted runs below count
        for name in os.listdir(path):
            os.remove(path / name)

    config = _config(**{"dp_args.max_epsilon": one_run * 1.2})
    algorithm, ledger, problem, run, _ = _start(config, tmp_path / "a", "run-a", accounts)
    assert problem is None
    _train_all_rounds(config, algorithm, ledger, run, tmp_path / "a", "run-a")
    _, _, problem, _, _ = _start(config, tmp_path / "b", "run-b", accounts)
    assert problem is not None and "uses of its data by earlier runs: its account" in problem, problem
    assert f"dp_args.max_epsilon={one_run * 1.2!r}" in problem


def test_an_account_with_another_noise_multiplier_or_damaged_is_refused_naming_it(tmp_path, accounts):
    config = _config()
    algorithm, ledger, _, run, _ = _start(config, tmp_path / "a", "run-a", accounts)
    _train_all_rounds(config, algorithm, ledger, run, tmp_path / "a", "run-a")
    with pytest.raises(ConfigError, match=r"dp_args.noise_multiplier=2.0: .*noise_multiplier 1.1 .*allowed is 1.1"):
        _start(_config(**{"dp_args.noise_multiplier": 2.0}), tmp_path / "b", "run-b", accounts)
    path = accounts / data_digest(tiny_data().users[USER]) / ACCOUNT
    record = json.loads(path.read_text())
    for damage, words in (
        (lambda r: r["runs"][next(iter(r["runs"]))].update(uses=[[0.5, -3]]), "use count -3"),
        (lambda r: r.update(data_sha256="0" * 64), "the account of data"),
        (lambda r: r.update(format="other"), "its format"),
    ):
        damaged = json.loads(json.dumps(record))
        damage(damaged)
        path.write_text(json.dumps(damaged))
        with pytest.raises(ConfigError, match=rf"{ACCOUNT}: not a readable DP-SGD account \(.*{words}"):
            _start(config, tmp_path / "b", "run-b", accounts)
    path.write_text("NaN")
    with pytest.raises(ConfigError, match="not a readable DP-SGD account"):
        SiloAccount(str(path.parent), path.parent.name).runs()
    (path.parent / NOISE_KEY).write_bytes(b"short")
    path.write_text(json.dumps(record))
    with pytest.raises(ConfigError, match="not a 32-byte noise key"):
        _start(config, tmp_path / "b", "run-b", accounts)


def test_under_secure_aggregation_without_dp_a_silo_keys_its_minibatches_by_a_secret_of_its_run(tmp_path):
    """Rule 4 without DP-SGD: a data owner's silo in a secure run draws its minibatches keyed by a
    secret of this run's (kept in its progress.pt: a process of the same run started again draws
    the same batches; another run id, other batches), so two runs never send identical inputs."""
    from types import SimpleNamespace

    from fedml_perfedavg.run.data_modes import OWN, SiloRun

    config = tiny_config(client_num_per_round=6, checkpoint_every=0)
    user = tiny_data().users[USER]

    def start(run_id, secure=True):
        algorithm = _algorithm(config)
        asked = SimpleNamespace(privacy=None, secagg=SimpleNamespace(enable_secagg=secure))
        own = OWN.silo_privacy(asked, algorithm, RANK, [user], SiloRun(str(tmp_path), lambda: _identity(run_id)))
        batches = algorithm.client_batches(4, USER, user.train_x, user.train_y)
        return (
            algorithm,
            own,
            torch.cat([b.reshape(-1) for b in batches.x]),
            algorithm.batch_indices(4, [USER], [len(user.train_y)]),
        )

    plain, unkeyed, plain_x, plain_indices = start("run-a", secure=False)
    assert unkeyed.run_secret is None and dict(plain.settings.draw_secrets) == {}
    algorithm, own, first_x, first_indices = start("run-a")
    assert own.ledger is None and own.account is None and len(own.run_secret) == 32
    assert dict(algorithm.settings.draw_secrets) == {USER: own.run_secret}
    assert not torch.equal(first_x, plain_x)  # other batches than (seed, round, user) alone gives
    assert not torch.equal(first_indices[0][0], plain_indices[0][0])  # the batched engines' draws too
    SiloProgress(str(tmp_path), RANK, _identity("run-a"), algorithm, None, None, own.run_secret).save(SiloOutcome(USER))
    _, again, again_x, _ = start("run-a")  # the same run's process started again: its progress.pt's secret
    assert again.run_secret == own.run_secret and torch.equal(again_x, first_x)
    _, other, other_x, _ = start("run-b")  # another run: another secret, other batches
    assert other.run_secret != own.run_secret and not torch.equal(other_x, first_x)
