"""Issue 42: an algorithm is one file. ``tests/algorithms/clipped_fedsgd.py`` declares its maths
and a setting of its own, and registers itself; a FedML user's one-line entry points, with that
file imported, run it on sp, MPI and cross-silo (under secure aggregation), with no other module
touched; DP-SGD, which cannot reach its own maths, refuses it at start in its words (issue 56)."""

import json
import sys

import pytest
import torch

from fedml_perfedavg.net.addresses import write_ipconfig

from tests.backends.test_fedml_entry_points import MPIRUN, ONE_LINE, _run
from tests.helpers import example_yaml, needs_mnist
from tests.helpers_tiny import tiny_config

CLIP = 0.02  # far below an MNIST gradient's norm: every step's gradient is clipped
BETA = 0.05
USERS = 4  # 3 a round for 3 rounds: users train again, with the momentum they kept
EDITS = dict(
    federated_optimizer="ClippedFedSGD",
    clip_norm=CLIP,
    client_momentum=0.5,
    learning_rate=BETA,
    local_steps=2,
    client_num_in_total=USERS,
    client_num_per_round=3,  # secure aggregation sums 3 silos at least
)


def _one_line(call):
    """FedML's one-line entry point (test_fedml_entry_points.ONE_LINE) with the algorithm's file imported."""
    return f'-c "import fedml_perfedavg, fedml, tests.algorithms.clipped_fedsgd; {ONE_LINE[call]}"'


@needs_mnist
def test_an_algorithm_in_one_file_runs_on_sp_mpi_and_cross_silo(mnist_root, tmp_path):
    """FedML's one-line entry points with the algorithm's file imported; across silos each data
    owner (one YAML each, its own folder) keeps its user's momentum and masks its update (secure
    aggregation), so the same model comes out only if every backend carried each client's state
    from one of its rounds to its next."""
    import tests.algorithms.clipped_fedsgd  # noqa: F401  (registers it, as the one-line entry points' import does)
    from fedml_perfedavg.run.config import load_yaml, resolve
    from fedml_perfedavg.run.runner import run

    from tests.backends.test_silo_own import _export
    from tests.helpers import drawing_with, make_tls, silo_draw_secrets

    runs = {}
    sp_yaml = path = example_yaml(tmp_path, "fedml_config.yaml", mnist_root, "sp", tmp_path / "sp", **EDITS)
    out = _run(["sh", "-c", f"{sys.executable} {_one_line('sp')} --cf {path}"], tmp_path)
    # FedML's example YAML still gives Per-FedAvg's estimator: named, not used, not an error.
    assert "train_args.perfedavg_variant='hf' is PerFedAvg's; train_args.federated_optimizer='ClippedFedSGD'" in (
        out.stdout + out.stderr
    )
    runs["sp"] = tmp_path / "sp" / "sp"
    if MPIRUN is not None:
        path = example_yaml(tmp_path, "fedml_config_mpi.yaml", mnist_root, "mpi", tmp_path / "mpi", **EDITS)
        _run([MPIRUN, "-n", "3", "sh", "-c", f"{sys.executable} {_one_line('MPI')} --cf {path}"], tmp_path)
        runs["mpi"] = tmp_path / "mpi" / "mpi"
    folders = _export(mnist_root, tmp_path, USERS)
    address_file = write_ipconfig(str(tmp_path / "ipconfig.csv"), USERS + 1)
    tls = make_tls(tmp_path / "tls", USERS)
    commands = []
    for rank in range(USERS + 1):
        own_yaml = tmp_path / f"rank-{rank}"  # each organization's own YAML: its folder, its rank's run
        own_yaml.mkdir()
        path = example_yaml(
            own_yaml,
            "fedml_config_silo.yaml",
            mnist_root,
            "silo",
            tmp_path / "silo",
            grpc_ipconfig_path=address_file,
            tls_dir=tls,
            silo_data="own",
            enable_secagg=True,
            **{**EDITS, "data_cache_dir": folders[rank]["data_cache_dir"]},
        )
        role = "server" if rank == 0 else "client"
        commands.append(f"{sys.executable} {_one_line(role)} --cf {path} --rank {rank} --role {role} --run_id 7")
    _run(["sh", "-c", " & ".join(commands) + " & wait"], tmp_path)
    runs["silo"] = tmp_path / "silo" / "silo"

    # Each data owner's record holds its user's momentum (once that user trained), and nothing else does.
    kept = [r for r in range(1, USERS + 1) if (runs["silo"] / f"silo-rank-{r}" / "client_state.pt").exists()]
    assert len(kept) >= 3, kept  # 9 trainings of 4 users
    for rank in kept:
        momentum = torch.load(runs["silo"] / f"silo-rank-{rank}" / "client_state.pt")
        assert set(momentum) == set(torch.load(runs["sp"] / "model.pt")) and any(
            v.abs().sum() > 0 for v in momentum.values()
        )
    assert not list(runs["silo"].glob("client_state*")) and not list(runs["sp"].rglob("client_state*"))
    # a finished run keeps each silo's account (its rounds trained, its answers): a rerun carries on from it
    assert len(list(runs["silo"].rglob("progress.pt"))) >= len(kept)

    # Its own per-user figure (each user's momentum norm) is reported by every backend, the same.
    sp_summary = json.loads((runs["sp"] / "summary.json").read_text())
    norms = sp_summary["per_user_metrics"]["momentum_norm"]
    assert len(norms) == USERS and [r for r in range(1, USERS + 1) if norms[r - 1] > 0] == kept
    assert sp_summary["own_metrics"]["momentum_norm"] == pytest.approx(sum(norms) / USERS)
    # Under secure aggregation each data owner draws its minibatches with a secret of the run's own
    # (docs/security.md): sp given the silos' secrets is the reference the silos are held to.
    with drawing_with(silo_draw_secrets(runs["silo"], USERS)):
        keyed = run(resolve(load_yaml(sp_yaml), {}), str(tmp_path / "sp-keyed"))
    keyed_norms = keyed.summary["per_user_metrics"]["momentum_norm"]
    assert [r for r in range(1, USERS + 1) if keyed_norms[r - 1] > 0] == kept
    for rank in range(1, USERS + 1):  # each data owner's record: its own user's figure
        own = json.loads((runs["silo"] / f"silo-rank-{rank}" / "summary.json").read_text())["own_metrics"]
        assert own["momentum_norm"] == pytest.approx(keyed_norms[rank - 1], rel=1e-5, abs=1e-7), rank

    reference = torch.load(runs["sp"] / "model.pt")
    for backend, run_dir in runs.items():
        summary = json.loads((run_dir / "summary.json").read_text())
        if backend == "silo":  # under secure aggregation a user's figures stay in its silo's record (above)
            assert "per_user_metrics" not in summary and summary["per_user_accuracy"] == [], backend
        else:
            assert summary["per_user_metrics"]["momentum_norm"] == pytest.approx(norms, rel=1e-5, abs=1e-7), backend
            shown = _show(run_dir)
            assert "momentum_norm" in shown and f"{norms[kept[0] - 1]:.4g}" in shown, backend
        assert summary["status"] == "finished" and summary["aggregate_calls"] == 3, backend
        if backend == "silo":  # every round summed under secure aggregation: the server saw no update alone
            secure = summary["secure_aggregation"]
            assert secure["rounds"] == 3 and secure["failed_rounds"] == 0, secure
        train_args = summary["config"]["train_args"]
        assert train_args["federated_optimizer"] == "ClippedFedSGD" and train_args["clip_norm"] == CLIP, backend
        model = torch.load(run_dir / "model.pt")
        # secure aggregation sums the updates in 32-bit fixed point: within 1e-5 of the plain sum
        atol, expected = (1e-5, keyed.final_state) if backend == "silo" else (1e-6, reference)
        for k in reference:
            torch.testing.assert_close(model[k], expected[k], rtol=1e-5, atol=atol, msg=backend)


def _show(run_dir):
    """``fedml-perfedavg show RUN_DIR`` as a user types it."""
    import subprocess

    done = subprocess.run(
        [sys.executable, "-m", "fedml_perfedavg", "show", str(run_dir)], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_its_setting_joins_the_config_the_docs_table_and_the_fingerprint():
    import tests.algorithms.clipped_fedsgd  # noqa: F401  registers ClippedFedSGD

    from fedml_perfedavg.silo.server.agreement import disagreement, fingerprint
    from fedml_perfedavg.run.config import ConfigError, resolve
    from fedml_perfedavg.run.reference import markdown_table

    config = resolve({"train_args": {"federated_optimizer": "ClippedFedSGD", "clip_norm": 0.5}})
    assert config.setting("clip_norm") == 0.5 and config.sections()["train_args"]["clip_norm"] == 0.5
    with pytest.raises(ConfigError, match=r"train_args.clip_norm=0.0: must be > 0"):
        resolve({"train_args": {"federated_optimizer": "ClippedFedSGD", "clip_norm": 0.0}})
    assert "| train_args | `clip_norm` | `1.0` | > 0 | ClippedFedSGD: each local step's" in markdown_table()
    state = {"w": torch.zeros(2)}
    other = resolve({"train_args": {"federated_optimizer": "ClippedFedSGD", "clip_norm": 0.25}})
    why = disagreement(fingerprint(config, state), fingerprint(other, state), 2)
    assert why is not None and "train_args.clip_norm" in why


def test_its_setting_is_what_its_clients_read(tmp_path):
    import tests.algorithms.clipped_fedsgd  # noqa: F401  registers ClippedFedSGD

    from fedml_perfedavg.models import create_model
    from fedml_perfedavg.run.runner import run

    from tests.helpers_tiny import tiny_data

    moved = {}
    for clip in (CLIP, 10 * CLIP):
        config = tiny_config(
            federated_optimizer="ClippedFedSGD",
            clip_norm=clip,
            client_momentum=0.0,
            beta=BETA,
            local_steps=2,
            comm_round=3,
        )
        result = run(config, str(tmp_path / str(clip)), data=tiny_data())
        torch.manual_seed(0)  # the run's own initial model (runner: seeded by random_seed)
        start = create_model("mlp", (1, 4, 4), 3, list(config.model.hidden_sizes)).state_dict()
        moved[clip] = float(torch.sqrt(sum(((result.final_state[k] - start[k]) ** 2).sum() for k in start)))
    # 3 rounds of 2 steps, each moving a client's model by beta * clip_norm at most (tiny data's
    # gradients are larger than clip_norm): the average of the clients' moves cannot go further.
    assert 0 < moved[CLIP] <= 6 * BETA * CLIP * (1 + 1e-5)
    assert moved[10 * CLIP] > 3 * moved[CLIP]


def test_each_client_keeps_its_own_state_between_its_rounds_and_in_checkpoints():
    import tests.algorithms.clipped_fedsgd  # noqa: F401  registers ClippedFedSGD

    from fedml_perfedavg.algorithms.registry import create_algorithm
    from fedml_perfedavg.models import create_model

    from tests.helpers_tiny import tiny_data

    config = tiny_config(federated_optimizer="ClippedFedSGD", clip_norm=10.0, client_momentum=0.9)
    model = create_model("mlp", (1, 4, 4), 3, [5])
    user = tiny_data().users[0]
    state = model.state_dict()
    algorithm = create_algorithm("ClippedFedSGD", model, config)
    first = algorithm.client_update(0, 0, state, user.train_x, user.train_y)
    again = algorithm.client_update(1, 0, state, user.train_x, user.train_y)  # client 0's momentum carried over
    fresh = create_algorithm("ClippedFedSGD", model, config).client_update(1, 0, state, user.train_x, user.train_y)
    assert not torch.equal(again.state["net.1.weight"], fresh.state["net.1.weight"])
    assert not torch.equal(first.state["net.1.weight"], again.state["net.1.weight"])
    saved = algorithm.state_dict()
    assert set(saved["client_states"]) == {0}
    restored = create_algorithm("ClippedFedSGD", model, config)
    restored.load_state_dict(saved)
    third = restored.client_update(2, 0, state, user.train_x, user.train_y)
    assert torch.equal(
        third.state["net.1.weight"],
        algorithm.client_update(2, 0, state, user.train_x, user.train_y).state["net.1.weight"],
    )


def test_a_client_whose_update_is_dropped_keeps_its_state_as_it_was():
    """on_divergence skip_client: the aggregation drops a non-finite update, and the client's own
    state (its momentum) stays what its last finite round left, not what the diverged one did."""
    import tests.algorithms.clipped_fedsgd  # noqa: F401  registers ClippedFedSGD

    from fedml_perfedavg.algorithms.registry import create_algorithm
    from fedml_perfedavg.models import create_model

    from tests.helpers_tiny import tiny_data

    settings = dict(clip_norm=10.0, client_momentum=0.9, on_divergence="skip_client")
    config = tiny_config(federated_optimizer="ClippedFedSGD", **settings)
    model = create_model("mlp", (1, 4, 4), 3, [5])
    user, state = tiny_data().users[0], model.state_dict()
    algorithm = create_algorithm("ClippedFedSGD", model, config)
    algorithm.client_update(0, 0, state, user.train_x, user.train_y)
    kept = {k: v.clone() for k, v in algorithm.client_states.get(0).items()}
    assert all(torch.isfinite(v).all() for v in kept.values()) and any(v.abs().sum() > 0 for v in kept.values())
    diverged = algorithm.client_update(1, 0, state, torch.full_like(user.train_x, float("nan")), user.train_y)
    assert not all(torch.isfinite(v).all() for v in diverged.state.values())  # the update the screen drops
    now = algorithm.client_states.get(0)
    assert all(torch.equal(now[k], kept[k]) for k in kept)


def test_a_run_whose_clients_forgot_their_states_gives_another_model(tmp_path, monkeypatch):
    """What the three backends' agreement rests on: a client's kept state changes the model."""
    import tests.algorithms.clipped_fedsgd  # noqa: F401  registers ClippedFedSGD

    from fedml_perfedavg.algorithms.client_states import ClientStates
    from fedml_perfedavg.run.runner import run

    from tests.helpers_tiny import tiny_data

    config = tiny_config(federated_optimizer="ClippedFedSGD", clip_norm=10.0, client_momentum=0.9, comm_round=3)
    kept = run(config, str(tmp_path / "kept"), data=tiny_data()).final_state
    monkeypatch.setattr(ClientStates, "get", lambda self, client: None)  # every round starts afresh
    forgot = run(config, str(tmp_path / "forgot"), data=tiny_data()).final_state
    assert any(not torch.allclose(kept[k], forgot[k]) for k in kept)


def test_across_silos_its_clients_states_stay_with_data_owners():
    import tests.algorithms.clipped_fedsgd  # noqa: F401  registers ClippedFedSGD

    from fedml_perfedavg.run.config import ConfigError, load_yaml, resolve

    from tests.helpers import SILO_YAML

    with pytest.raises(ConfigError, match=r"comm_args.silo_data='shared': .*'ClippedFedSGD' keeps a state of each"):
        resolve(load_yaml(SILO_YAML), {"federated_optimizer": "ClippedFedSGD", "tls_dir": "/nonexistent"})
    own = resolve(load_yaml(SILO_YAML), {"federated_optimizer": "ClippedFedSGD", "tls_dir": "/x", "silo_data": "own"})
    assert own.own_data
    # DP-SGD's clipping and noise would not reach its own maths (its momentum steps): refused in those words
    dp = {"dp_args.enable_dp": True, "dp_args.dp_solution_type": "dpsgd", "dp_args.noise_multiplier": 1.0}
    dp.update({"dp_args.max_grad_norm": 1.0, "dp_args.delta": 1e-5, "federated_optimizer": "ClippedFedSGD"})
    with pytest.raises(ConfigError, match=r"^train_args.federated_optimizer='ClippedFedSGD' with dp_args.*its own"):
        resolve(load_yaml(SILO_YAML), {**dp, "tls_dir": "/x", "silo_data": "own"})
