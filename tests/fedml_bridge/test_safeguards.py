"""FedML's DP, attacks and defenses with Per-FedAvg: the same on the batched engine and FedML's sp
loop, errors at start for what cannot apply, noise of the mechanism's scale, a defense at work."""

import argparse
import math
from collections import OrderedDict

import pytest
import torch

from fedml_perfedavg.algorithms.base import NO_HOOKS
from fedml_perfedavg.core.errors import ConfigError, RunStopped
from fedml_perfedavg.fedml_bridge.safeguards import FedMLSafeguards, applied_defenses
from fedml_perfedavg.run.config import load, parse_overrides, resolve
from fedml_perfedavg.run.fedml_args import from_fedml_args, to_fedml_args
from fedml_perfedavg.run.runner import run

from tests.helpers_tiny import tiny_data

BASE = dict(
    client_num_in_total=6,
    client_num_per_round=5,
    comm_round=3,
    local_steps=2,
    batch_size=8,
    meta_batch_size=8,
    hessian_batch_size=8,
    beta=0.1,
    alpha=0.05,
    show_progress=False,
    frequency_of_the_test=2,
    checkpoint_every=0,
    hidden_sizes=[5],
)
LDP = {
    "enable_dp": True,
    "dp_solution_type": "ldp",
    "mechanism_type": "gaussian",
    "epsilon": 0.5,
    "delta": 1e-5,
    "sensitivity": 0.01,
}
CDP = {**LDP, "dp_solution_type": "cdp", "mechanism_type": "laplace", "epsilon": 2.0}
BYZANTINE = {"enable_attack": True, "attack_type": "byzantine", "attack_mode": "random", "byzantine_client_num": 1}
FLIPPING = {
    "enable_attack": True,
    "attack_type": "label_flipping",
    "original_class_list": [0, 1],
    "target_class_list": [2, 0],
    "ratio_of_poisoned_client": 0.5,
}
CLIPPING = {"enable_defense": True, "defense_type": "norm_diff_clipping", "norm_bound": 0.5}
MEDIAN = {"enable_defense": True, "defense_type": "wise_median"}
KRUM = {"enable_defense": True, "defense_type": "krum", "byzantine_client_num": 1, "krum_param_m": 1}

COMBINATIONS = {
    "ldp+byzantine+clipping": {"dp_args": LDP, "attack_args": BYZANTINE, "defense_args": CLIPPING},
    "cdp-laplace+flipping+median": {"dp_args": CDP, "attack_args": FLIPPING, "defense_args": MEDIAN},
    "byzantine+krum": {"attack_args": BYZANTINE, "defense_args": KRUM},
    "model_replacement+geo_median": {
        "attack_args": {"enable_attack": True, "attack_type": "model_replacement"},
        "defense_args": {
            "enable_defense": True,
            "defense_type": "geo_median",
            "byzantine_client_num": 1,
            "batch_num": 1,
        },
    },
}


def _run(tmp_path, sections, name, **overrides):
    config = resolve(sections, {**BASE, **overrides})
    return run(config, str(tmp_path / name), data=tiny_data())


@pytest.mark.backend  # FedML's own sp loop
@pytest.mark.parametrize("combination", list(COMBINATIONS))
def test_each_feature_gives_one_model_on_the_batched_engine_and_fedmls_sp_loop(tmp_path, combination):
    sections = COMBINATIONS[combination]
    # the default update bound off: it would refuse the attacks' models before the defenses see them
    batched = _run(tmp_path, sections, "batched", max_update_ratio=None).final_state
    fedml_loop = _run(tmp_path, sections, "fedml", simulation_engine="fedml", max_update_ratio=None).final_state
    plain = _run(tmp_path, {}, "plain").final_state
    for k in batched:
        torch.testing.assert_close(batched[k], fedml_loop[k], rtol=1e-5, atol=1e-6)
    assert max(float((batched[k] - plain[k]).abs().max()) for k in plain) > 1e-3  # the features acted


def test_the_same_seed_draws_the_same_noise_and_attack_twice(tmp_path):
    sections = COMBINATIONS["ldp+byzantine+clipping"]
    first = _run(tmp_path, sections, "a").final_state
    second = _run(tmp_path, sections, "b").final_state
    assert all(torch.equal(first[k], second[k]) for k in first)
    other_seed = _run(tmp_path, sections, "c", random_seed=1).final_state
    assert not all(torch.equal(first[k], other_seed[k]) for k in first)


# -- the mechanisms' scale -----------------------------------------------------------------------
# Each check compares a sample statistic of n independent draws with its expectation; the bounds
# are z = 5 standard errors, a false alarm rate below 1e-6 per check (two-sided normal tail).
Z = 5.0


def _hooks(dp, seed=0):
    return FedMLSafeguards(
        {"dp_args": dp},
        {
            "random_seed": seed,
            "comm_round": 3,
            "client_num_per_round": 5,
            "client_num_in_total": 6,
            "batch_size": 8,
            "dataset": "mnist",
            "train_data_num_in_total": None,
        },
    )


def test_central_gaussian_noise_has_the_mechanisms_scale():
    dp = {**LDP, "dp_solution_type": "cdp", "epsilon": 0.5, "delta": 1e-5, "sensitivity": 0.1}
    sigma = math.sqrt(2 * math.log(1.25 / 1e-5)) * 0.1 / 0.5  # FedML's Gaussian: sqrt(2 ln(1.25/delta)) s / eps
    zero = OrderedDict(w=torch.zeros(400, 500))
    noise = _hooks(dp).after_aggregation(7, zero, zero)["w"].double().flatten()
    n = noise.numel()
    assert abs(float(noise.mean())) < Z * sigma / math.sqrt(n)
    assert abs(float(noise.std()) / sigma - 1) < Z * math.sqrt(1 / (2 * n))
    assert _hooks(dp).after_aggregation(7, zero, zero)["w"].dtype == torch.float32  # the model's dtype kept


def test_local_laplace_noise_has_the_mechanisms_scale_and_differs_by_client():
    dp = {**LDP, "mechanism_type": "laplace", "epsilon": 2.0, "delta": 0.0, "sensitivity": 0.3}
    b = 0.3 / 2.0  # FedML's Laplace: s / (eps - ln(1 - delta))
    zero = OrderedDict(w=torch.zeros(400, 500))
    hooks = _hooks(dp)
    noise = hooks.client_result(3, 4, zero)["w"].double().flatten()
    n = noise.numel()
    assert abs(float(noise.abs().mean()) / b - 1) < Z / math.sqrt(n)  # E|X| = b, sd |X| = b
    assert abs(float(noise.mean())) < Z * b * math.sqrt(2 / n)
    assert torch.equal(hooks.client_result(3, 4, zero)["w"], noise.float().reshape(400, 500))  # keyed
    assert not torch.equal(hooks.client_result(3, 5, zero)["w"], noise.float().reshape(400, 500))


def test_central_dp_in_a_round_moves_the_model_by_the_mechanisms_noise(tmp_path):
    dp = {**LDP, "dp_solution_type": "cdp", "epsilon": 0.5, "delta": 1e-5, "sensitivity": 0.01}
    sigma = math.sqrt(2 * math.log(1.25 / 1e-5)) * 0.01 / 0.5
    one_round = dict(comm_round=1, hidden_sizes=[200])
    noisy = _run(tmp_path, {"dp_args": dp}, "noisy", **one_round).final_state
    plain = _run(tmp_path, {}, "plain", **one_round).final_state
    diff = torch.cat([(noisy[k] - plain[k]).double().flatten() for k in plain])
    n = diff.numel()
    assert n > 3000
    assert abs(float(diff.std()) / sigma - 1) < Z * math.sqrt(1 / (2 * n))


# -- defenses ------------------------------------------------------------------------------------
def _hand_built_round(defense):
    hooks = FedMLSafeguards(
        {"defense_args": defense},
        {
            "random_seed": 0,
            "comm_round": 3,
            "client_num_per_round": 6,
            "client_num_in_total": 6,
            "batch_size": 8,
            "dataset": "mnist",
            "train_data_num_in_total": None,
        },
    )
    torch.manual_seed(0)
    global_state = OrderedDict(w=torch.zeros(10), b=torch.zeros(2))
    honest = [(10.0, OrderedDict(w=0.01 * torch.randn(10), b=0.01 * torch.randn(2))) for _ in range(5)]
    attacker = (10.0, OrderedDict(w=torch.full((10,), 50.0), b=torch.full((2,), -50.0)))
    return hooks, global_state, honest, attacker


def test_krum_removes_the_attackers_update_in_a_hand_built_round():
    hooks, global_state, honest, attacker = _hand_built_round(KRUM)
    kept = hooks.filter_updates(0, honest[:2] + [attacker] + honest[2:], global_state)
    assert len(kept) == 1
    honest_ws = [sd["w"] for _, sd in honest]
    for _, sd in kept:
        assert any(torch.equal(sd["w"], w) for w in honest_ws)  # only honest updates survive


def test_foolsgold_after_a_round_with_fewer_updates_starts_its_memory_again(caplog):
    """FedML's FoolsGold keeps its memory by position: a round after one that lost or rejected an
    update had more updates than the memory and stopped the run with an IndexError."""
    hooks, global_state, honest, attacker = _hand_built_round({"enable_defense": True, "defense_type": "foolsgold"})
    assert len(hooks.filter_updates(0, honest[:4], global_state)) == 4  # one of 5 was rejected
    with caplog.at_level("WARNING"):
        kept = hooks.filter_updates(1, honest + [attacker], global_state)
    assert len(kept) == 6
    assert "foolsgold remembers 4 updates by their position and this round has 6" in caplog.text


def test_norm_difference_clipping_bounds_the_attackers_update():
    hooks, global_state, honest, attacker = _hand_built_round(CLIPPING)
    kept = hooks.filter_updates(0, honest + [attacker], global_state)
    diff = torch.cat([kept[-1][1][k] - global_state[k] for k in global_state])
    assert float(diff.norm()) == pytest.approx(0.5, rel=1e-5)
    for (_, before), (_, after) in zip(honest, kept):  # honest updates are inside the bound: untouched
        assert torch.allclose(before["w"], after["w"], atol=1e-7)


def test_the_algorithms_aggregate_applies_the_defense(tmp_path):
    result = _run(
        tmp_path, {"attack_args": {**BYZANTINE, "attack_mode": "zero"}, "defense_args": KRUM}, "krum", comm_round=1
    )
    algorithm = result.algorithm
    assert algorithm.hooks is not NO_HOOKS
    assert algorithm.hooks.defender.defense_type == "krum"


# -- errors at start -----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "sections,words",
    [
        (
            {"dp_args": {**LDP, "dp_solution_type": "nbafl"}},
            "dp_args.dp_solution_type='nbafl': not supported: FedML 0.9.6 never adds",
        ),
        ({"dp_args": {**LDP, "dp_solution_type": "dp_clip"}}, "dp_args.dp_solution_type='dp_clip': not supported"),
        (
            {"dp_args": {**LDP, "dp_solution_type": "local"}},
            "dp_args.dp_solution_type='local': must be one of ['ldp', 'cdp']",
        ),
        ({"dp_args": {k: v for k, v in LDP.items() if k != "delta"}}, "dp_args.delta: required with dp_args.enable_dp"),
        ({"dp_args": {**LDP, "epsilon": 3.0}}, "dp_args.epsilon=3.0, delta=1e-05, sensitivity=0.01: FedML's gaussian"),
        ({"dp_args": {k: v for k, v in LDP.items() if k != "sensitivity"}}, "dp_args.sensitivity: required by"),
        ({"dp_args": {**LDP, "mechanism_type": "exponential"}}, "dp_args.mechanism_type='exponential': must be one of"),
        (
            {"attack_args": {"enable_attack": True, "attack_type": "dlg"}},
            "attack_args.attack_type='dlg': not supported",
        ),
        (
            {"attack_args": {"enable_attack": True, "attack_type": "backdoor"}},
            "attack_args.attack_type='backdoor': must be",
        ),
        ({"attack_args": {**BYZANTINE, "attack_mode": "scale"}}, "attack_args.attack_mode='scale': must be one of"),
        (
            {"attack_args": {k: v for k, v in BYZANTINE.items() if k != "byzantine_client_num"}},
            "attack_args.byzantine_client_num: required by attack_type 'byzantine'",
        ),
        (
            {"attack_args": {**FLIPPING, "ratio_of_poisoned_client": 2}},
            "attack_args.ratio_of_poisoned_client=2: must be",
        ),
        ({"attack_args": {**FLIPPING, "target_class_list": [2]}}, "attack_args.target_class_list=[2]: must be as long"),
        (
            {"defense_args": {"enable_defense": True, "defense_type": "robust_learning_rate"}},
            "defense_args.defense_type='robust_learning_rate': must be one of",
        ),
        (
            {"defense_args": {**KRUM, "krum_param_m": 3}},
            "defense_args.enable_defense: FedML's code refuses a round of 5 "
            "clients (train_args.client_num_per_round) with these settings: byzantine_client_num conflicts",
        ),
        (
            {"defense_args": {"enable_defense": True, "defense_type": "norm_diff_clipping"}},
            "defense_args.norm_bound: required by defense_type 'norm_diff_clipping'",
        ),
        (
            {"attack_args": BYZANTINE, "defense_args": {**KRUM, "byzantine_client_num": 2}},
            "defense_args.byzantine_client_num=2 and attack_args.byzantine_client_num=1: FedML's attack and "
            "defense read one byzantine_client_num",
        ),
        (
            {"defense_args": {"enable_defense": True, "defense_type": "foolsgold"}},
            "defense_args.defense_type='foolsgold': FedML's foolsgold acts only through each update's sample "
            "weight, which train_args.aggregation='uniform' does not use (the model would be the one without it); set "
            "train_args.aggregation: sample_weighted",
        ),
    ],
)
def test_what_cannot_apply_is_an_error_at_start_naming_the_key(sections, words):
    with pytest.raises(ConfigError) as err:
        resolve(sections, dict(BASE))
    assert words in str(err.value)


def test_foolsgold_acts_under_the_sample_weighted_average(tmp_path):
    foolsgold = {"defense_args": {"enable_defense": True, "defense_type": "foolsgold"}}
    defended = _run(tmp_path, foolsgold, "foolsgold", aggregation="sample_weighted").final_state
    plain = _run(tmp_path, {}, "plain", aggregation="sample_weighted").final_state
    assert max(float((defended[k] - plain[k]).abs().max()) for k in plain) > 1e-4


def test_a_defense_that_cannot_run_on_the_updates_the_bound_left_is_skipped_for_the_round(tmp_path, caplog):
    """Krum needs 2f + 2 < n - m updates; when the default bound has refused the attacker's (the
    whole point of the bound), the round is combined without Krum, saying so, not stopped."""
    with caplog.at_level("WARNING"):
        result = _run(tmp_path, {"attack_args": BYZANTINE, "defense_args": KRUM}, "bounded")
    assert result.summary["status"] == "finished" and result.summary["rejected_updates"]
    assert "FedML's krum defense cannot run on the 4 client updates left after the update checks" in caplog.text


def test_fedmls_applied_defenses_are_read_from_fedml():
    applied = applied_defenses()
    assert {"krum", "norm_diff_clipping", "wise_median", "geo_median", "crfl"} <= set(applied)
    assert "robust_learning_rate" not in applied and "weak_dp" not in applied


def test_switched_off_sections_are_kept_and_change_nothing(tmp_path):
    config = resolve({"dp_args": {**LDP, "enable_dp": False}}, dict(BASE))
    assert config.safeguards["dp_args"]["enable_dp"] is False
    assert run(config, str(tmp_path / "off"), data=tiny_data()).algorithm.hooks is NO_HOOKS


# -- the keys' sections, and delta ---------------------------------------------------------------
def test_dp_delta_and_per_fedavgs_delta_stay_apart(tmp_path):
    config = resolve({"train_args": {"delta": 0.002}, "dp_args": LDP}, dict(BASE))
    assert config.setting("delta") == 0.002 and config.safeguards["dp_args"]["delta"] == 1e-5
    assert to_fedml_args(config).delta == 0.002  # FedML's flat args: the plugin's reading
    assert config.sections()["dp_args"]["delta"] == 1e-5


def test_fedmls_entry_path_reads_a_shared_name_section_by_section(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(
        "train_args:\n  delta: 0.002\n  comm_round: 2\ndp_args:\n  enable_dp: true\n  dp_solution_type: ldp\n"
        "  mechanism_type: gaussian\n  epsilon: 0.5\n  delta: 0.00001\n  sensitivity: 0.01\n"
    )
    # FedML flattens sections in order: args.delta holds the last one (dp_args')
    args = argparse.Namespace(
        yaml_config_file=str(path),
        delta=1e-5,
        comm_round=2,
        enable_dp=True,
        dp_solution_type="ldp",
        mechanism_type="gaussian",
        epsilon=0.5,
        sensitivity=0.01,
    )
    config = from_fedml_args(args)
    assert config.setting("delta") == 0.002 and config.safeguards["dp_args"]["delta"] == 1e-5


def test_fedml_keys_in_other_sections_go_to_their_own_and_set_takes_sections():
    config = resolve(
        {
            "train_args": {
                "enable_dp": True,
                "dp_solution_type": "ldp",
                "mechanism_type": "gaussian",
                "epsilon": 0.5,
                "sensitivity": 0.01,
            },
            "dp_args": {"delta": 1e-5},
        },
        dict(BASE),
    )
    assert config.safeguards["dp_args"]["enable_dp"] is True and config.setting("delta") == 0.001
    overrides = parse_overrides(["dp_args.epsilon=0.25", "defense_type=krum", "delta=0.003"])
    assert overrides == {"dp_args.epsilon": 0.25, "defense_args.defense_type": "krum", "delta": 0.003}
    config = resolve({"dp_args": LDP}, {**BASE, **parse_overrides(["dp_args.epsilon=0.25", "dp_args.delta=1e-6"])})
    assert config.safeguards["dp_args"]["epsilon"] == 0.25 and config.safeguards["dp_args"]["delta"] == 1e-6
    assert config.setting("delta") == 0.001


def test_a_run_records_and_reloads_its_fedml_sections(tmp_path):
    result = _run(tmp_path, {"dp_args": LDP}, "recorded", comm_round=1)
    reloaded = load(str(tmp_path / "recorded" / "config.yaml"))
    assert reloaded.safeguards == {"dp_args": LDP}
    assert result.summary["config"]["dp_args"] == LDP


def test_keyed_draws_leave_the_global_generators_as_they_were():
    import random

    import numpy as np

    from fedml_perfedavg.core.sampling import Purpose, keyed_global_randomness

    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    expected = (torch.rand(3), np.random.rand(3), random.random())
    torch.manual_seed(5), np.random.seed(5), random.seed(5)
    with keyed_global_randomness(0, 1, 2, Purpose.ATTACK):
        inside = (torch.rand(3), np.random.rand(3), random.random())
    with keyed_global_randomness(0, 1, 2, Purpose.ATTACK):
        assert torch.equal(torch.rand(3), inside[0]) and np.array_equal(np.random.rand(3), inside[1])
    after = (torch.rand(3), np.random.rand(3), random.random())
    assert torch.equal(after[0], expected[0]) and np.array_equal(after[1], expected[1]) and after[2] == expected[2]


def test_local_dp_noise_over_the_update_bound_is_refused_at_start_naming_both_keys(tmp_path):
    """Issue 45: FedML's LDP at the issue's settings adds noise far over the default bound, so every
    update was rejected and the run stopped saying neither DP nor the fix."""
    noisy = {**LDP, "sensitivity": 0.1}
    with pytest.raises(ConfigError) as err:
        _run(tmp_path, {"dp_args": noisy}, "bounded")
    words = str(err.value)
    assert "dp_args (local DP, gaussian, epsilon 0.5, sensitivity 0.1) adds noise of norm about" in words
    assert "train_args.max_update_ratio=1 x max(||w||, 1)" in words and "max_update_ratio: null" in words
    result = _run(tmp_path, {"dp_args": noisy}, "unbounded", max_update_ratio=None)
    assert result.summary["status"] == "finished" and result.summary["rejected_updates"] == {}


def test_a_run_stopped_for_rejected_updates_says_why_in_the_users_keys(tmp_path):
    with pytest.raises(
        RunStopped, match=r"the last update rejected: update norm .* exceeds train_args\.max_update_norm"
    ):
        _run(tmp_path, {}, "tiny-bound", max_update_norm=1e-9)


def test_byzantine_client_num_outside_the_attack_and_defense_sections_reaches_both(tmp_path):
    """Issue 45: train_args.byzantine_client_num was reported as "attack_args.byzantine_client_num
    ... not given", although the other attack keys in train_args were moved."""
    attack = {k: v for k, v in BYZANTINE.items() if k != "byzantine_client_num"}
    config = resolve({"attack_args": attack, "train_args": {"byzantine_client_num": 1}}, dict(BASE))
    assert config.safeguards["attack_args"]["byzantine_client_num"] == 1
    assert config.safeguards["defense_args"] == {"byzantine_client_num": 1}  # not switched on by it
    assert (
        _run(tmp_path, {"attack_args": attack, "train_args": {"byzantine_client_num": 1}}, "moved").summary["status"]
        == "finished"
    )
