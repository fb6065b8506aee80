"""A data owner's DP-SGD account of its data across every run it takes part in.

An organization's data, not a run, is what DP-SGD protects: so its account and its noise key
belong to the data (the SHA-256 of its user's tensors), in the organization's own folder, never
in a run's. ``comm_args.account_dir`` (else ``$FEDML_PERFEDAVG_ACCOUNTS``, else
``~/.fedml_perfedavg/accounts``) holds one folder per data set:

    <account_dir>/<data sha256>/account.json   every run's uses of the data (sample rate -> count),
                                               by run, with the run's identity and sigma
    <account_dir>/<data sha256>/noise.key      32 random bytes, made once (mode 0600)

A silo's budget (``dp_args.max_epsilon``) and every epsilon it states count the uses of every
earlier run: a new ``--run_id``, a new run folder, ``--overwrite`` or a changed config starts a
new entry beside the others, never a fresh account. Each run also draws a secret of its own (kept
in the silo's ``progress.pt``, so a process of the same run started again draws the same numbers);
the silo's noise and minibatches are keyed by both, so no two runs share noise and one run's
update cannot be subtracted out of another's.

The file is the organization's; it is read as untrusted all the same (size-capped strict JSON,
checked field by field) and changed under a lock, so two runs of the same data at once both count.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Iterator, Mapping, Optional

from ..core.errors import ConfigError
from ..core.ledger import PrivacyLedger
from ..core.types import UserSplit, model_inputs
from ..documents import read_document
from .files import make_dir, write_atomic

ACCOUNTS_VARIABLE = "FEDML_PERFEDAVG_ACCOUNTS"
DEFAULT_ACCOUNTS = os.path.join("~", ".fedml_perfedavg", "accounts")
FORMAT = "fedml-perfedavg DP-SGD account, version 1"
ACCOUNT, NOISE_KEY, LOCK = "account.json", "noise.key", "account.lock"
KEY_BYTES = 32
MAX_ACCOUNT_BYTES = 16 << 20


def accounts_root(configured: Optional[str]) -> str:
    """Where accounts live: ``comm_args.account_dir``, else the environment's, else the default."""
    return os.path.abspath(os.path.expanduser(configured or os.environ.get(ACCOUNTS_VARIABLE) or DEFAULT_ACCOUNTS))


def data_digest(user: UserSplit) -> str:
    """The SHA-256 of a user's data: each tensor's role, dtype, shape and bytes, inputs as the model
    takes them (so stored uint8 images digest as the float32 ones earlier versions held: an account
    counts the same data's runs whatever the storage)."""
    digest = hashlib.sha256()
    for role in ("train_x", "train_y", "test_x", "test_y"):
        tensor = getattr(user, role).detach().cpu()
        tensor = (model_inputs(tensor) if role.endswith("_x") else tensor).contiguous()
        digest.update(f"{role}:{tensor.dtype}:{list(tensor.shape)}\n".encode())
        digest.update(tensor.numpy().tobytes())
    return digest.hexdigest()


def run_key(identity: Mapping[str, Any], run_secret: bytes) -> str:
    """This run's entry in the account: its identity (run id, config digest, user) and its secret."""
    return hashlib.sha256(json.dumps(dict(identity), sort_keys=True).encode() + run_secret).hexdigest()[:32]


def noise_secret(noise_key: bytes, run_secret: bytes) -> bytes:
    """The secret a silo's DP-SGD draws are keyed by (beside seed, round, user) in one run."""
    return hashlib.sha256(b"fedml-perfedavg noise\0" + noise_key + run_secret).digest()


class SiloAccount:
    """One data set's account folder (see the module doc)."""

    def __init__(self, folder: str, digest: str) -> None:
        self.folder, self.digest = folder, digest
        self.path = os.path.join(folder, ACCOUNT)

    @classmethod
    def open(cls, root: str, user: UserSplit) -> "SiloAccount":
        """The account of ``user``'s data under ``root``, made where there is none."""
        digest = data_digest(user)
        folder = os.path.join(root, digest)
        make_dir(folder)
        os.chmod(folder, 0o700)
        return cls(folder, digest)

    def noise_key(self) -> bytes:
        """The data's noise key, made once (32 random bytes, readable by its owner alone)."""
        path = os.path.join(self.folder, NOISE_KEY)
        with self._locked():
            if not os.path.exists(path):
                key = os.urandom(KEY_BYTES)

                def write(stream: Any) -> None:
                    os.fchmod(stream.fileno(), 0o600)  # before the secret is in it
                    stream.write(key)

                write_atomic(path, write)
            with open(path, "rb") as stream:
                key = stream.read(KEY_BYTES + 1)
        if len(key) != KEY_BYTES:
            raise ConfigError(f"{path}: {len(key)} bytes, not a {KEY_BYTES}-byte noise key; it was changed")
        return key

    def earlier_uses(self, key: str, noise_multiplier: float) -> Dict[float, int]:
        """The uses (sample rate -> count) of every run in the account but ``key``'s.
        :class:`ConfigError` where one ran with another noise multiplier: the account composes one."""
        uses: Dict[float, int] = {}
        for other, entry in self._runs().items():
            if other == key or not entry["uses"]:
                continue
            if entry["noise_multiplier"] != noise_multiplier:
                raise ConfigError(
                    f"dp_args.noise_multiplier={noise_multiplier!r}: this organization's data was used with "
                    f"noise_multiplier {entry['noise_multiplier']!r} by an earlier run (run id "
                    f"{entry['identity'].get('run_id')!r}; {self.path}). Its account composes one noise "
                    f"multiplier: allowed is {entry['noise_multiplier']!r}"
                )
            for rate, count in entry["uses"].items():
                uses[rate] = uses.get(rate, 0) + count
        return uses

    def record(self, key: str, identity: Mapping[str, Any], noise_multiplier: float, uses: Mapping[float, int]) -> None:
        """Write run ``key``'s uses so far (they only grow), under the account's lock."""
        with self._locked():
            runs = self._runs()
            runs[key] = {"identity": dict(identity), "noise_multiplier": noise_multiplier, "uses": dict(uses)}
            text = json.dumps(
                {
                    "format": FORMAT,
                    "data_sha256": self.digest,
                    "runs": {
                        k: {**e, "uses": [[rate, count] for rate, count in sorted(e["uses"].items())]}
                        for k, e in runs.items()
                    },
                },
                indent=1,
                allow_nan=False,
            )
            write_atomic(self.path, lambda stream: stream.write(text.encode()))

    def runs(self) -> int:
        """How many runs the account holds."""
        return len(self._runs())

    def holds(self, key: str) -> bool:
        """Whether run ``key`` has an entry."""
        return key in self._runs()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        with open(os.path.join(self.folder, LOCK), "a") as lock:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(lock.fileno(), fcntl.LOCK_UN)

    def _runs(self) -> Dict[str, Dict[str, Any]]:
        """The account's runs, checked: :class:`ConfigError` naming the file where it is not an account."""
        try:
            data = read_document(self.path, MAX_ACCOUNT_BYTES, FORMAT)
            if data.get("data_sha256") != self.digest:
                raise ValueError(f"it is the account of data {data.get('data_sha256')!r}, not of {self.digest}")
            return {_text(k, "a run key"): _entry(e) for k, e in _mapping(data.get("runs"), "runs").items()}
        except FileNotFoundError:
            return {}
        except OSError as err:
            raise ConfigError(f"{self.path}: cannot read this organization's DP-SGD account ({err.strerror})") from None
        except ValueError as err:
            raise ConfigError(
                f"{self.path}: not a readable DP-SGD account ({err}); it holds what this organization's data has "
                f"been used for: restore it from a backup rather than removing it"
            ) from None


def _mapping(value: Any, what: str) -> Dict[str, Any]:
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not an object")
    return value


def _text(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 200:
        raise ValueError(f"{what} {value!r} is not a short string")
    return value


def _entry(value: Any) -> Dict[str, Any]:
    entry = _mapping(value, "a run")
    sigma = entry.get("noise_multiplier")
    if isinstance(sigma, bool) or not isinstance(sigma, (int, float)) or not math.isfinite(sigma) or sigma <= 0:
        raise ValueError(f"a run's noise_multiplier is {sigma!r}")
    uses: Dict[float, int] = {}
    pairs = entry.get("uses")
    if not isinstance(pairs, list):
        raise ValueError("a run's uses are not a list")
    for pair in pairs:
        if not (isinstance(pair, list) and len(pair) == 2):
            raise ValueError(f"a run's use {pair!r} is not [sample rate, count]")
        rate, count = pair
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1:
            raise ValueError(f"a run's sample rate {rate!r} is not in (0, 1]")
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"a run's use count {count!r} is not a whole number >= 0")
        uses[float(rate)] = uses.get(float(rate), 0) + count
    identity = dict(_mapping(entry.get("identity"), "a run's identity"))
    return {"identity": identity, "noise_multiplier": float(sigma), "uses": uses}


@dataclass
class RunAccount:
    """This run's place in an organization's account: what its silo records as it goes."""

    account: SiloAccount
    key: str
    identity: Dict[str, Any]
    run_secret: bytes
    user: int

    def record(self, ledger: PrivacyLedger) -> None:
        """Write this run's uses of the data so far (before any answer that used them leaves)."""
        self.account.record(self.key, self.identity, ledger.dp.noise_multiplier, ledger.this_run(self.user))
