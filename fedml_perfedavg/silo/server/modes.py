"""Where a cross-silo run's data lives, as a strategy of the server's protocol rather than a flag
branched on: which silo trains which sampled user, whose counts the server checks an upload
against, who evaluates, and how the last round ends. These are the protocol's half of the run's
one data-mode strategy: the run layer's (``run/data_modes.py``) extends each with how a process
loads and accounts for its data, and hands its instance to the bridge in the run's setup
(``agreement.ServerSetup.mode``, ``SiloSetup.mode``); the bridge never builds one of its own.

- :class:`SharedDataRounds` (``comm_args.silo_data: shared``): every silo reads the whole split; the
  k-th silo trains the round's k-th sampled user, the server knows every user's counts, each silo
  evaluates the model it received with its update, and the run ends with the final model sent to
  every silo, which evaluates it and says goodbye.
- :class:`OwnDataRounds` (``silo_data: own``): silo rank R holds user R-1's data and nothing else; the
  sampled users' own silos train, the counts are those the silo announced (checked against its
  data's fit to the model), every live silo evaluates each evaluation round's model, and the run
  ends when the last round is recorded.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

Assignment = Dict[int, Tuple[int, int]]  # silo -> (position in the round's sample, user)


class SharedDataRounds:
    """Every silo reads the whole split (the server holds every user's counts)."""

    name = "shared"
    own_data = False

    def start_problem(self, silos: Sequence[int], client_num_per_round: int) -> Optional[str]:
        if len(silos) != client_num_per_round:
            return (
                f"train_args.client_num_per_round={client_num_per_round!r}: must equal the number of silos "
                f"({len(silos)}): each silo trains one sampled user per round"
            )
        return None

    def announcement_problem(self, setup: Any, silo: int, announced: Dict[str, Any]) -> Optional[str]:
        return None  # the fingerprint is all a shared-mode silo announces

    def assignment(
        self, silos: Sequence[int], live: Sequence[int], users: Sequence[int]
    ) -> Tuple[List[int], Assignment]:
        """The k-th silo trains the k-th sampled user; every live silo takes part."""
        assigned = {s: (list(silos).index(s), int(users[list(silos).index(s)])) for s in live}
        return list(live), assigned

    def counts_of(self, setup: Any, hellos: Dict[int, Dict[str, Any]], silo: int, user: int) -> Tuple[int, int]:
        return setup.user_counts[user]

    def silos_evaluate(self, evaluates: bool) -> bool:
        return False  # a shared-mode silo evaluates the model it receives, with its update

    figures_with_updates = True
    ends_with_final_model = True

    def own_user(self, rank: int) -> Optional[int]:
        return None  # a shared-mode silo trains whichever user the server names


class OwnDataRounds:
    """Silo rank R holds user R-1's data only; the server holds none."""

    name = "own"
    own_data = True

    def start_problem(self, silos: Sequence[int], client_num_per_round: int) -> Optional[str]:
        return None

    def announcement_problem(self, setup: Any, silo: int, announced: Dict[str, Any]) -> Optional[str]:
        from .agreement import data_problem

        if announced["problem"] is not None:
            return f"silo rank {silo} cannot train on its own data: {announced['problem']}"
        if announced["user"] != silo - 1 or announced["train"] is None:
            return (
                f"silo rank {silo} announced user {announced['user']}'s data; in data-owner mode rank R holds "
                f"user R-1's"
            )
        assert setup.model is not None  # a data-owner run's server holds its model
        return data_problem(setup.model, announced, silo)

    def assignment(
        self, silos: Sequence[int], live: Sequence[int], users: Sequence[int]
    ) -> Tuple[List[int], Assignment]:
        """Each sampled user's own silo; an offline one is expected and missing."""
        expected = [int(u) + 1 for u in users]
        assigned = {int(u) + 1: (p, int(u)) for p, u in enumerate(users)}
        return expected, {s: pu for s, pu in assigned.items() if s in live}

    def counts_of(self, setup: Any, hellos: Dict[int, Dict[str, Any]], silo: int, user: int) -> Tuple[int, int]:
        announced = hellos[silo]
        return announced["train"], announced["test"]

    def silos_evaluate(self, evaluates: bool) -> bool:
        return evaluates  # the run's evaluation rounds, on every live silo's own data

    figures_with_updates = False
    ends_with_final_model = False

    def own_user(self, rank: int) -> Optional[int]:
        return rank - 1  # and no other


DataMode = Any  # SharedDataRounds | OwnDataRounds (or the run layer's, which extend them)
