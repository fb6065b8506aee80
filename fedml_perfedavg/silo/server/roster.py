"""The cross-silo server's view of its silos, apart from the phases that drive them (server.py):
which silos still take part, which announced themselves (what, and from which process), which
users each round gives them, and what the server knows of each one's data. What a silo says of
itself or of its users is checked here against that knowledge, never taken from the message."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from .agreement import ServerSetup, disagreement
from .modes import Assignment


class SiloRoster:
    """The silos of a run (``setup.silos``) and what is known of each."""

    def __init__(self, setup: ServerSetup) -> None:
        self.setup = setup
        self.mode = setup.mode
        self.live: List[int] = list(setup.silos)  # not given up on, in rank order
        self.online: Set[int] = set()  # announced themselves before training started
        self.hellos: Dict[int, Dict[str, Any]] = {}  # silo -> what it announced
        self.sessions: Dict[int, Optional[str]] = {}  # silo -> its process's session
        self.refused: Set[int] = set()  # told why and ended; nothing more is sent to them
        self.told_left_out: Set[int] = set()  # given up on, and told so once (see left_out_notice)
        # Called with the silos of each drop: what they owed the open round or evaluation is dropped
        # there (server.py's rounds), whichever way they left.
        self.on_drop: List[Callable[[Sequence[int]], None]] = []

    def all_online(self) -> bool:
        return all(s in self.online for s in self.live)

    def drop(self, silos: Sequence[int]) -> None:
        """Give up on ``silos``: they take no further part unless they announce themselves again."""
        self.live = [s for s in self.live if s not in silos]
        for listener in self.on_drop:
            listener(silos)

    def take_back(self, silo: int) -> None:
        self.live = [s for s in self.setup.silos if s in self.live or s == silo]
        self.told_left_out.discard(silo)

    def refuse(self, silo: int) -> None:
        """``silo`` was refused and told why: it has ended, and takes no further part."""
        self.refused.add(silo)
        self.drop([silo])

    def is_given_up(self, silo: int) -> bool:
        """Heard from, then given up on (not refused): it may still be running and waiting for
        the server, so it too is told when the run ends."""
        return silo in self.hellos and silo not in self.live and silo not in self.refused

    def given_up(self) -> List[int]:
        return [s for s in self.setup.silos if self.is_given_up(s)]

    def left_out_notice(self, silo: int) -> bool:
        """True the first time a silo given up on sends work (it does not know it is out): it is
        then told to announce itself again. Once per giving up, so a silo that keeps sending
        cannot make the server send for it in every round."""
        if not self.is_given_up(silo) or silo in self.told_left_out:
            return False
        self.told_left_out.add(silo)
        return True

    def greet(self, silo: int, announced: Dict[str, Any], session: Optional[str]) -> bool:
        """Note an accepted announcement; True if it came from a new process of a silo seen before."""
        restarted = silo in self.sessions and self.sessions[silo] != session
        self.refused.discard(silo)
        self.sessions[silo] = session
        self.hellos[silo] = announced
        return restarted

    def problem_with(self, silo: int, announced: Optional[Dict[str, Any]]) -> Optional[str]:
        """Why a silo's announcement is refused (see :mod:`.agreement`), or None."""
        problem = self.fingerprint_problem(silo, announced)
        if problem is not None or announced is None:
            return problem
        return self.mode.announcement_problem(self.setup, silo, announced)

    def fingerprint_problem(self, silo: int, announced: Any) -> Optional[str]:
        """Why ``announced`` does not agree with the server's fingerprint, or None. It reads only
        the setup, so the transport calls it from gRPC's threads to answer the announcement's send
        (:attr:`.transport.SecureGRPCCommManager.screen_announcement`)."""
        if not isinstance(announced, dict) or not isinstance(announced.get("fingerprint"), dict):
            return f"silo rank {silo} announced no fingerprint: it does not run this version of the plugin"
        return disagreement(self.setup.fingerprint, announced["fingerprint"], silo)

    def assignment(self, users: Sequence[int]) -> Tuple[List[int], Assignment]:
        """(the round's silos, live silo -> (position, user)) for the round's sampled ``users``: in
        shared mode the k-th silo trains the k-th user; in data-owner mode each user's own silo."""
        return self.mode.assignment(self.setup.silos, self.live, users)

    def counts_of(self, silo: int, user: int) -> Tuple[int, int]:
        """(training, test) samples of ``user``, as the server knows them: its own data in shared
        mode, the silo's announcement in data-owner mode."""
        return self.mode.counts_of(self.setup, self.hellos, silo, user)

    def figures_problem(self, silo: int, counts: Dict[str, Any], user: int, round_idx: int) -> Optional[str]:
        """Why a silo's reported counts cannot be its evaluation of ``user`` after ``round_idx``
        (the wire already checked they are whole, finite and consistent), or None."""
        if counts["round"] != round_idx or counts["user"] != user:
            return (
                f"silo rank {silo} reported round {counts['round']}, user {counts['user']}; it was asked for "
                f"round {round_idx}, user {user}"
            )
        test = self.counts_of(silo, user)[1]
        if counts["total"] != test:
            return f"silo rank {silo} reported {counts['total']} test samples for user {user}, who has {test}"
        own = sorted(counts.get("own", {}))
        if own != sorted(self.setup.metric_names):
            return (
                f"silo rank {silo} reported the figures {own} of its own; the run's algorithm reports "
                f"{sorted(self.setup.metric_names)}"
            )
        return None


def silo_accuracies(reported: Dict[int, Dict[str, Any]]) -> Tuple[float, Dict[int, Dict[str, Any]]]:
    """(their mean, silo -> round, user and accuracies) of the silos' own evaluations (shared mode)."""
    from ...core.evaluation import accuracy_of

    entries = {
        silo: {
            "round": c["round"],
            "user": c["user"],
            "accuracy": accuracy_of(c["correct"], c["total"]),
            "accuracy_before_adaptation": accuracy_of(c["correct_before"], c["total"]),
            **c.get("own", {}),
        }
        for silo, c in sorted(reported.items())
    }
    return sum(e["accuracy"] for e in entries.values()) / len(entries), entries
