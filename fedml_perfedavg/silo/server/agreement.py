"""What server and silos must agree on, and what a silo tells the server when it comes online.

A silo announces itself (its ONLINE status carries :func:`hello`): the values that must be the
same in every process of a run (:func:`fingerprint`: the algorithm and its own settings, step sizes,
tau, the batch sizes, the model and its architecture, the seed, the dataset and the split, the
number of users, FedML's DP/attack/defense sections), and, in data-owner mode, its own data's
counts, shape and classes. The server refuses a silo whose values differ, naming the key and
both values (:func:`disagreement`), or whose data does not fit the model (:func:`data_problem`),
at once: not found out later as a wrong model. The counts it announced are the only counts the
server uses for it (sample weights, the size of its test split).
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch import nn

from ...core.types import StateDict, UserSplit, model_inputs
from ...data.silo_folder import INPUT_DTYPES
from ...net.key_roster import KeyRoster
from ...net.wire import short

# (section, key) of the config values every process of a cross-silo run must share.
AGREED = (
    ("train_args", "federated_optimizer"),
    ("train_args", "alpha"),
    ("train_args", "beta"),
    ("train_args", "local_steps"),
    ("train_args", "batch_size"),
    ("train_args", "meta_batch_size"),
    ("train_args", "hessian_batch_size"),
    ("train_args", "client_num_in_total"),
    ("train_args", "client_num_per_round"),
    ("train_args", "new_user_fraction"),
    ("train_args", "comm_round"),
    ("train_args", "on_divergence"),
    ("validation_args", "adapt_steps"),
    # which rounds are evaluated: a data owner's silo answers an evaluation only on its own copy of this
    ("validation_args", "frequency_of_the_test"),
    ("common_args", "random_seed"),
    ("data_args", "dataset"),
    ("data_args", "partition_method"),
    ("data_args", "images_per_class"),
    ("data_args", "test_images_per_class"),
    ("model_args", "model"),
    ("comm_args", "silo_data"),
    ("secagg_args", "enable_secagg"),
    ("secagg_args", "reconstruction_threshold"),
    # the rules each silo enforces on every secure sum, fixed for the whole run before its first round
    # (issue 75, rule 3): an organization started with other ones is refused at its announcement
    ("secagg_args", "min_summed_silos"),
    ("secagg_args", "max_colluding_silos"),
    ("secagg_args", "reserve_silos"),
)
ARCHITECTURE = "model_args.architecture"  # the model's tensor names, shapes and dtypes, hashed
SAFEGUARDS = "dp_args/attack_args/defense_args"  # FedML's DP, attack and defense sections, hashed
# Every party reads the same address file (docs/deployment.md): a silo whose rows differ listens
# where the server never sends (a port that disagreed was "nothing listens there" and a hang).
ADDRESSES = "comm_args.grpc_ipconfig_path"
# Every party pins the same key roster (its digest; "none" without one): a silo whose roster differs
# would refuse honest peers, or take the server's.
ROSTER_DIGEST = "comm_args.roster_path"
_PROBE_ELEMENTS = 10_000_000  # a sample larger than this is not probed (a lie meant to exhaust memory)


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def architecture(state: StateDict) -> str:
    """A short hash of a model's tensor names, shapes and dtypes."""
    return _digest([(k, list(v.shape), str(v.dtype)) for k, v in state.items()])


def fingerprint(config: Any, state: StateDict) -> Dict[str, Any]:
    """The values of :data:`AGREED` (batch sizes resolved), the architecture and the safeguards."""
    values = {f"{section}.{key}": _plain(config.setting(key)) for section, key in AGREED}
    # The chosen algorithm's own settings (its Settings dataclass), whatever they are.
    own = config.algorithm_settings(config.train.federated_optimizer)
    values.update({f"train_args.{key}": _plain(value) for key, value in own.items()})
    sizes = config.batch_sizes
    values["train_args.meta_batch_size"], values["train_args.hessian_batch_size"] = sizes[1], sizes[2]
    values[ARCHITECTURE] = architecture(state)
    values[SAFEGUARDS] = _digest(config.safeguards)
    return values


def _plain(value: Any) -> Any:
    """A config value as it crosses the wire: an enum (the variant's ``Step``) as its name."""
    return value.value if isinstance(value, Enum) else value


def address_table(addresses: Dict[int, Tuple[str, int]]) -> Dict[str, str]:
    """The server's fingerprint entry for the address file: rank -> "host:port" (never sent)."""
    return {str(rank): f"{host}:{port}" for rank, (host, port) in sorted(addresses.items())}


def addresses_seen(addresses: Dict[int, Tuple[str, int]], rank: int) -> str:
    """A silo's fingerprint entry for the address file: the rows it uses, the server's (where it
    sends) and its own (where it listens), as "0=host:port R=host:port"."""
    rows = (f"{r}={addresses[r][0]}:{addresses[r][1]}" if r in addresses else f"{r}=(no row)" for r in (0, rank))
    return " ".join(rows)


def _address_disagreement(table: Dict[str, str], theirs: Any, rank: int) -> Optional[str]:
    """The row of rank 0 or ``rank`` where the silo's address file differs from the server's, or None."""
    rows = dict(part.partition("=")[::2] for part in theirs.split()) if isinstance(theirs, str) else {}
    for r in ("0", str(rank)):
        if rows.get(r) != table.get(r, "(no row)"):
            return (
                f"silo rank {rank}'s address file ({ADDRESSES}) differs from the server's: rank {r} is "
                f"{short(rows.get(r, '(no row)'), 80)} there and {table.get(r, '(no row)')} here; every party "
                f"must use the same file (docs/deployment.md)"
            )
    return None


def disagreement(server: Dict[str, Any], silo: Dict[str, Any], rank: int) -> Optional[str]:
    """The first value a silo's fingerprint does not share with the server's, named with both
    values, or None."""
    for key in sorted(set(server) | set(silo)):
        mine, theirs = server.get(key, "(not given)"), silo.get(key, "(not given)")
        if key == ADDRESSES and isinstance(mine, dict):
            problem = _address_disagreement(mine, theirs, rank)
            if problem is not None:
                return problem
        elif not _equal(mine, theirs):
            what = f"{key} (a hash)" if key in (ARCHITECTURE, SAFEGUARDS) else key
            return (
                f"silo rank {rank} disagrees with the server on {what}: the server has {mine!r}, the silo has "
                f"{short(theirs)}"
            )
    return None


def _equal(a: Any, b: Any) -> bool:
    """Equal as the run would use them: 1 and 1.0 alike, True and 1 not."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return float(a) == float(b)
    return type(a) is type(b) and a == b


def hello(
    fingerprint_values: Dict[str, Any], user_id: Optional[int], user: Optional[UserSplit], problem: Optional[str] = None
) -> Dict[str, Any]:
    """What a silo announces: its fingerprint, and in data-owner mode (``user`` given) its user's
    counts, input shape and dtype, and classes; ``problem``: why its model cannot train on its data
    (its own probe), for the server to refuse it by."""
    if user is None:
        return {
            "fingerprint": fingerprint_values,
            "user": user_id,
            "train": None,
            "test": None,
            "input_shape": None,
            "input_dtype": None,
            "classes": None,
            "problem": problem,
        }
    classes = sorted(set(user.train_y.tolist()) | set(user.test_y.tolist()))
    return {
        "fingerprint": fingerprint_values,
        "user": user_id,
        "train": len(user.train_y),
        "test": len(user.test_y),
        "input_shape": list(user.train_x.shape[1:]),
        "input_dtype": str(user.train_x.dtype).split(".")[-1],
        "classes": classes,
        "problem": None if problem is None else problem[:500],
    }


def data_problem(model: nn.Module, announced: Dict[str, Any], rank: int) -> Optional[str]:
    """Why the data a silo announced does not fit ``model`` (its samples cannot go through it, or
    its labels go beyond the model's outputs), or None. The model runs on two zero samples of the
    announced shape and dtype, in a copy in eval mode."""
    shape, dtype_name, classes = announced["input_shape"], announced["input_dtype"], announced["classes"]
    dtype = INPUT_DTYPES.get(dtype_name)
    what = f"silo rank {rank}'s data (samples of shape {tuple(shape)}, {dtype_name}; labels up to {max(classes)})"
    if dtype is None:
        return f"{what}: inputs of dtype {dtype_name} are not among {sorted(INPUT_DTYPES)}"
    if math.prod(shape) > _PROBE_ELEMENTS:
        return f"{what}: a sample of {math.prod(shape)} values is larger than any model here takes"
    probe = copy.deepcopy(model).cpu().eval()
    try:
        with torch.no_grad():
            out = probe(model_inputs(torch.zeros((2, *shape), dtype=dtype)))
    except Exception as err:  # noqa: BLE001 - any failure of the model on these inputs is the answer
        return f"{what} does not fit the model: {type(err).__name__}: {str(err)[:200]}"
    if not isinstance(out, torch.Tensor) or out.dim() != 2 or out.shape[0] != 2:
        return (
            f"{what} does not fit the model: it gives {getattr(out, 'shape', type(out).__name__)} for 2 samples, "
            f"not (2, classes)"
        )
    if max(classes) >= out.shape[1]:
        return f"{what} does not fit the model: it has {out.shape[1]} outputs, so labels must be 0..{out.shape[1] - 1}"
    return None


@dataclass(kw_only=True)
class RunSetup:
    """What both sides' setups hold alike: the run's data mode and whether rounds are secure."""

    mode: Any  # the run's data mode (silo/server/modes.py: SharedDataRounds or OwnDataRounds, as the run extends them)
    secure_threshold: Optional[int] = None  # secure aggregation's threshold (None: updates in the clear)
    sample_weighted: bool = False  # train_args.aggregation: sample_weighted (each silo's weight is its announced count)

    @property
    def secure(self) -> bool:
        """Whether rounds are securely aggregated (the threshold is set), not a threshold's value."""
        return self.secure_threshold is not None

    @property
    def own_data(self) -> bool:
        """Data-owner mode (each silo holds its own user's data), by the run's data mode."""
        return bool(self.mode.own_data)


@dataclass(kw_only=True)
class ServerSetup(RunSetup):
    """What the server of a cross-silo run knows beyond FedML's args: the mode, the silos, the
    fingerprint every silo must agree with, and the counts it can vouch for (user -> (train, test):
    every user's in shared mode; none in data-owner mode, where each silo announces its own)."""

    silos: List[int]
    fingerprint: Dict[str, Any]
    user_counts: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    model: Optional[nn.Module] = None  # to probe a data-owner silo's announced data
    metric_names: Tuple[str, ...] = ()  # the algorithm's own per-user figures, which a silo's evaluation carries
    run_id: str = "0"  # FedML's --run_id: what secure aggregation's signatures are bound to
    privacy: Optional[str] = None  # DP-SGD's settings in words, for the round's log line (None: no DP-SGD)
    ca: Optional[bytes] = None  # the run CA's certificate: secure aggregation's advertisements checked before relaying
    roster: Optional[KeyRoster] = None  # the run's key roster: the same advertisements' keys checked against it
    min_summed: int = 0  # secure rounds: the fewest silos summed (secagg_args.min_summed_silos, as silos enforce it)
    max_colluding: int = 0  # secure rounds: secagg_args.max_colluding_silos (a secure evaluation's threshold)
    reserve_silos: int = 0  # secure rounds: how far past the keyed sample a lost silo's place may go
    # secure rounds with reserves: round -> every user in the round's keyed order (core/sampling.py keyed_order)
    keyed_order: Optional[Callable[[int], List[int]]] = None


@dataclass(kw_only=True)
class SiloSetup(RunSetup):
    """What a silo process knows of the run beyond FedML's args: its announcement, the counts it
    vouches for (its own user's in data-owner mode), and in data-owner mode what it keeps and
    enforces itself: its user's DP account and record, the secure rounds' rules and the keyed
    schedule it checks the server against."""

    hello: Dict[str, Any]  # its announcement (the fingerprint it agrees with, its addresses, its data)
    user_counts: Dict[int, Tuple[int, int]] = field(default_factory=dict)
    privacy: Optional[Any] = None  # a data owner's silo: DP-SGD's accountant of its own user (core/ledger.py)
    # DP-SGD, shared mode: the rounds whose model the server evaluates; a silo reports figures only
    # of such a model, keyed as the server's evaluation of it, so they release nothing more
    figures_after: Optional[Callable[[int], bool]] = None
    outcome: Optional[Any] = None  # a data owner's silo: its SiloOutcome, as the run layer restored and keeps it
    secure_rules: Optional[Any] = None  # a data owner's silo: secagg/rounds.py SiloRules, its own config's
    # a data owner's silo: the keyed schedule (round -> the silo ranks sampled), which it checks the server against
    scheduled: Optional[Callable[[int], List[int]]] = None
    # a data owner's silo: the run's evaluation schedule (round -> evaluated after it), likewise
    evaluates: Optional[Callable[[int], bool]] = None
    # a data owner's silo, secure rounds: round -> the silo ranks in the round's keyed order, and how far past
    # the sample a lost silo's place may go (secagg_args.reserve_silos)
    keyed_order: Optional[Callable[[int], List[int]]] = None
    reserve_silos: int = 0
