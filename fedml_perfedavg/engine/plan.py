"""How a round's clients are computed: one plan, resolved once when a run starts and logged.

It is read from what the algorithm declares (its ``standard_update``, ``returns_whole_state``,
``keeps_client_state``, ``batch_roles``) and what the probe found the model allows
(:mod:`~fedml_perfedavg.algorithms.model_probe`), never from a round's error:

- ``hand-batched``: the standard maths on a chain of Linear layers and activations, every client
  of a computation at once by matrix products (:mod:`~fedml_perfedavg.core.hand_batched`);
- ``DP-SGD chain``: the same chain under DP-SGD, each sample's gradient clipped by its
  outer-product norm (:mod:`~fedml_perfedavg.core.private_steps`);
- ``vmap``: the algorithm's client step (:mod:`~fedml_perfedavg.algorithms.client_step`: its
  ``local_update``, with figures or not, or ``local_training``) vmapped over the clients;
- ``per client``: ``client_update``, one client at a time, as FedML's loops call it: the same
  client step, run for one client.

The batched engine (:mod:`.batched`) builds its step from the plan and calls nothing else to
decide; the minibatches (:mod:`.minibatches`) gather the roles the plan reads. The plan's log
line also says how the evaluation computes users and which gradient oracle the client maths
uses: decisions of the model probe (``ModelPaths``), which every backend reads, not only this engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import FrozenSet, Optional, Tuple

from ..algorithms.base import FederatedAlgorithm
from ..algorithms.client_step import ClientStep, choose_client_step
from ..core.client_maths import LocalUpdateConfig
from ..core.hand_batched import HandBatchedGradients


class Path(str, Enum):
    HAND_BATCHED = "hand-batched"
    PRIVATE_CHAIN = "DP-SGD chain"
    VMAP = "vmap"
    PER_CLIENT = "per client"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class ClientPlan:
    """How the engine computes a round's clients, and why (the line logged at the start)."""

    path: Path
    why: str
    #: Each client sends back its whole state (parameters and buffers), not its parameters alone.
    whole_state: bool
    #: The minibatches of LocalBatches (0: x, y; 1: second_*; 2: third_*) the client maths
    #: reads; only these are gathered.
    roles_read: FrozenSet[int]
    #: The minibatches are the algorithm's keyed draws, which an engine may gather for every client at once.
    gathers_keyed_batches: bool
    hand_batched: Optional[HandBatchedGradients] = field(default=None, compare=False, repr=False)
    #: The client step the engine runs, vmapped (``vmap``) or for one client at a time through
    #: ``client_update`` (``per client``: the algorithm's own); None where a kernel of the engine's
    #: computes the standard maths (``hand-batched``, ``DP-SGD chain``).
    step: Optional[ClientStep] = field(default=None, compare=False)
    #: The clients' training figures come with a computation's results (the engine's kernels and
    #: the vmapped step; the per-client path records them in ``client_update``, by its step).
    records_figures: bool = False
    #: How the evaluation computes users, and the client maths' gradient oracle: the model probe's
    #: decisions (ModelPaths), which every backend reads; here so the one logged line says them all.
    evaluation: str = ""
    gradients: str = ""

    def describe(self) -> str:
        """The plan as the engine logs it."""
        step = "" if self.step is None else f"; client step: {self.step.kind}"
        return f"{self.why}{step}; evaluation: {self.evaluation}; client maths: {self.gradients}"

    @property
    def together(self) -> bool:
        """Whether a computation trains several clients at once."""
        return self.path is not Path.PER_CLIENT


def batchable_maths(algorithm: FederatedAlgorithm) -> Optional[LocalUpdateConfig]:
    """The algorithm's standard update (``algorithm.standard_update``) where this engine may also
    batch it its own way (hand-batched, vmapped on the parameters alone): no state of the client's
    own, no DP-SGD (whose chain is its own path); else None."""
    if algorithm.returns_whole_state or algorithm.keeps_client_state or algorithm.settings.privacy is not None:
        return None
    return algorithm.standard_update


def roles_read(algorithm: FederatedAlgorithm) -> FrozenSet[int]:
    """The minibatches the client maths reads: D alone for FedAvg's update, D and D' for FO, all
    three for HF and exact; an algorithm with maths of its own what it declares (all three unless
    it says otherwise)."""
    standard = batchable_maths(algorithm)
    if standard is None:
        return frozenset(type(algorithm).batch_roles)
    return frozenset(range(standard.step.batch_roles))


def gathers_keyed_batches(algorithm: FederatedAlgorithm) -> bool:
    """Whether the minibatches are the base class's keyed draws (an engine gathers every client's
    at once by ``batch_indices``): not with minibatches of the algorithm's own or DP-SGD's."""
    return type(algorithm).client_batches is FederatedAlgorithm.client_batches and algorithm.settings.privacy is None


def resolve_plan(
    algorithm: FederatedAlgorithm,
    input_shape: Optional[Tuple[int, ...]],
    compile_local_update: bool = False,
    try_hand_batched: bool = True,
    record_training: bool = True,
) -> ClientPlan:
    """The plan for ``algorithm``'s clients on samples of ``input_shape`` (after the model's
    probe); ``record_training=False`` leaves the training figures out of a computation's results
    (what recording them costs, benchmarks)."""
    paths = algorithm.paths
    reads, gathers = roles_read(algorithm), gathers_keyed_batches(algorithm)

    evaluation = paths.evaluation_path(input_shape)
    oracle = paths.gradients_path() if algorithm.standard_update is not None else "the algorithm's own"

    def plan(path: Path, why: str, hand_batched: Optional[HandBatchedGradients] = None) -> ClientPlan:
        whole = algorithm.returns_whole_state
        together = path is not Path.PER_CLIENT
        figures = together and record_training and algorithm.reports_training and not whole
        if path is Path.PER_CLIENT:
            step: Optional[ClientStep] = algorithm.client_step
        elif path is Path.VMAP:
            step = choose_client_step(algorithm, record_figures=figures)
        else:
            step = None
        return ClientPlan(
            path, why, whole, reads, gathers, hand_batched, step, figures, evaluation=evaluation, gradients=oracle
        )

    if algorithm.keeps_client_state:
        return plan(Path.PER_CLIENT, "clients one by one (each keeps a state of its own)")
    if algorithm.settings.privacy is not None:
        standard = algorithm.standard_update
        assert standard is not None  # DP-SGD runs only the standard maths (checked when the algorithm is built)
        chain = paths.private_chain(input_shape)
        if chain is None:
            why = "DP-SGD: clients one by one, per-sample gradients by torch.func"
            return plan(Path.PER_CLIENT, why)
        why = (
            f"DP-SGD: {type(algorithm.network).__name__} is a chain of Linear layers; each sample's gradient is "
            f"clipped by its outer-product norm, every client of a round at once (fedml_perfedavg.core.private_steps)"
            + ("; compiled (torch.compile)" if compile_local_update else "")
        )
        return plan(Path.PRIVATE_CHAIN, why, hand_batched=chain)
    gradients, no_hand = _hand_batched(algorithm, input_shape, try_hand_batched)
    if paths.vmappable and gradients is None and not paths.groups_exactly:
        why = (
            "clients one by one (vmapped, a client's result would depend on which clients share its "
            "computation; see the model probe's warning)"
        )
        return plan(Path.PER_CLIENT, why)
    if not paths.vmappable:
        return plan(Path.PER_CLIENT, "clients one by one (the model cannot be vmapped)")
    if gradients is not None:
        why = (
            f"{type(algorithm.network).__name__} is a chain of Linear layers and activations; its clients' "
            f"gradients are hand-batched matrix products (fedml_perfedavg.core.hand_batched)"
            + ("; each local step compiled (fedml_perfedavg.core.compiled_update)" if compile_local_update else "")
        )
        return plan(Path.HAND_BATCHED, why, hand_batched=gradients)
    why = f"the clients' updates vmapped with torch.func (hand-batched gradients do not apply: {no_hand})"
    return plan(Path.VMAP, why + ("; compiled whole (torch.compile)" if compile_local_update else ""))


def _hand_batched(
    algorithm: FederatedAlgorithm, input_shape: Optional[Tuple[int, ...]], allowed: bool
) -> Tuple[Optional[HandBatchedGradients], str]:
    """Hand-batched gradients where they compute exactly what the algorithm's own update would
    (Per-FedAvg's or FedAvg's update on a Linear chain), else why not. Compiled or not: the
    engine compiles the chain's own step where it compiles (core/compiled_update.py)."""
    if not allowed:
        return None, "turned off"
    if batchable_maths(algorithm) is None:
        return None, f"{type(algorithm).__name__}'s client maths is its own (not core.client_maths')"
    if input_shape is None:
        return None, "no users"
    return algorithm.paths.hand_batched(input_shape)
