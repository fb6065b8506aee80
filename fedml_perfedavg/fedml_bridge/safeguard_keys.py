"""FedML's DP, attack and defense sections and the keys that belong to each: data about FedML's
YAML, no FedML import. The config routes keys by them (:mod:`fedml_perfedavg.run.config`); the
round hooks that build FedML's classes from those sections are :mod:`.safeguards`."""

from __future__ import annotations

from typing import Dict, Tuple

SECTIONS = ("dp_args", "attack_args", "defense_args")
SWITCHES = {"dp_args": "enable_dp", "attack_args": "enable_attack", "defense_args": "enable_defense"}

# FedML reads its keys from the flattened args, whatever section they sit in; these are moved
# to their section when a YAML puts them elsewhere. ``delta``, ``alpha`` and ``beta`` are not:
# outside these sections they are Per-FedAvg's.
HOME_SECTION: Dict[str, str] = {
    **{
        k: "dp_args"
        for k in (
            "enable_dp",
            "dp_solution_type",
            "mechanism_type",
            "epsilon",
            "sensitivity",
            "max_grad_norm",
            "enable_rdp_accountant",
            "rdp_alpha",
            "noise_multiplier",  # DP-SGD's (the plugin's own, core/privacy.py)
            "max_epsilon",
            "accountant",  # DP-SGD's accountant (core/accounting.py)
        )
    },
    **{
        k: "attack_args"
        for k in (
            "enable_attack",
            "attack_type",
            "attack_mode",
            "attack_prob",
            "original_class_list",
            "target_class_list",
            "ratio_of_poisoned_client",
            "poison_start_round_id",
            "poison_end_round_id",
            "malicious_client_id",
            "scale_factor_S",
        )
    },
    **{k: "defense_args" for k in ("enable_defense", "defense_type", "norm_bound", "krum_param_m")},
}
# Keys FedML's attacks and defenses both read: given outside both sections, each section gets it
# (its own value, where it has one, stays).
SHARED_KEYS: Dict[str, Tuple[str, ...]] = {"byzantine_client_num": ("attack_args", "defense_args")}
