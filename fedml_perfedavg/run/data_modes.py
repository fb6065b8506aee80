"""Where a run's users' data lives, chosen once per run (:func:`data_mode`): every user's data in
the process that trains them (:class:`SharedData`: a simulation, or a cross-silo server that hands
each silo its round's clients), or each user's with its own silo alone (:class:`OwnData`: data-owner
mode, ``comm_args.silo_data: own``). The mode answers what differs between them as a run is
assembled (run/assembly.py): which users a process holds, how their data is checked, who keeps each
user's DP-SGD account, whether a problem stops the process or is announced to the server, whether
the server measures, and what a silo knows of its own user."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

from ..algorithms.base import FederatedAlgorithm
from ..core.errors import ConfigError
from ..core.ledger import PrivacyLedger, PrivacyRecord, ReportedPrivacy
from ..core.types import UserSplit
from ..data.fedml_format import own_user_from_fedml_dataset, users_from_fedml_dataset
from ..silo.server.modes import OwnDataRounds, SharedDataRounds
from .privacy_plan import central_ledger, key_training_draws, own_account, this_runs_secret
from .silo_account import RunAccount
from .rules import check_batch_sizes
from .schema import Config

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SiloRun:
    """What a silo's DP-SGD set-up needs of its run: the run directory, and its identity (run id,
    agreed config, user; computed when asked: only a data owner's silo with DP-SGD asks)."""

    run_dir: str
    identity: Callable[[], Dict[str, Any]]


@dataclass(frozen=True)
class SiloPrivacy:
    """A silo's DP-SGD: its ledger of its own user, why it cannot take part (or None), and this
    run's entry in its organization's account (all None where the server accounts)."""

    ledger: Optional[PrivacyLedger] = None
    problem: Optional[str] = None
    account: Optional[RunAccount] = None
    run_secret: Optional[bytes] = None  # in the key of its draws (kept in its progress.pt)


class DataMode(Protocol):
    """What differs between the data modes as a run is assembled (each method's words are in
    :class:`SharedData` and :class:`OwnData`)."""

    label: str
    server_measures: bool
    own_data: bool  # and the cross-silo protocol's half (silo/server/modes.py), which each extends

    def users_of(self, config: Config, dataset: list, rank: int, device: Any) -> Tuple[List[UserSplit], list]: ...
    def check_data(self, config: Config, users: List[UserSplit], rank: int) -> None: ...
    def announces_problems(self, is_server: bool) -> bool: ...
    def server_privacy(
        self, config: Config, algorithm: FederatedAlgorithm, users: List[UserSplit]
    ) -> PrivacyRecord: ...
    def silo_privacy(
        self, config: Config, algorithm: FederatedAlgorithm, rank: int, users: List[UserSplit], run: SiloRun
    ) -> SiloPrivacy: ...
    def vouched_counts(self, users: List[UserSplit], rank: int) -> Dict[int, Tuple[int, int]]: ...


class SharedData(SharedDataRounds):
    """Every user's data in the process that trains them: the simulation's, or the cross-silo
    server's, which sends each silo its round's clients and vouches for their counts."""

    label = ""  # how a log line names the mode beside a process's role
    server_measures = True  # the server holds the users: it evaluates and measures on them

    def users_of(self, config: Config, dataset: list, rank: int, device: Any) -> Tuple[List[UserSplit], list]:
        """Every user (FedML's dataset, keyed 0..n-1), and the dataset as handed."""
        return users_from_fedml_dataset(dataset, device), dataset

    def check_data(self, config: Config, users: List[UserSplit], rank: int) -> None:
        """The dataset has the config's number of users, and each batch fits the smallest."""
        if len(users) != config.train.client_num_in_total:
            raise ConfigError(
                f"train_args.client_num_in_total={config.train.client_num_in_total!r}: "
                f"the dataset has {len(users)} clients"
            )
        check_batch_sizes(config, min(len(u.train_y) for u in users), "the smallest client's training data")

    def announces_problems(self, is_server: bool) -> bool:
        """Whether this process announces a problem with its data to the server (and the run goes on
        without it) rather than stopping: never here, where one process holds every user."""
        return False

    def server_privacy(self, config: Config, algorithm: FederatedAlgorithm, users: List[UserSplit]) -> PrivacyRecord:
        """The server's record of DP-SGD: its own ledger of every user, the budget checked first."""
        return central_ledger(config, algorithm, users)

    def silo_privacy(
        self, config: Config, algorithm: FederatedAlgorithm, rank: int, users: List[UserSplit], run: SiloRun
    ) -> SiloPrivacy:
        """A silo's own account: none here (the server accounts for every user)."""
        return SiloPrivacy()

    def vouched_counts(self, users: List[UserSplit], rank: int) -> Dict[int, Tuple[int, int]]:
        """The (train, test) counts this process vouches for, by user: the server, every user's."""
        return {user: (len(u.train_y), len(u.test_y)) for user, u in enumerate(users)} if rank == 0 else {}


class OwnData(OwnDataRounds):
    """Each user's data with its own silo alone (data-owner mode): silo rank r holds user r - 1;
    the server holds none, and each silo announces its counts, keeps its user's DP-SGD account
    and reports it."""

    label = ", data-owner mode"
    server_measures = False  # the server holds no data: the silos evaluate on their own

    def users_of(self, config: Config, dataset: list, rank: int, device: Any) -> Tuple[List[UserSplit], list]:
        """A silo's own user (the dataset keyed by its id alone); none for the server, whatever the
        dataset it was handed: it reads no data."""
        if rank == 0:
            if dataset and isinstance(dataset[5], dict) and dataset[5]:
                logger.info(
                    "comm_args.silo_data='own': the server does not read the %d clients of the dataset it "
                    "was handed; the silos evaluate on their own data",
                    len(dataset[5]),
                )
            return [], dataset
        user, dataset = own_user_from_fedml_dataset(dataset, rank - 1, device)
        return [user], dataset

    def check_data(self, config: Config, users: List[UserSplit], rank: int) -> None:
        """A silo's batches fit its own user's data."""
        if users:
            check_batch_sizes(config, len(users[0].train_y), f"silo rank {rank}'s training data")

    def announces_problems(self, is_server: bool) -> bool:
        """A silo announces a problem with its data (the server refuses it, naming it, and the run
        goes on without it, or stops, by the same rule as for any silo it refuses)."""
        return not is_server

    def server_privacy(self, config: Config, algorithm: FederatedAlgorithm, users: List[UserSplit]) -> PrivacyRecord:
        """The server's record of DP-SGD: what each data owner's silo reports of its own user."""
        assert config.privacy is not None
        return ReportedPrivacy(config.privacy)

    def silo_privacy(
        self, config: Config, algorithm: FederatedAlgorithm, rank: int, users: List[UserSplit], run: SiloRun
    ) -> SiloPrivacy:
        """A silo's accountant of its own user (its organization's account of the data, which spans
        runs), and why it cannot take part (the budget), or None. With DP-SGD or secure aggregation
        its minibatches are keyed by a secret of this run's (:func:`key_training_draws`)."""
        if rank == 0 or not users:
            return SiloPrivacy()
        if config.privacy is None:
            if not config.secagg.enable_secagg:
                return SiloPrivacy()
            secret = this_runs_secret(run.run_dir, rank, run.identity())
            key_training_draws(algorithm, rank - 1, secret)
            return SiloPrivacy(run_secret=secret)
        ledger, problem, account = own_account(config, algorithm, run.run_dir, rank, users[0], run.identity())
        return SiloPrivacy(ledger, problem, account, account.run_secret)

    def vouched_counts(self, users: List[UserSplit], rank: int) -> Dict[int, Tuple[int, int]]:
        """The (train, test) counts this process vouches for, by user: a silo, its own user's."""
        return {rank - 1: (len(users[0].train_y), len(users[0].test_y))} if rank > 0 else {}


SHARED: DataMode = SharedData()
OWN: DataMode = OwnData()


def data_mode(config: Config) -> DataMode:
    """The run's data mode: data-owner mode across silos with ``comm_args.silo_data: own``."""
    return OWN if config.own_data else SHARED
