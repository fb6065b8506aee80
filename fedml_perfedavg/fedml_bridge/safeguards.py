"""FedML's differential privacy, attacks and defenses as an algorithm's round hooks.

FedML 0.9.6 applies these through process-wide singletons (``FedMLDifferentialPrivacy``,
``FedMLAttacker``, ``FedMLDefender``) from its ``ClientTrainer``/``ServerAggregator`` hooks, and
each backend calls a different subset of those hooks (its sp loop none, its MPI server the attack
and defense only, cross-silo all: simulation/sp/fedavg, simulation/mpi/fedavg, cross_silo/). Here
FedML's own classes are built once per process from the run's
``dp_args``/``attack_args``/``defense_args`` sections (never from the flattened ``args``, where
``dp_args.delta`` and Per-FedAvg's ``train_args.delta`` are one name) and called from
:class:`~fedml_perfedavg.algorithms.base.RoundHooks`, which every backend runs at the same points
of a round. The plugin's trainer and aggregator build FedML's singletons switched off (:func:`without_safeguards`),
so nothing is applied twice.

Every draw these classes make from the global generators (Gaussian and Laplace noise, the
byzantine attack's choice of clients and random weights, ``attack_prob``) runs inside
:func:`~fedml_perfedavg.core.sampling.keyed_global_randomness`: keyed by (seed, round, client,
purpose), so the same round draws the same numbers on the batched engine, FedML's sp loop, MPI
and cross-silo.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import logging
import math
from collections import OrderedDict
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor

from .. import logs
from ..algorithms.base import RoundHooks
from ..core.errors import ConfigError
from ..core.sampling import Purpose, generator_for, keyed_global_randomness
from ..core.types import StateDict
from .safeguard_keys import HOME_SECTION, SECTIONS, SHARED_KEYS, SWITCHES  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

# fedml/core/dp/fedml_differential_privacy.py: is_local_dp_enabled / is_global_dp_enabled.
DP_SOLUTIONS = ("ldp", "cdp")
DP_REFUSED = {
    "nbafl": "FedML 0.9.6 never adds NbAFL's noise: its ServerAggregator only calls set_params_for_dp, and "
    "is_local_dp_enabled/is_global_dp_enabled list ldp and cdp alone (fedml/core/dp/"
    "fedml_differential_privacy.py)",
    "dp_clip": "FedML 0.9.6's DP_Clip cannot run: add_local_noise needs the global model, which "
    "FedMLDifferentialPrivacy.add_local_noise never passes, and its add_global_noise returns None "
    "(fedml/core/dp/frames/dp_clip.py)",
}
# fedml/core/security/fedml_attacker.py: is_model_attack / is_data_poisoning_attack.
MODEL_ATTACKS = ("byzantine", "model_replacement")
DATA_ATTACKS = ("label_flipping",)
ATTACK_REFUSED = {
    "dlg": "FedML's DLG is a data-reconstruction probe (fedml/core/security/attack/dlg_attack.py): it reads "
    "gradients and changes nothing in the round; the plugin's clients send models, not gradients",
}


# FedML's defenses that change nothing but the updates' sample counts (foolsgold_defense.py
# scales each count by its FoolsGold weight): under a plain average they would do nothing.
WEIGHT_ONLY_DEFENSES = frozenset({"foolsgold"})


def applied_defenses() -> List[str]:
    """The defenses FedML's ServerAggregator applies before, on or after aggregation, read from
    FedML's own predicates (fedml/core/security/fedml_defender.py ``is_defense_*_aggregation``)."""
    from fedml.core.security import constants
    from fedml.core.security.fedml_defender import FedMLDefender

    probe = FedMLDefender()
    probe.is_enabled = True
    applied = set()
    for name in (v for k, v in vars(constants).items() if k.startswith(("DEFENSE_", "ANOMALY")) and isinstance(v, str)):
        probe.defense_type = name
        if (
            probe.is_defense_before_aggregation()
            or probe.is_defense_on_aggregation()
            or probe.is_defense_after_aggregation()
        ):
            applied.add(name)
    return sorted(applied)


@contextlib.contextmanager
def _fedml_prints() -> Iterator[None]:
    """FedML's DP and attack code print() what they do (every round): to the debug log instead;
    its module-level ``logging.info`` calls must not configure the root logger."""
    captured = io.StringIO()
    with logs.no_implicit_basic_config(), contextlib.redirect_stdout(captured):
        yield
    if captured.getvalue().strip():
        logger.debug("FedML printed: %s", captured.getvalue().strip())


def enabled(sections: Dict[str, Dict[str, Any]]) -> bool:
    """Whether any of FedML's DP, attack or defense is switched on in these sections (DP-SGD,
    ``dp_solution_type: dpsgd``, is the plugin's own: core/privacy.py)."""
    return any(
        bool(sections.get(section, {}).get(switch)) and not _plugin_dp(sections.get(section, {}))
        for section, switch in SWITCHES.items()
    )


def _plugin_dp(section: Dict[str, Any]) -> bool:
    return section.get("dp_solution_type") == "dpsgd"


def fedml_view(sections: Dict[str, Dict[str, Any]], run: Dict[str, Any]) -> argparse.Namespace:
    """The args FedML's DP, attack and defense classes read: the run's facts they use
    (``run``: rounds, clients, batch size, dataset) and the three sections' keys, on the CPU."""
    view = argparse.Namespace(
        training_type="simulation", backend="sp", device_type="cpu", using_gpu=False, gpu_id=0, **run
    )
    where: Dict[str, str] = {}
    for section in SECTIONS:
        for name, value in sections.get(section, {}).items():
            if name in where and getattr(view, name) != value:  # FedML's classes read one flat namespace
                raise ConfigError(
                    f"{section}.{name}={value!r} and {where[name]}.{name}={getattr(view, name)!r}: FedML's "
                    f"attack and defense read one {name}; give one value"
                )
            where[name] = section
            setattr(view, name, copy.deepcopy(value))
    return view


def _missing_key(err: AttributeError, section: str, what: str) -> ConfigError:
    name = getattr(err, "name", None) or str(err).rsplit("'", 2)[-2]
    return ConfigError(f"{section}.{name}: required by {what} (FedML reads it), not given")


def _init_by_fedml(
    feature: Any,
    view: Any,
    section: str,
    what: str,
    refused: Optional[Callable[[Exception], ConfigError]] = None,
) -> Any:
    """``feature.init(view)`` with FedML's prints kept out of the run's output; returns ``feature``.
    A key FedML reads that ``section`` lacks is a :class:`ConfigError` naming it; FedML's
    ValueError or TypeError becomes ``refused(err)`` where given."""
    try:
        with _fedml_prints():
            feature.init(view)
    except AttributeError as err:
        raise _missing_key(err, section, what) from None
    except (ValueError, TypeError) as err:
        if refused is None:
            raise
        raise refused(err) from None
    return feature


def check_secure_aggregation(sections: Dict[str, Dict[str, Any]]) -> None:
    """What cannot work when the server sees only the sum of the updates: FedML's defenses (each
    reads every update: Krum, FoolsGold, norm clipping, ...) and model attacks (they rewrite
    updates on the server). Central DP's noise on the sum stays; its per-update clipping is each
    silo's own clipping to the update bound."""
    defense = sections.get("defense_args", {})
    if defense.get("enable_defense"):
        raise ConfigError(
            f"defense_args.enable_defense=True (defense_type={defense.get('defense_type')!r}) with "
            f"secagg_args.enable_secagg: FedML's defenses read each silo's update, which secure aggregation "
            f"hides from the server; the silos' clipping to train_args.max_update_ratio is the bound instead"
        )
    attack = sections.get("attack_args", {})
    if attack.get("enable_attack") and attack.get("attack_type") in MODEL_ATTACKS:
        raise ConfigError(
            f"attack_args.attack_type={attack.get('attack_type')!r} with secagg_args.enable_secagg: a model "
            f"attack rewrites updates on the server, which sees only their sum"
        )


def check(sections: Dict[str, Dict[str, Any]], run: Dict[str, Any]) -> None:
    """Errors at start, naming the key, for what FedML's classes would refuse or Per-FedAvg cannot
    use; builds each enabled feature once with FedML's own code to surface its own errors."""
    if enabled(sections):
        FedMLSafeguards(sections, run).rehearse(int(run["client_num_per_round"]))


# -- building FedML's objects (errors named by key) ------------------------------------------
def build_dp(section: Dict[str, Any], view: Any) -> Any:
    """FedML's differential privacy for ``section`` (None where it is not enabled), built by FedML
    from ``view``; :class:`ConfigError` naming the key for what FedML would refuse or Per-FedAvg
    cannot use."""
    if not section.get("enable_dp") or _plugin_dp(section):
        return None
    from fedml.core.dp.fedml_differential_privacy import FedMLDifferentialPrivacy

    solution = section.get("dp_solution_type")
    if solution in DP_REFUSED:
        raise ConfigError(
            f"dp_args.dp_solution_type={solution!r}: not supported: {DP_REFUSED[solution]}; use one "
            f"of {list(DP_SOLUTIONS)}"
        )
    if solution not in DP_SOLUTIONS:
        raise ConfigError(
            f"dp_args.dp_solution_type={solution!r}: must be one of {list(DP_SOLUTIONS)} (FedML's local and central DP)"
        )
    if "delta" not in section:
        raise ConfigError(
            "dp_args.delta: required with dp_args.enable_dp (train_args.delta is Per-FedAvg's "
            "finite-difference step, not DP's delta)"
        )
    mechanism = section.get("mechanism_type")
    if str(mechanism).lower() not in ("gaussian", "laplace"):
        raise ConfigError(
            f"dp_args.mechanism_type={mechanism!r}: must be one of ['gaussian', 'laplace'] "
            f"(fedml/core/dp/mechanisms/dp_mechanism.py)"
        )
    values = {k: section.get(k) for k in ("epsilon", "delta", "sensitivity")}
    return _init_by_fedml(
        FedMLDifferentialPrivacy(),
        view,
        "dp_args",
        f"dp_solution_type {solution!r}",
        lambda err: ConfigError(
            f"dp_args.epsilon={values['epsilon']!r}, delta={values['delta']!r}, sensitivity="
            f"{values['sensitivity']!r}: FedML's {mechanism} mechanism refuses them: {err}"
        ),
    )


def build_attacker(section: Dict[str, Any], view: Any) -> Any:
    """FedML's attacker for ``section`` (None where it is not enabled), built by FedML
    from ``view``; :class:`ConfigError` naming the key for what FedML would refuse or Per-FedAvg
    cannot use."""
    if not section.get("enable_attack"):
        return None
    from fedml.core.security.fedml_attacker import FedMLAttacker

    kind = section.get("attack_type")
    if kind in ATTACK_REFUSED:
        raise ConfigError(f"attack_args.attack_type={kind!r}: not supported: {ATTACK_REFUSED[kind]}")
    if kind not in MODEL_ATTACKS + DATA_ATTACKS:
        raise ConfigError(
            f"attack_args.attack_type={kind!r}: must be one of {list(MODEL_ATTACKS + DATA_ATTACKS)} "
            f"(FedML's attacks on client models or data)"
        )
    if kind == "byzantine" and section.get("attack_mode") not in ("zero", "random", "flip"):
        raise ConfigError(
            f"attack_args.attack_mode={section.get('attack_mode')!r}: must be one of ['zero', "
            f"'random', 'flip'] (fedml/core/security/attack/byzantine_attack.py)"
        )
    if kind == "label_flipping":
        ratio = section.get("ratio_of_poisoned_client")
        if not isinstance(ratio, float) or not 0.0 <= ratio <= 1.0:
            raise ConfigError(
                f"attack_args.ratio_of_poisoned_client={ratio!r}: must be a float in [0, 1] (the "
                f"share of a round's clients whose labels are flipped)"
            )
        for name in ("original_class_list", "target_class_list"):
            if not isinstance(section.get(name), list) or not all(isinstance(c, int) for c in section[name]):
                raise ConfigError(f"attack_args.{name}={section.get(name)!r}: must be a list of class indices")
        if len(section["original_class_list"]) != len(section["target_class_list"]):
            raise ConfigError(
                f"attack_args.target_class_list={section['target_class_list']!r}: must be as long "
                f"as original_class_list={section['original_class_list']!r}"
            )
    return _init_by_fedml(FedMLAttacker(), view, "attack_args", f"attack_type {kind!r}")


def build_defender(section: Dict[str, Any], view: Any) -> Any:
    """FedML's defender for ``section`` (None where it is not enabled), built by FedML
    from ``view``; :class:`ConfigError` naming the key for what FedML would refuse or Per-FedAvg
    cannot use."""
    if not section.get("enable_defense"):
        return None
    from fedml.core.security.fedml_defender import FedMLDefender

    kind = section.get("defense_type")
    applied = applied_defenses()
    if kind not in applied:
        raise ConfigError(
            f"defense_args.defense_type={kind!r}: must be one of {applied}: the defenses FedML's "
            f"ServerAggregator applies before, on or after aggregation (fedml/core/security/"
            f"fedml_defender.py is_defense_*_aggregation); others FedML never calls there"
        )
    if kind in WEIGHT_ONLY_DEFENSES and getattr(view, "aggregation", "sample_weighted") != "sample_weighted":
        raise ConfigError(
            f"defense_args.defense_type={kind!r}: FedML's {kind} acts only through each update's "
            f"sample weight, which train_args.aggregation={view.aggregation!r} does not use "
            f"(the model would be the one without it); set train_args.aggregation: sample_weighted"
        )
    return _init_by_fedml(
        FedMLDefender(),
        view,
        "defense_args",
        f"defense_type {kind!r}",
        lambda err: ConfigError(f"defense_args.defense_type={kind!r}: FedML refuses its parameters: {err}"),
    )


class FedMLSafeguards(RoundHooks):
    """FedML's DP, attacks and defenses for one run, as :class:`RoundHooks`."""

    def __init__(self, sections: Dict[str, Dict[str, Any]], run: Dict[str, Any]) -> None:
        from .bootstrap import import_fedml

        with _fedml_prints():
            import_fedml()
        self.seed = int(run["random_seed"])
        self.view = fedml_view(sections, run)
        self.dp = build_dp(sections.get("dp_args", {}), self.view)
        self.attacker = build_attacker(sections.get("attack_args", {}), self.view)
        self.defender = build_defender(sections.get("defense_args", {}), self.view)
        self.poisons_labels = self.attacker is not None and self.attacker.attack_type in DATA_ATTACKS
        self.changes_client_results = self.dp is not None and self.dp.is_local_dp_enabled()

    # -- the round hooks ----------------------------------------------------------------------
    def client_labels(self, round_idx: int, client_id: int, y: Tensor) -> Tensor:
        """FedML's label flipping (LabelFlippingAttack's class map) for the clients it poisons this
        round: each client is poisoned with probability ``ratio_of_poisoned_client``, drawn keyed
        by (seed, round, client) (FedML's own draw counts calls, so it differs between backends)."""
        if not self.poisons_labels or not self._poisoned(round_idx, client_id):
            return y
        from fedml.core.security.common.utils import replace_original_class_with_target_class

        attack = self.attacker.attacker
        flat = y.detach().reshape(-1).cpu().clone()
        flipped = replace_original_class_with_target_class(flat, attack.original_class_list, attack.target_class_list)
        return flipped.reshape(y.shape).to(y.device)

    def _poisoned(self, round_idx: int, client_id: int) -> bool:
        attack = self.attacker.attacker
        if not attack.poison_start_round_id <= round_idx <= attack.poison_end_round_id:
            return False
        draw = torch.rand((), generator=generator_for(self.seed, round_idx, client_id, Purpose.ATTACK))
        return bool(draw < attack.ratio_of_poisoned_client)

    def client_result(self, round_idx: int, client_id: int, state: StateDict) -> StateDict:
        """FedML's local DP: its mechanism's noise added to the model the client sends."""
        if not self.changes_client_results:
            return state
        with _fedml_prints(), keyed_global_randomness(self.seed, round_idx, client_id, Purpose.LOCAL_PRIVACY):
            return _like(state, self.dp.add_local_noise(_on_cpu(state)))

    def before_aggregation(
        self, round_idx: int, updates: List[Tuple[float, StateDict]], global_state: StateDict
    ) -> List[Tuple[float, StateDict]]:
        """FedML's order (core/alg_frame/server_aggregator.py on_before_aggregation): central DP's
        clipping, then a model attack on the updates as received."""
        if self.dp is not None and self.dp.is_global_dp_enabled() and self.dp.is_clipping():
            updates = [
                (n, _like(sd, clipped))
                for (n, sd), (_, clipped) in zip(updates, self.dp.global_clip([(n, _on_cpu(sd)) for n, sd in updates]))
            ]
        if self.attacker is not None and self.attacker.attack_type in MODEL_ATTACKS:
            with _fedml_prints(), keyed_global_randomness(self.seed, round_idx, -1, Purpose.ATTACK):
                if self.attacker.is_model_attack():
                    attacked = self.attacker.attack_model(
                        [(n, _on_cpu(sd)) for n, sd in updates], extra_auxiliary_info=_on_cpu(global_state)
                    )
                    updates = [(n, _like(sd, new)) for (n, sd), (_, new) in zip(updates, attacked)]
        return updates

    def filter_updates(
        self, round_idx: int, updates: List[Tuple[float, StateDict]], global_state: StateDict
    ) -> List[Tuple[float, StateDict]]:
        """FedML's defense before aggregation (Krum, norm-difference clipping, ...)."""
        if self.defender is None or not self.defender.is_defense_before_aggregation():
            return updates
        self._fit_positional_memory(round_idx, len(updates))
        template = updates[0][1]
        try:
            with _fedml_prints(), keyed_global_randomness(self.seed, round_idx, -1, Purpose.DEFENSE):
                kept = self.defender.defend_before_aggregation(
                    [(n, _on_cpu(sd)) for n, sd in updates], extra_auxiliary_info=_on_cpu(global_state)
                )
        except (ValueError, AssertionError, IndexError) as err:
            if len(updates) >= int(self.view.client_num_per_round):
                raise  # the round's full count: what the start's rehearsal reports as a configuration error
            # FedML's defenses assume the round's full count (Krum: 2f + 2 < n); the update checks
            # may have rejected some already (the attack's own models, often). Stopping here would
            # let one rejected update stop the run.
            logger.warning(
                "round %d: FedML's %s defense cannot run on the %d client updates left after the update "
                "checks (%s); they are combined without it this round",
                round_idx,
                self.defender.defense_type,
                len(updates),
                err,
            )
            return updates
        if len(kept) < len(updates):
            logger.info(
                "round %d: FedML's %s defense kept %d of %d client updates",
                round_idx,
                self.defender.defense_type,
                len(kept),
                len(updates),
            )
        return [(n, _like(template, sd)) for n, sd in kept]

    def _fit_positional_memory(self, round_idx: int, count: int) -> None:
        """FedML's FoolsGold adds each update's features to a memory kept by position in the round
        (foolsgold_defense.py, which warns that "grads in different iterations may be from
        different clients"), so a round with more updates than its memory holds (a round after one
        that lost or rejected an update) failed with an IndexError that stopped the run. The
        memory starts again then, and the log says so."""
        from fedml.core.security.defense.foolsgold_defense import FoolsGoldDefense

        defense = self.defender.defender if self.defender is not None else None
        if isinstance(defense, FoolsGoldDefense) and defense.memory is not None and len(defense.memory) != count:
            logger.warning(
                "round %d: FedML's foolsgold remembers %d updates by their position and this round has %d; "
                "its memory starts again (it cannot tell which client an update came from)",
                round_idx,
                len(defense.memory),
                count,
            )
            defense.memory = None

    def combine(
        self,
        round_idx: int,
        updates: List[Tuple[float, StateDict]],
        global_state: StateDict,
        base: Callable[[List[Tuple[float, StateDict]]], StateDict],
    ) -> StateDict:
        """FedML's defense on aggregation (median, geometric median, ...) with the algorithm's own
        average as its base aggregation, or that average."""
        if self.defender is None or not self.defender.is_defense_on_aggregation():
            return base(updates)
        template = updates[0][1]

        def base_aggregation(*args: Any, **kwargs: Any) -> StateDict:  # FedML calls it (args, list) or by name
            raw = kwargs.get("raw_grad_list", args[-1] if args else None)
            if raw is None:
                raise TypeError("FedML's defense called its base aggregation without the updates")
            return _on_cpu(base([(n, _like(template, sd)) for n, sd in raw]))

        with _fedml_prints(), keyed_global_randomness(self.seed, round_idx, -1, Purpose.DEFENSE):
            combined = self.defender.defend_on_aggregation(
                [(n, _on_cpu(sd)) for n, sd in updates],
                base_aggregation_func=base_aggregation,
                extra_auxiliary_info=_on_cpu(global_state),
            )
        return _like(template, combined)

    def after_aggregation(self, round_idx: int, state: StateDict, global_state: StateDict) -> StateDict:
        """FedML's order (on_after_aggregation): central DP's noise, then a defense after aggregation."""
        if self.dp is not None and self.dp.is_global_dp_enabled():
            with _fedml_prints(), keyed_global_randomness(self.seed, round_idx, -1, Purpose.CENTRAL_PRIVACY):
                state = _like(state, self.dp.add_global_noise(_on_cpu(state)))
        if self.defender is not None and self.defender.is_defense_after_aggregation():
            with _fedml_prints(), keyed_global_randomness(self.seed, round_idx, -1, Purpose.DEFENSE):
                state = _like(state, self.defender.defend_after_aggregation(_on_cpu(state)))
        return state

    def rehearse(self, clients: int) -> None:
        """One round on a throwaway model with ``clients`` updates, so what FedML's code refuses
        for this round's shape (Krum's client count, ...) is an error at start, not at round 0."""
        state = OrderedDict(weight=torch.zeros(3, 2), bias=torch.zeros(3))
        made: List[Tuple[float, StateDict]] = [
            (1.0, OrderedDict((k, v + 0.01 * (i + 1)) for k, v in state.items())) for i in range(clients)
        ]
        try:
            updates = self.before_aggregation(
                0, [(n, self.client_result(0, i, sd)) for i, (n, sd) in enumerate(made)], state
            )
            kept = self.filter_updates(0, updates, state)
            average = lambda kept: OrderedDict((k, sum(sd[k] for _, sd in kept) / len(kept)) for k in state)  # noqa: E731
            self.after_aggregation(0, self.combine(0, kept, state, average), state)
        except (ValueError, ArithmeticError, IndexError, AttributeError) as err:
            names = [f"{section}.{SWITCHES[section]}" for section in SECTIONS if self._on(section)]
            raise ConfigError(
                f"{', '.join(names)}: FedML's code refuses a round of {clients} clients "
                f"(train_args.client_num_per_round) with these settings: {err}"
            ) from None

    def _on(self, section: str) -> bool:
        return {"dp_args": self.dp, "attack_args": self.attacker, "defense_args": self.defender}[section] is not None

    def describe(self) -> str:
        """One line for the log: what is on."""
        parts = []
        if self.dp is not None:
            parts.append(
                f"DP {self.dp.dp_solution_type} ({self.view.mechanism_type}, epsilon {self.view.epsilon}, "
                f"delta {self.view.delta})"
            )
        if self.attacker is not None:
            parts.append(f"attack {self.attacker.attack_type}")
        if self.defender is not None:
            parts.append(f"defense {self.defender.defense_type}")
        return ", ".join(parts)


def _on_cpu(state: StateDict) -> "OrderedDict[str, Tensor]":
    """A CPU copy FedML's code may change in place (several of its attacks and clips do)."""
    return OrderedDict((k, v.detach().to("cpu", copy=True)) for k, v in state.items())


def _like(template: StateDict, state: Dict[str, Any]) -> "OrderedDict[str, Tensor]":
    """``state`` with ``template``'s keys, dtypes and devices (FedML's Laplace noise is float64,
    its attacks build tensors on their own device)."""
    return OrderedDict((k, torch.as_tensor(state[k]).to(device=v.device, dtype=v.dtype)) for k, v in template.items())


def without_safeguards(args: Any) -> argparse.Namespace:
    """A copy of FedML's ``args`` with DP, attack and defense switched off: what the plugin's
    ClientTrainer/ServerAggregator hand FedML's constructors, which init FedML's singletons from
    it (core/alg_frame/client_trainer.py, server_aggregator.py), so FedML's own hooks never
    apply them a second time."""
    quiet = copy.copy(args)
    for switch in SWITCHES.values():
        setattr(quiet, switch, False)
    return quiet


@contextlib.contextmanager
def plugin_dp_hidden(args: Any) -> Iterator[None]:
    """Within: ``args.enable_dp`` off where ``dp_solution_type`` is the plugin's ``dpsgd``, for
    FedML code that inits FedML's DP singleton from ``args`` (simulation/sp/fedavg's trainer,
    simulation/mpi/fedavg/FedAvgAPI.py), which raises "dp solution is not defined" on a solution
    it does not know. The algorithm applies DP-SGD itself; the plugin reads its config, not ``args``."""
    hide = bool(getattr(args, "enable_dp", False)) and getattr(args, "dp_solution_type", None) == "dpsgd"
    if hide:
        args.enable_dp = False
    try:
        yield
    finally:
        if hide:
            args.enable_dp = True


def run_facts(config: Any) -> Dict[str, Any]:
    """The run's values FedML's DP, attack and defense classes read (a view, not FedML's args),
    and the aggregation they are combined by."""
    return {
        "random_seed": config.common.random_seed,
        "comm_round": config.train.comm_round,
        "client_num_per_round": config.train.client_num_per_round,
        "client_num_in_total": config.train.client_num_in_total,
        "batch_size": config.train.batch_size,
        "dataset": config.data.dataset,
        "train_data_num_in_total": None,
        "aggregation": config.train.aggregation,
    }


def local_noise_norm(safeguards: Optional[FedMLSafeguards], parameters: int) -> Optional[float]:
    """The norm FedML's local DP adds to a client update of ``parameters`` values (each gets
    independent noise: the standard deviation times sqrt(parameters)), or None without local DP
    (fedml/core/dp/mechanisms/gaussian.py, laplace.py give the scales)."""
    if safeguards is None or safeguards.dp is None or not safeguards.dp.is_local_dp_enabled():
        return None
    view = safeguards.view
    epsilon, delta, sensitivity = float(view.epsilon), float(view.delta), float(view.sensitivity)
    if str(view.mechanism_type).lower() == "gaussian":
        std = math.sqrt(2 * math.log(1.25 / delta)) * sensitivity / epsilon
    else:  # laplace: scale b, standard deviation b * sqrt(2)
        std = math.sqrt(2) * sensitivity / (epsilon - math.log(1 - delta))
    return std * math.sqrt(parameters)


def for_config(config: Any) -> Optional[FedMLSafeguards]:
    """The run's safeguards, or None when its config switches none on."""
    if not enabled(config.safeguards):
        return None
    return FedMLSafeguards(config.safeguards, run_facts(config))
