"""Batched single-process simulation: a round's sampled clients train as one computation.

All clients start from the same w (no copies), their minibatches gathered from tensors put on the
device once (:mod:`.minibatches`). How they are computed is probed once per run and logged
(:mod:`~fedml_perfedavg.algorithms.model_probe`): a chain of Linear layers and activations by
hand-batched matrix products (:mod:`~fedml_perfedavg.core.hand_batched`; under DP-SGD its per-sample
form); any other model vmapped over the clients (``torch.func``) where the probe found that this
gives each client the bits it gets alone, else client by client (vmap's batched kernels would make
a client's result depend on which clients share its computation). Sampling, minibatches,
aggregation and evaluation are the algorithm's own, as on FedML's per-client loops, so both give
the same model (``benchmarks/bit_identity.py``)."""

from __future__ import annotations

import dataclasses
import logging
from collections import OrderedDict
from typing import Callable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor
from torch.func import vmap

from ..algorithms.base import ClientUpdate, FederatedAlgorithm
from ..core.adaptive_clipping import STATE_KEY
from ..core.client_maths import LocalBatches, StepFigures, mean_figures, run_steps
from ..core.compiled_update import CompiledLocalUpdate
from ..core.private_draws import PrivateBatches
from ..core.private_steps import PrivateChainSteps
from .captured import CapturedTraining
from ..core.hand_batched import IndexedInputs, HandBatchedGradients
from .minibatches import Minibatches
from .plan import ClientPlan, Path, resolve_plan
from ..core.types import Params, StateDict, UserSplit
from ..core.types import RoundDriver

logger = logging.getLogger(__name__)

#: A computation's result: the clients' stacked states, and their training figures (C, 2) or None.
Trained = Tuple[Params, Optional[Tensor]]


def _without_figures(step: Callable[[Params, LocalBatches], Params]) -> Callable[[Params, LocalBatches], Trained]:
    """A step whose clients' training figures are not recorded (DP-SGD; an algorithm's own maths)."""

    def trained(params: Params, batches: LocalBatches) -> Trained:
        return step(params, batches), None

    return trained


class BatchedSimulation:
    """The round loop of the batched engine over an algorithm object and a round driver."""

    #: A round with more clients trains in computations of this many: every client's minibatches
    #: and parameters are live at once within one, so larger rounds would only add memory traffic
    #: (benchmarks/RESULTS.md, "Scale": 1000 clients took 19.3 s at once, 9.4 s in computations of 32).
    clients_per_computation: int = 32

    def __init__(
        self,
        algorithm: FederatedAlgorithm,
        users: Sequence[UserSplit],
        global_state: StateDict,
        driver: RoundDriver,
        compile_local_update: bool = False,
        try_hand_batched: bool = True,
        record_training: bool = True,
        capture_rounds: bool = False,
    ) -> None:
        self.algorithm = algorithm
        self.users = users
        self.state: StateDict = OrderedDict(global_state)
        self.driver = driver
        input_shape = tuple(users[0].train_x.shape[1:]) if users else None
        #: How the clients are computed, resolved once (engine/plan.py), not by a round's error.
        self.plan = resolve_plan(algorithm, input_shape, compile_local_update, try_hand_batched, record_training)
        logger.info("batched engine: %s", self.plan.describe())
        self.batched = self.plan.together
        self.whole_state = self.plan.whole_state
        self.hand_batched: Optional[HandBatchedGradients] = (
            self.plan.hand_batched if self.plan.path is Path.HAND_BATCHED else None
        )
        #: Whether the clients' training figures come with a computation's results (the algorithm's
        #: record keeps them); ``record_training=False`` leaves them out (what recording costs, benchmarks).
        self.reports_training = self.plan.records_figures
        #: The DP-SGD chain's clients' adaptive clip bounds after the last computation (clients, roles).
        self.clip_bounds_after: Optional[Tensor] = None
        #: What trains a computation's clients together; None on the per-client path (client_update).
        self.step: Optional[Callable[[Params, LocalBatches], Trained]] = self._step_of(self.plan)
        #: Whether the step gathers its inputs as it reaches them (the hand-batched local update,
        #: compiled a step at a time or not, and DP-SGD's chain do; a step compiled whole is handed tensors).
        self.gathers_lazily = self.hand_batched is not None or (
            self.plan.path is Path.PRIVATE_CHAIN and not compile_local_update
        )
        #: The hand-batched path's local update compiled one step at a time, or None (eager).
        self.compiled_update: Optional[CompiledLocalUpdate] = None
        if compile_local_update and self.step is not None:
            # The round is thousands of tiny kernels: on a GPU, CUDA graphs ("reduce-overhead")
            # replay them without per-kernel launch cost. Shapes are the same every round.
            on_cuda = next(iter(global_state.values())).is_cuda
            mode = "reduce-overhead" if on_cuda else "default"
            if self.hand_batched is not None:  # a Linear chain: its own step, compiled (core/compiled_update.py)
                assert algorithm.standard_update is not None  # the hand-batched path computes the standard maths
                self.compiled_update = CompiledLocalUpdate(self.hand_batched, algorithm.standard_update, mode)
            else:
                self.step = torch.compile(self.step, mode=mode, dynamic=False)
        elif compile_local_update:  # said, not silently ignored: nothing of these clients' maths is compiled
            logger.warning("device_args.compile_local_update=True compiles nothing here: %s", self.plan.why)
        self.minibatches = Minibatches(algorithm, users, self.plan)
        self.sample_counts = self.minibatches.sample_counts
        #: The round's local training as one CUDA graph (uncaptured off CUDA), or None (eager).
        self.captured: Optional[CapturedTraining] = None
        if capture_rounds:
            why_not = self._why_not_captured()
            device = next(iter(global_state.values())).device
            if why_not is not None:  # said, not silently ignored
                logger.warning("device_args.capture_rounds=True captures nothing here: %s", why_not)
            else:
                self.captured = CapturedTraining(self._indexed_step, device)
                if device.type != "cuda":
                    logger.warning(
                        "device_args.capture_rounds=True: CUDA graphs need a CUDA device; on %s the "
                        "same steps run uncaptured",
                        device,
                    )

    def _why_not_captured(self) -> Optional[str]:
        """Why this run's rounds cannot be captured as one graph, or None: the graph holds the
        hand-batched local update over the keyed draws' gathers, nothing that decides on the host."""
        if self.hand_batched is None:
            return f"only the hand-batched path is captured ({self.plan.why})"
        if self.compiled_update is not None:
            return "the local update is compiled (device_args.compile_local_update)"
        if not self.minibatches.gathers:
            return "the minibatches are not the keyed draws gathered for every client at once"
        if self.algorithm.hooks.poisons_labels:
            return "a label-flipping attack maps each client's labels on the host"
        return None

    def _indexed_step(self, params: Params, index: List[Tensor]) -> Trained:
        """The hand-batched step on the minibatches at ``index`` (the captured function)."""
        assert self.step is not None
        return self.step(params, self.minibatches.gather(index, lazy_inputs=True))

    def _step_of(self, plan: ClientPlan) -> Optional[Callable[[Params, LocalBatches], Trained]]:
        """The function that trains a computation's clients together, as ``plan`` says (the
        per-client path has none: it calls ``client_update``, whose step may keep a state of the
        client's own or run DP-SGD per sample): their stacked results, and their training figures
        (C, 2) where the engine records them."""
        if plan.path is Path.PER_CLIENT:
            return None
        if plan.path is Path.HAND_BATCHED:
            return self._hand_batched_step()
        if plan.path is Path.PRIVATE_CHAIN:
            return _without_figures(self._private_chain_step(plan))
        # The plan's client step (the one client_update runs, figures or not), vmapped; an algorithm
        # whose clients send back more than parameters (its own local_training) over whole states.
        step = plan.step
        assert step is not None and step.whole_state == plan.whole_state
        together = vmap(step.pure, in_dims=(None, 0))
        return together if step.records_figures else _without_figures(together)

    def _private_chain_step(self, plan: ClientPlan) -> Callable[[Params, LocalBatches], Params]:
        """DP-SGD on a Linear chain: every client of the computation at once (:class:`PrivateChainSteps`,
        no per-sample gradient formed)."""
        local, privacy, chain = self.algorithm.standard_update, self.algorithm.settings.privacy, plan.hand_batched
        assert local is not None and privacy is not None and chain is not None

        def step(params: Params, batches: LocalBatches) -> Params:
            assert isinstance(batches, PrivateBatches)
            clients = batches.mask.shape[0]
            start = {k: v.unsqueeze(0).expand(clients, *v.shape) for k, v in params.items()}
            config = dataclasses.replace(local, local_steps=batches.mask.shape[2])
            steps = PrivateChainSteps(chain, batches, local.step, privacy)
            trained = run_steps(steps, start, config)
            self.clip_bounds_after = steps.bounds
            return trained

        return step

    def _hand_batched_step(self) -> Callable[[Params, LocalBatches], Trained]:
        def step(params: Params, batches: LocalBatches) -> Trained:
            clients = batches.y.shape[0]
            start = {k: v.unsqueeze(0).expand(clients, *v.shape) for k, v in params.items()}
            figures: Optional[List[StepFigures]] = [] if self.reports_training else None
            trained = self.train_from(start, batches, figures)
            return trained, None if figures is None else mean_figures(figures)

        return step

    def train_from(self, start: Params, batches: LocalBatches, figures: Optional[List[StepFigures]] = None) -> Params:
        """Hand-batched path: every client's local update from its own starting parameters
        (``start`` and ``batches`` have the client first; inputs may be :class:`IndexedInputs`,
        which are step first), e.g. the clients of several runs; ``figures``: each step's (C, 2)
        training figures are appended."""
        by_step = LocalBatches(
            *(
                t if isinstance(t, IndexedInputs) else t.transpose(0, 1)  # (steps, clients, ...)
                for t in batches
            )
        )
        if self.compiled_update is not None:
            return self.compiled_update(start, by_step, figures)
        standard = self.algorithm.standard_update
        assert self.hand_batched is not None and standard is not None  # taken only for the standard maths
        return self.hand_batched.local_update(start, by_step, standard, figures)

    def _batched_updates(self, round_idx: int, clients: List[int]) -> List[ClientUpdate]:
        # an algorithm whose clients send back whole states trains from the whole state
        start = self.state if self.whole_state else self.algorithm.split_state(self.state)[0]
        assert self.step is not None  # a computation of several clients (plan.together)
        with torch.no_grad():
            params = {k: v.detach() for k, v in start.items()}
            if self.captured is not None:
                stacked, figures = self.captured(params, self.minibatches.batch_index(round_idx, clients))
            else:
                lazy_inputs = self.batched and self.gathers_lazily
                stacked, figures = self.step(params, self.minibatches.round_batches(round_idx, clients, lazy_inputs))
        bounds, self.clip_bounds_after = self.clip_bounds_after, None
        # each client keeps its adaptive bounds (core/adaptive_clipping.py)
        own = None if bounds is None else [{STATE_KEY: bounds[position]} for position in range(len(clients))]
        samples = [self.sample_counts[c] for c in clients]
        return self.algorithm.finish_clients(round_idx, clients, samples, stacked, self.state, figures, own)

    def finish_round(self, round_idx: int, updates: Sequence[tuple], clients: Optional[List[int]] = None) -> None:
        """Aggregate the round's updates (of ``clients``, for the record) and hand the new global
        model to the driver."""
        labels = None if clients is None else [f"user {c}" for c in clients]
        self.state = self.algorithm.aggregate(round_idx, updates, self.state, labels)
        self.driver.round_finished(round_idx, self.state)

    def _per_client_updates(self, round_idx: int, clients: List[int]) -> List[tuple]:
        return [
            tuple(self.algorithm.client_update(round_idx, c, self.state, self.users[c].train_x, self.users[c].train_y))
            for c in clients
        ]

    def train_clients(self, round_idx: int, clients: List[int], global_state: StateDict) -> List[tuple]:
        """(samples, state) of each of ``clients`` after round ``round_idx``'s local training from
        ``global_state``: one computation where vmap allows (an MPI worker trains its share so)."""
        self.state = OrderedDict(global_state)
        if not self.batched:
            return self._per_client_updates(round_idx, clients)
        updates: List[tuple] = []
        for start in range(0, len(clients), self.clients_per_computation):
            updates += self._batched_updates(round_idx, clients[start : start + self.clients_per_computation])
        return updates

    def train_round(self, round_idx: int) -> List[int]:
        """One round: sample, train the sampled clients (together where vmap allows),
        aggregate, report. Returns the round's clients."""
        clients = self.driver.sample_clients(round_idx)
        self.finish_round(round_idx, self.train_clients(round_idx, clients, self.state), clients)
        return clients

    def run(self, start_round: int, rounds: int) -> StateDict:
        """Rounds ``start_round`` .. ``rounds - 1``; returns the final global state."""
        try:
            for round_idx in range(start_round, rounds):
                self.train_round(round_idx)
        finally:  # what is kept from round to round is not kept past the run (a grid holds many)
            self.minibatches.release_buffers()
        return self.state
