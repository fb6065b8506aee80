"""DP-SGD's draws for one client's round, outside the maths: its Poisson minibatches (each
sample in a use's minibatch with probability ``batch_size / n``, independently) and the noise of
every use, from one generator keyed by (seed, round, user) (and a data owner's secret), so every
backend computes the same numbers (core/privacy.py has the policy; core/private_steps.py the
mechanism that reads these). FedML-free."""

from __future__ import annotations

import math
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor

from .privacy import sample_rate
from .types import Params, gather_inputs, input_dtype, model_inputs


class PrivateBatches(NamedTuple):
    """One client's Poisson minibatches (roles, steps, cap): D, D', D'' padded to a common size
    ``cap`` with samples whose ``mask`` is 0, the noise of every use (each parameter's shape with
    (roles, steps) first, standard normal) and the expected size of each role's minibatch."""

    #: The inputs; a round's for the chain's mechanism may be :class:`PrivateInputs`, not gathered.
    x: Union[Tensor, "PrivateInputs"]
    y: Tensor
    mask: Tensor
    noise: Dict[str, Tensor]
    expected: Tensor
    #: With adaptive clipping: the noise of each use's count (roles, steps), standard normal, and
    #: the client's bounds at the start (roles,) (core/adaptive_clipping.py); else None.
    count_noise: Optional[Tensor] = None
    clip_bounds: Optional[Tensor] = None

    @property
    def steps(self) -> int:
        return int(self.mask.shape[1])

    def gathered_x(self) -> Tensor:
        """The inputs as a tensor, gathered now where they were not."""
        return self.x.gathered() if isinstance(self.x, PrivateInputs) else self.x


class PrivateInputs(NamedTuple):
    """A round's DP-SGD inputs not yet gathered: client c's minibatch of use (role, t) is
    ``data[c][rows[c, role, t]]`` (padded as :class:`PrivateBatches`' are). The chain's mechanism
    gathers each use's just before it computes it, into one buffer, so a round's 50 MB of inputs
    are read from cache rather than written to memory and read back."""

    data: Sequence[Tensor]
    rows: Tensor  # (clients, roles, steps, cap)
    #: Each client's samples' squared input norms (:func:`squared_norms`), where they are known
    #: to be the bits the chain would compute on a use's inputs; else None.
    squared_norms: Optional[Sequence[Tensor]] = None

    @property
    def shape(self) -> Tuple[int, ...]:
        """That of the gathered tensor, (clients, roles, steps, cap, ...)."""
        return (*self.rows.shape, *self.data[0].shape[1:])

    def use(self, role: int, t: int, buffer: Optional[Tensor] = None) -> Tensor:
        """Use (role, t)'s inputs of every client, (clients, cap, ...), into ``buffer`` where given."""
        return _rows_of(self.data, self.rows[:, role, t], buffer)

    def use_norms(self, role: int, t: int) -> Optional[Tensor]:
        """Use (role, t)'s samples' squared input norms (clients, cap), or None where not known."""
        return None if self.squared_norms is None else _rows_of(self.squared_norms, self.rows[:, role, t])

    def gathered(self) -> Tensor:
        """Every use's inputs, as :class:`PrivateBatches` holds them gathered."""
        roles, steps = self.rows.shape[1:3]
        return torch.stack([torch.stack([self.use(r, t) for t in range(steps)]) for r in range(roles)]).movedim(2, 0)


def _rows_of(per_client: Sequence[Tensor], rows: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """Client c's ``per_client[c][rows[c]]`` for every client, stacked (into ``out`` where given)."""
    first = per_client[0]
    if out is None:
        out = torch.empty((*rows.shape, *first.shape[1:]), dtype=input_dtype(first), device=first.device)
    for c, source in enumerate(per_client):
        gather_inputs(source, rows[c], out[c])
    return out


def squared_norms(x: Tensor) -> Tensor:
    """Each sample's squared norm over all its features, (samples,)."""
    return model_inputs(x).reshape(len(x), -1).pow(2).sum(-1)


def gathered_norms_are_exact(x: Tensor) -> bool:
    """Whether :func:`squared_norms` of all of ``x`` are, row for row, the bits of the same sum
    over a (clients, batch, features) block of gathered samples (the chain's, a use at a time):
    so a user's norms can be computed once and gathered with its minibatches. Checked on ``x``."""
    count = min(len(x), 64) // 2 * 2
    if x.device.type != "cpu" or count == 0:
        return False
    rows = torch.arange(len(x) - 1, len(x) - 1 - count, -1)
    block = model_inputs(x[rows]).reshape(2, count // 2, -1)
    return torch.equal(block.pow(2).sum(-1).reshape(-1), squared_norms(x)[rows])


def poisson_draw(
    num_samples: int, batch_sizes: Sequence[int], steps: int, generator: torch.Generator
) -> Tuple[Tensor, Tensor, Tensor]:
    """(index, mask, expected): for each role and step, each of ``num_samples`` samples is in
    the minibatch with probability ``sample_rate(batch_size, num_samples)``, independently; the
    chosen indices come first in a row of ``cap`` (the largest minibatch drawn), the rest padding."""
    rates = torch.tensor([sample_rate(b, num_samples) for b in batch_sizes], dtype=torch.float64)
    uniform = torch.rand(len(batch_sizes), steps, num_samples, generator=generator, dtype=torch.float64)
    chosen = uniform < rates.view(-1, 1, 1)
    counts = chosen.sum(-1)
    cap = max(1, int(counts.max()))
    # A stable sort of "not chosen" puts the chosen indices first, in increasing order.
    index = torch.sort((~chosen).to(torch.int8), dim=-1, stable=True).indices[..., :cap]
    mask = (torch.arange(cap).view(1, 1, -1) < counts.unsqueeze(-1)).to(torch.get_default_dtype())
    expected = (rates * num_samples).to(torch.get_default_dtype())
    return index, mask, expected


def draw_private_batches(
    x: Tensor,
    y: Tensor,
    batch_sizes: Sequence[int],
    steps: int,
    params: Params,
    generator: torch.Generator,
    clip_bounds: Optional[Tensor] = None,
) -> PrivateBatches:
    """A client's :class:`PrivateBatches` from its training data, every number from ``generator``
    (the Poisson draws first, then the noise, parameter by parameter in ``params``' order; only
    their shapes and dtypes are read; with adaptive clipping, the client's ``clip_bounds``, then
    the counts' noise last)."""
    index, mask, expected = poisson_draw(len(y), batch_sizes, steps, generator)
    noise = {
        k: torch.randn(len(batch_sizes), steps, *p.shape, generator=generator, dtype=p.dtype).to(x.device)
        for k, p in params.items()
    }
    count_noise = None
    if clip_bounds is not None:
        count_noise = torch.randn(len(batch_sizes), steps, generator=generator, dtype=torch.float64).to(x.device)
        clip_bounds = clip_bounds.to(device=x.device, dtype=torch.float64)
    device_index = index.to(x.device)
    return PrivateBatches(
        model_inputs(x[device_index]),
        y[device_index.to(y.device)],
        mask.to(x.device),
        noise,
        expected.to(x.device),
        count_noise,
        clip_bounds,
    )


def stack_private(batches: Sequence[PrivateBatches]) -> PrivateBatches:
    """Several clients' draws stacked along a new leading client dimension, padded to one cap.
    The inputs and the noise (most of the bytes) are laid out step-major in memory, (roles, steps,
    clients, ...), and seen client-first: the chain's mechanism reads each use's clients as one
    contiguous block without copying them again (core/private_steps.py)."""
    cap = max(b.mask.shape[-1] for b in batches)

    def pad(t: Tensor) -> Tensor:  # with copies of a sample, whose mask is 0
        extra = cap - t.shape[2]
        return t if extra == 0 else torch.cat([t, t[:, :, :1].expand(-1, -1, extra, *t.shape[3:])], dim=2)

    def step_major(tensors: Sequence[Tensor]) -> Tensor:
        return torch.stack(list(tensors), dim=2).movedim(2, 0)

    adaptive = batches[0].clip_bounds is not None
    return PrivateBatches(
        step_major([pad(b.gathered_x()) for b in batches]),
        torch.stack([pad(b.y) for b in batches]),
        torch.stack([torch.nn.functional.pad(b.mask, (0, cap - b.mask.shape[-1])) for b in batches]),
        {k: step_major([b.noise[k] for b in batches]) for k in batches[0].noise},
        torch.stack([b.expected for b in batches]),
        torch.stack([b.count_noise for b in batches]) if adaptive else None,  # type: ignore[misc]
        torch.stack([b.clip_bounds for b in batches]) if adaptive else None,  # type: ignore[misc]
    )


class RoundBuffers:
    """The memory a private round's draws are written into, kept from one round for the next: a
    round's noise and inputs are 130 MB for the paper's round, and fresh memory of that size is
    pages the system must hand over and zero (20-30 ms a round here) before a number is drawn.
    Each name keeps one flat buffer, a little larger than asked (the inputs' size follows the
    round's largest Poisson minibatch), and hands out its beginning, contiguous, in the shape
    asked. It is handed out again only while nothing else holds it: a caller that kept a round's
    draws keeps them intact, and the next round gets new memory."""

    HEADROOM = 1.125

    def __init__(self) -> None:
        self._kept: Dict[str, Tuple[Tensor, int]] = {}

    def empty(self, name: str, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        """An uninitialised CPU tensor of ``shape`` and ``dtype`` in ``name``'s buffer where it
        fits and is free, else in a new one (kept in its place)."""
        size = math.prod(shape)
        kept = self._kept.get(name)
        if kept is not None:
            flat, alone = kept
            if flat.dtype == dtype and flat.numel() >= size and _holders(flat) == alone:
                return flat[:size].view(tuple(shape))
        flat = torch.empty(int(size * self.HEADROOM) + 1, dtype=dtype)
        alone = _holders(flat)
        if alone > 0:  # 0: this torch does not say, so nothing is kept
            self._kept[name] = (flat, alone)
        return flat[:size].view(tuple(shape))


def _holders(tensor: Tensor) -> int:
    """How many references its storage has (tensors and views of it), or 0 where torch's private
    counter is missing."""
    count = getattr(torch._C, "_storage_Use_Count", None)
    return 0 if count is None else int(count(tensor.untyped_storage()._cdata))


# A parameter at least this large has its noise drawn use by use in its place; a smaller one's is
# drawn whole and copied (one call instead of one a use: the calls, not the copy, cost there).
_DRAWN_IN_PLACE = 16384


def draw_private_round(
    data: Sequence[Tuple[Tensor, Tensor]],
    batch_sizes: Sequence[int],
    steps: int,
    params: Params,
    generators: Sequence[torch.Generator],
    clip_bounds: Sequence[Optional[Tensor]],
    each: Callable[[Callable[[int], Any], int], List[Any]],
    buffers: Optional[RoundBuffers] = None,
    lazy_inputs: bool = False,
    input_norms: Optional[Sequence[Tensor]] = None,
) -> PrivateBatches:
    """:func:`stack_private` of each client's :func:`draw_private_batches` (its training ``data``,
    ``generators`` and ``clip_bounds``), the same numbers, drawn into the stacked tensors: no
    client's noise (most of a private round's bytes: 20 million numbers for the paper's round) or
    inputs are copied a second time. A large parameter whose size is a multiple of 16 has its noise
    drawn use by use into its place (torch's normal fill takes 16 numbers at a time from one
    stream, so the blocks are the numbers of one draw); a small one's, or one of another size, is
    drawn whole and copied.
    ``each(fn, count)`` runs ``fn`` for every client position (on threads: each client's draws
    are its own generator's and land in its own slices). ``buffers``: where the noise and inputs
    are written (kept for the next round), else new memory. With ``lazy_inputs`` the inputs are
    :class:`PrivateInputs`, gathered where they are used, with the clients' ``input_norms`` where
    given (:func:`squared_norms`, where :func:`gathered_norms_are_exact`)."""
    clients, roles = len(data), len(batch_sizes)
    x0, y0 = data[0]
    pool = buffers if buffers is not None and x0.device.type == "cpu" else None

    def empty(name: str, shape: Sequence[int], dtype: torch.dtype) -> Tensor:
        return pool.empty(name, shape, dtype) if pool is not None else torch.empty(tuple(shape), dtype=dtype)

    draws = each(lambda c: poisson_draw(len(data[c][1]), batch_sizes, steps, generators[c]), clients)
    cap = max(index.shape[-1] for index, _, _ in draws)
    shape = (roles, steps, clients, cap, *x0.shape[1:])
    x: Optional[Tensor] = None
    rows: Optional[Tensor] = None
    if lazy_inputs:
        rows = torch.empty((clients, roles, steps, cap), dtype=torch.long, device=x0.device)
    else:
        x = empty("x", shape, input_dtype(x0)) if pool is not None else x0.new_empty(shape, dtype=input_dtype(x0))
    y = y0.new_empty((clients, roles, steps, cap))
    mask = torch.zeros((clients, roles, steps, cap), dtype=torch.get_default_dtype())
    noise = {k: empty(f"noise {k}", (roles, steps, clients, *p.shape), p.dtype) for k, p in params.items()}

    def fill(c: int) -> Optional[Tensor]:
        index, client_mask, _ = draws[c]
        generator = generators[c]
        for k, p in params.items():
            if p.numel() >= _DRAWN_IN_PLACE and p.numel() % 16 == 0:
                for role in range(roles):
                    for t in range(steps):
                        noise[k][role, t, c].normal_(generator=generator)
            else:
                noise[k][:, :, c].copy_(torch.randn(roles, steps, *p.shape, generator=generator, dtype=p.dtype))
        count = None if clip_bounds[c] is None else torch.randn(roles, steps, generator=generator, dtype=torch.float64)
        # the rows of the client's draw, padded to the round's cap with copies of each use's first
        padded = torch.cat([index, index[..., :1].expand(-1, -1, cap - index.shape[-1])], dim=-1)
        xc, yc = data[c]
        client_rows = padded.to(xc.device)
        if rows is not None:
            rows[c] = client_rows
        else:
            assert x is not None
            for role in range(roles):
                for t in range(steps):
                    gather_inputs(xc, client_rows[role, t], x[role, t, c])
        y[c] = yc[client_rows.to(yc.device)]
        mask[c, :, :, : client_mask.shape[-1]] = client_mask
        return count

    counts = each(fill, clients)
    adaptive = clip_bounds[0] is not None
    device = x0.device
    inputs: Union[Tensor, PrivateInputs]
    if rows is not None:
        inputs = PrivateInputs([xc for xc, _ in data], rows, input_norms)
    else:
        assert x is not None
        inputs = x.movedim(2, 0)
    return PrivateBatches(
        inputs,
        y,
        mask.to(device),
        {k: v.to(device).movedim(2, 0) for k, v in noise.items()},
        torch.stack([expected for _, _, expected in draws]).to(device),
        torch.stack(counts).to(device) if adaptive else None,
        torch.stack([b.to(dtype=torch.float64) for b in clip_bounds]).to(device) if adaptive else None,  # type: ignore[union-attr]
    )


def one_client(batches: PrivateBatches) -> PrivateBatches:
    """One client's draws with a client dimension of one in front (for :class:`PrivateChainSteps`)."""
    return PrivateBatches(
        batches.gathered_x().unsqueeze(0),
        batches.y.unsqueeze(0),
        batches.mask.unsqueeze(0),
        {k: v.unsqueeze(0) for k, v in batches.noise.items()},
        batches.expected.unsqueeze(0),
        None if batches.count_noise is None else batches.count_noise.unsqueeze(0),
        None if batches.clip_bounds is None else batches.clip_bounds.unsqueeze(0),
    )
