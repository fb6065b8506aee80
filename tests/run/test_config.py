"""Config loading, validation messages, overrides and the shipped YAMLs."""

import pytest

from fedml_perfedavg.run.config import ConfigError, load, load_yaml, parse_overrides, resolve
from fedml_perfedavg.run.fedml_args import to_fedml_args
from fedml_perfedavg.algorithms.registry import algorithm_names, algorithm_settings

from tests.helpers import REPO

CONFIGS = sorted(
    p
    for p in (REPO / "yaml_configs").glob("*.yaml")
    if p.stem.split("_")[0] in ("mnist", "cifar10") and not p.stem.endswith(("_mpi", "_silo"))
)


def test_every_table1_cell_has_its_configs():
    names = {p.stem for p in CONFIGS}
    cells = [
        "mnist_tau10_alpha0.01",
        "mnist_tau4_alpha0.01",
        "cifar10_tau10_alpha0.001",
        "cifar10_tau4_alpha0.001",
        "cifar10_tau4_alpha0.01",
        "cifar10_tau4_alpha0.01_diffhetero",
    ]
    for cell in cells:
        for method in ("fedavg", "fo", "hf") + (("exact",) if cell.startswith("mnist") else ()):
            assert f"{cell}_{method}" in names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_configs_validate_and_say_what_they_run(path):
    config = load(str(path))
    method = path.stem.rsplit("_", 1)[1]
    expected = {"fedavg": "FedAvgUpdate", "aruba": "FedAvgARUBA"}.get(method, "PerFedAvg")
    assert config.train.federated_optimizer == expected
    if expected == "FedAvgARUBA":
        assert tuple(config.setting(k) for k in ("aruba_epsilon", "aruba_zeta", "aruba_p")) == (0.03, 0.1, 1.0)
    elif method != "fedavg":
        assert config.setting("perfedavg_variant") == method
    assert (
        config.train.client_num_in_total,
        config.train.client_num_per_round,
        config.train.comm_round,
        config.train.beta,
    ) == (
        50,
        10,
        1000,
        0.001,
    )
    assert config.train.local_steps == int(path.stem.split("_tau")[1].split("_")[0])
    assert config.data.partition_method == ("paper_diff_hetero" if "diffhetero" in path.stem else "paper")


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"perfedavg_variant": "so"}, r"train_args.perfedavg_variant='so': must be one of \['fo', 'hf', 'exact'\]"),
        ({"alpha": -0.1}, r"train_args.alpha=-0.1: must be > 0"),
        ({"beta": "fast"}, r"train_args.beta='fast': must be of type float"),
        ({"local_steps": 0}, r"train_args.local_steps=0: must be >= 1"),
        ({"delta": float("inf")}, r"train_args.delta=inf: must be a finite number"),
        ({"max_update_norm": -1}, r"train_args.max_update_norm=-1: must be > 0"),
        ({"on_divergence": "ignore"}, r"train_args.on_divergence='ignore': must be one of \['stop', 'skip_client'\]"),
        ({"checkpoint_every": -5}, r"common_args.checkpoint_every=-5: must be >= 0"),
        ({"max_skipped_rounds": 0}, r"train_args.max_skipped_rounds=0: must be >= 1"),
        (
            {"hidden_sizes": [80, 0]},
            r"model_args.hidden_sizes=\[80, 0\]: must be a non-empty list of positive integers",
        ),
        ({"simulation_engine": "fast"}, r"simulation_engine='fast': must be one of \['batched', 'fedml'\]"),
        ({"batch_size": True}, r"train_args.batch_size=True: must be of type int"),
        ({"client_num_per_round": 60}, r"client_num_per_round=60: must be <= train_args.client_num_in_total \(50\)"),
        ({"federated_optimizer": "PerFedAvgg"}, r"federated_optimizer='PerFedAvgg'.*did you mean 'PerFedAvg'"),
        ({"dataset": "mnsit"}, r"data_args.dataset='mnsit'.*did you mean 'mnist'"),
        (
            {"client_num_in_total": 7, "client_num_per_round": 2},
            r"train_args.client_num_in_total=7: the paper's split .* needs an even number",
        ),
        (
            {"images_per_class": 2000},
            r"data_args.images_per_class=2000: 50 users would need 55000 images of class 0, "
            r"but mnist's training set has 5923",
        ),
        (
            {"federated_optimizer": "FedAvg"},
            r"federated_optimizer='FedAvg': that is FedML's own algorithm .* FedAvgUpdate",
        ),
        (
            {"learning_rate": 0.1, "beta": 0.2},
            r"train_args.learning_rate=0.1 and train_args.beta=0.2 both set the step",
        ),
        ({"backend": "NCCL"}, r"comm_args.backend='NCCL': must be one of"),
        ({"images_per_class": 195}, r"data_args.images_per_class=195: must be an even number >= 2"),
        ({"new_user_fraction": 1.0}, r"train_args.new_user_fraction=1.0: must be in \[0, 1\)"),
        ({"new_user_fraction": 0.9}, r"new_user_fraction=0.9: leaves 5 training users, fewer than"),
        ({"frequency_of_the_test": 0}, r"validation_args.frequency_of_the_test=0: must be >= 1"),
    ],
)
def test_bad_values_are_rejected_naming_key_value_and_allowed(overrides, message):
    with pytest.raises(ConfigError, match=message):
        resolve({}, overrides)


def test_misspelled_yaml_key_is_an_error_with_a_suggestion():
    with pytest.raises(ConfigError, match=r"train_args.aplha=0.1: unknown key; did you mean 'alpha'"):
        resolve({"train_args": {"aplha": 0.1}})
    with pytest.raises(ConfigError, match=r"belongs in section 'train_args'"):
        resolve({"data_args": {"alpha": 0.1}})


def test_missing_or_broken_config_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="no such file"):
        load(str(tmp_path / "nope.yaml"))
    broken = tmp_path / "broken.yaml"
    broken.write_text("train_args: [1, 2")
    with pytest.raises(ConfigError, match="cannot be read as YAML"):
        load(str(broken))


def test_set_overrides_take_yaml_values_and_qualified_names():
    assert parse_overrides(["comm_round=20", "train_args.alpha=0.05", "enable_wandb=true"]) == {
        "comm_round": 20,
        "alpha": 0.05,
        "enable_wandb": True,
    }
    with pytest.raises(ConfigError, match="unknown key 'comm_rounds'; did you mean 'comm_round'"):
        parse_overrides(["comm_rounds=3"])
    config = load(str(CONFIGS[0]), ["comm_round=7", "data_args.data_cache_dir=/d"])
    assert config.data.data_cache_dir == "/d"
    assert config.train.comm_round == 7 and config.sections()["train_args"]["comm_round"] == 7


def test_exponent_floats_without_a_dot_are_numbers(tmp_path):
    # YAML 1.1 (PyYAML) reads 1e-3 as a string; a researcher means a number, in --set and in files.
    assert load(str(CONFIGS[0]), ["beta=1e-3", "alpha=2E-2"]).values["beta"] == 0.001
    path = tmp_path / "c.yaml"
    path.write_text("train_args:\n  beta: 5e-4\n  delta: 1e-5\n")
    config = load(str(path))
    assert (config.train.beta, config.setting("delta")) == (0.0005, 1e-5)
    with pytest.raises(ConfigError, match="train_args.beta='fast': must be of type float"):
        load(str(path), ["beta=fast"])


def test_fedml_args_flatten_sections():
    args = to_fedml_args(resolve({}), federated_optimizer="FedAvg")
    assert args.federated_optimizer == "FedAvg" and args.alpha == 0.01 and args.backend == "sp"


def test_registry_lists_builtins():
    assert algorithm_names()[:3] == ["PerFedAvg", "FedAvgUpdate", "FedAvgARUBA"]


def test_fedml_keys_mean_what_they_mean_in_fedml(caplog):
    with caplog.at_level("WARNING"):
        config = resolve(
            {
                "train_args": {
                    "learning_rate": 0.03,
                    "epochs": 5,
                    "client_optimizer": "adam",
                    "weight_decay": 0.001,
                    "batch_size": 20,
                }
            }
        )
    assert config.train.beta == 0.03 and config.batch_sizes == (20, 20, 20)  # learning_rate is beta; batch_size is |D|
    for name in (
        "train_args.epochs=5 is not used",
        "train_args.client_optimizer='adam' is not used",
        "train_args.weight_decay=0.001 is not used",
    ):
        assert name in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        assert (
            resolve({"train_args": {"learning_rate": 0.001, "beta": 0.001, "client_optimizer": "sgd"}}).train.beta
            == 0.001
        )
    assert "not used" not in caplog.text  # sgd is what Per-FedAvg does; equal values agree


def test_the_configuration_reference_table_is_generated_from_the_config():
    from fedml_perfedavg.run.reference import markdown_table

    reference = (REPO / "docs" / "configuration.md").read_text()
    table = markdown_table(builtin_only=True)  # whatever other tests registered in this process
    assert table in reference, "docs/configuration.md's table is stale: paste run.reference.markdown_table(True)"


@pytest.fixture
def fresh_entry_points():
    from fedml_perfedavg.algorithms import registry

    registry._entry_points.cache_clear()  # read once per process: the test's fake is read anew
    yield
    registry._entry_points.cache_clear()


def test_entry_point_algorithms_are_listed_and_loaded(monkeypatch, fresh_entry_points):
    from fedml_perfedavg.algorithms import registry
    from fedml_perfedavg.algorithms.perfedavg import PerFedAvg

    class FakeEntryPoint:
        name = "MyAlg"

        def load(self):
            return PerFedAvg

    monkeypatch.setattr(
        registry, "entry_points", lambda group: [FakeEntryPoint()] if group == registry.ENTRY_POINT_GROUP else []
    )
    monkeypatch.setattr(registry, "_REGISTERED", {})  # algorithms other tests registered
    assert registry.algorithm_names() == ["PerFedAvg", "FedAvgUpdate", "FedAvgARUBA", "MyAlg"]
    assert resolve({}, {"federated_optimizer": "MyAlg"}).train.federated_optimizer == "MyAlg"
    assert registry.algorithm_class("MyAlg") is PerFedAvg
    with pytest.raises(KeyError, match="must be one of"):
        registry.algorithm_class("Nope")
    with pytest.raises(ValueError, match="FedML's own algorithm name"):
        registry.register("FedAvg", PerFedAvg)


def test_batch_sizes_must_fit_the_smallest_users_data():
    resolve({}, {"hessian_batch_size": 490})
    with pytest.raises(
        ConfigError,
        match=r"train_args.hessian_batch_size=500: must be <= the smallest user's "
        r"training data under data_args.images_per_class=196 \(data_args."
        r"partition_method='paper'\) \(490 samples\)",
    ):
        resolve({}, {"hessian_batch_size": 500})


def test_plugin_algorithm_names_match_in_any_case_and_typos_are_named():
    from fedml_perfedavg.run.config import resolve

    assert resolve({"train_args": {"federated_optimizer": "fedavgupdate"}}).train.federated_optimizer == "FedAvgUpdate"
    with pytest.raises(ConfigError, match="did you mean 'FedAvgARUBA'"):
        resolve({"train_args": {"federated_optimizer": "FedAvgAruba2"}})


def test_config_warnings_print_once_however_often_the_config_is_read(caplog):
    from fedml_perfedavg.run.config import resolve

    with caplog.at_level("WARNING"):
        for _ in range(3):
            resolve({"train_args": {"momentum": 0.123}})
    assert caplog.text.count("momentum=0.123") == 1


def test_keys_of_fedmls_secure_aggregation_are_refused_not_passed_on_in_the_clear():
    """Issue 45: PerFedAvg with LSA's keys averaged in the clear, with only a warning."""
    from argparse import Namespace

    from fedml_perfedavg.run.fedml_args import check_algorithm_name

    with pytest.raises(ConfigError, match=r"train_args\.prime_number=32749: a key of FedML's secure aggregation"):
        resolve({"train_args": {"prime_number": 32749}}, {})
    # FedML's LSA and SA on the plugin's transport (common_args.plugin_fixes): refused, pointing to the plugin's
    with pytest.raises(ConfigError, match=r"secagg_args: \{enable_secagg: true\}"):
        check_algorithm_name(Namespace(federated_optimizer="LSA", plugin_fixes=True))
    with pytest.raises(ConfigError, match="lacks the module SA needs"):
        check_algorithm_name(Namespace(federated_optimizer="SA", plugin_fixes=True))
    check_algorithm_name(Namespace(federated_optimizer="LSA"))  # on FedML's own transport: FedML's to run (issue 77)


@pytest.mark.backend  # a subprocess: a fresh interpreter shows what importing the config imports
def test_the_config_modules_import_no_fedml_and_fedmls_own_checks_still_run():
    """Issue 42: the config owns its schema, and imports no FedML; issue 56 item 6: its rules are
    one list in run/rules.py, FedML's rehearsal of its sections among them, registered by no import."""
    import ast
    import subprocess
    import sys
    from pathlib import Path

    import fedml_perfedavg.run.config as config_module

    folder = Path(config_module.__file__).parent
    for name in ("config", "schema", "rules", "fedml_keys"):
        tree = ast.parse((folder / f"{name}.py").read_text())
        imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
        imported |= {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
        assert not [m for m in imported if m.split(".")[0] == "fedml"], (name, imported)
    assert not (folder / "safeguard_rules.py").exists()
    assert "import" not in (folder / "__init__.py").read_text().split('"""')[-1]  # the run layer registers nothing
    code = (
        "import sys; import fedml_perfedavg.run.config as c; c.resolve({}, {}); print('fedml' in sys.modules)\n"
        "try:\n"
        "    c.resolve({'attack_args': {'enable_attack': True, 'attack_type': 'byzantine', 'attack_mode': 'nope',"
        " 'byzantine_client_num': 1}}, {})\n"
        "except c.ConfigError as err:\n"
        "    print(err)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    lines = out.stdout.splitlines()
    assert lines[0] == "False", out.stdout + out.stderr  # a config without FedML's sections: no FedML
    assert lines[1].startswith("attack_args.attack_mode='nope': must be one of"), out.stdout + out.stderr


def test_every_shipped_yaml_gives_only_keys_its_algorithm_reads():
    """A FedAvgUpdate YAML with Per-FedAvg's delta would be named in a warning at every run."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    paths = sorted((repo / "yaml_configs").glob("*.yaml")) + sorted((repo / "examples").rglob("*.yaml"))
    assert len(paths) > 20
    for path in paths:
        sections = load_yaml(str(path))
        given = {key for values in sections.values() for key in values}
        chosen = sections["train_args"]["federated_optimizer"]
        others = {key for name in algorithm_names() if name != chosen for key in algorithm_settings(name)} - set(
            algorithm_settings(chosen)
        )
        assert not given & others, (path.name, sorted(given & others))


def test_a_config_holds_and_records_its_own_algorithms_keys_alone():
    """config.yaml of a FedAvgUpdate run names no Per-FedAvg key: read back, it warns of none."""
    train = resolve({}, {"federated_optimizer": "FedAvgUpdate"}).sections()["train_args"]
    assert not {"delta", "perfedavg_variant", "aruba_p"} & set(train)
    per_fedavg = resolve({}, {}).sections()["train_args"]
    assert per_fedavg["perfedavg_variant"] == "hf" and per_fedavg["delta"] == 0.001 and "aruba_p" not in per_fedavg
    aruba = resolve({}, {"federated_optimizer": "FedAvgARUBA", "aruba_p": 2.0})
    assert aruba.setting("aruba_p") == 2.0 and aruba.sections()["train_args"]["aruba_p"] == 2.0
    with pytest.raises(KeyError, match="'perfedavg_variant': not a setting of this config"):
        aruba.setting("perfedavg_variant")  # not its algorithm's key
    assert not hasattr(aruba, "aruba_p")  # an algorithm's key is no attribute: no name resolves by magic


def test_an_algorithm_that_gives_a_taken_key_another_meaning_is_refused_naming_both(monkeypatch, fresh_entry_points):
    """Algorithms' own settings share train_args: a key PerFedAvg declares (delta, 0.001, > 0)
    cannot mean something else for another algorithm; the same declaration may be shared."""
    from dataclasses import dataclass

    from fedml_perfedavg.algorithms import FederatedAlgorithm, registry
    from fedml_perfedavg.core.settings import NON_NEGATIVE, POSITIVE, setting

    monkeypatch.setattr(registry, "_REGISTERED", {})

    @dataclass(frozen=True)
    class Other:
        delta: float = setting(float, 0.5, "Mine: another delta", rule=NON_NEGATIVE, section="train_args")

    @dataclass(frozen=True)
    class Same:
        delta: float = setting(float, 0.001, "Shared: HF's width", rule=POSITIVE, section="train_args")

    class Clashing(FederatedAlgorithm):
        name = "Clashing"
        Settings = Other

    class Sharing(FederatedAlgorithm):
        name = "Sharing"
        Settings = Same

    with pytest.raises(
        TypeError,
        match=r"algorithm 'Clashing' declares the setting 'delta' as .*'default': 0.5.*"
        r"algorithm 'PerFedAvg' declares it as .*'default': 0.001",
    ):
        registry.register("Clashing", Clashing)
    assert "Clashing" not in registry.algorithm_names()
    registry.register("Sharing", Sharing)  # one declaration, two algorithms: allowed
    assert resolve({}, {"federated_optimizer": "Sharing"}).train.federated_optimizer == "Sharing"

    class FakeEntryPoint:  # an installed algorithm is checked when the settings are read
        name = "Installed"

        def load(self):
            return Clashing

    monkeypatch.setattr(
        registry, "entry_points", lambda group: [FakeEntryPoint()] if group == registry.ENTRY_POINT_GROUP else []
    )
    registry._entry_points.cache_clear()
    from fedml_perfedavg.run.schema import algorithm_fields

    with pytest.raises(TypeError, match="algorithm 'Installed' declares the setting 'delta'"):
        algorithm_fields()


def test_a_secure_configuration_where_one_lost_organization_fails_every_later_round_is_refused_naming_the_numbers():
    """Issue 76, item 2: three organizations a round of four stopped at any loss. Now a round that
    cannot spare one needs an organization to take a lost one's place (secagg_args.reserve_silos),
    or the operator's explicit acceptance."""
    silo_yaml = load_yaml(str(REPO / "yaml_configs" / "mnist_tau10_alpha0.01_hf_silo.yaml"))
    secure = {"silo_data": "own", "enable_secagg": True, "tls_dir": "/tmp", "client_num_in_total": 4}
    assert resolve(silo_yaml, {**secure, "client_num_per_round": 3}).secagg.reserve_silos == 1  # a reserve: accepted
    assert resolve(silo_yaml, {**secure, "client_num_per_round": 4}).train.client_num_per_round == 4  # spares one
    with pytest.raises(ConfigError) as refused:
        resolve(silo_yaml, {**secure, "client_num_per_round": 3, "reserve_silos": 0})
    words = str(refused.value)
    assert "a round of 3 silos short of one has 2, fewer than the 3 it needs (max of the threshold 2" in words
    assert "secagg_args.reserve_silos=0 lets no organization take its place" in words
    assert "client_num_per_round >= 4" in words and "secagg_args.accept_rounds_without_spare: true" in words
    accepted = {**secure, "client_num_per_round": 3, "reserve_silos": 0, "accept_rounds_without_spare": True}
    assert resolve(silo_yaml, accepted).secagg.accept_rounds_without_spare is True
    with pytest.raises(ConfigError, match="no organization can take its place"):
        resolve(silo_yaml, {**secure, "client_num_per_round": 4, "min_clients_per_round": 4})
