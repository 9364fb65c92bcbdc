"""Context parallelism: each sequence is split over the cp ranks inside the trunk; attention sees all of it.

Everything before the trunk (embeddings, rotary tables from the full positions, mask building) runs on the whole
sequence on every cp rank, so positions stay right without touching the model. Each block's forward pre-hook keeps
this rank's rows of every sequence-shaped argument (the hidden state entering the trunk, rotary tables, the rows of
4-D masks, whose columns stay whole): the sequence is cut into ``2 * cp`` chunks and rank ``r`` holds chunks ``r``
and ``2 * cp - 1 - r``, so that every rank does the same causal work. Inside the blocks a `TorchFunctionMode`
replaces ``scaled_dot_product_attention``: keys and values are all-gathered over cp (mode ``"allgather"``, as in the
Llama 3 paper), back in sequence order, and the local queries attend to them under the mask of their global
positions; or (mode ``"ulysses"``, ulysses.py) an all-to-all gives each rank every position of ``1/cp`` of the
heads, for which masks stay whole. The last block's output is gathered back in order; its backward keeps this
rank's rows of the upstream gradient (the same on every cp rank: the head runs on the whole sequence everywhere)
times cp, so that averaging gradients over dp x cp, as ZeRO does (mesh.py, ``dp_shard_cp``), gives the one-process
gradient.

Attention written by hand (``softmax(q @ k.T)``, Hugging Face's eager path) would attend within the local chunks
only: the mode sees the softmax of a square local score matrix and refuses, naming the block, at the first forward.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from lightning_par import _compat
from lightning_par.parallel.context.layout import Layout, layout
from lightning_par.parallel.context.ulysses import ulysses_attention

_SEQ = 1  # batch-first models: the hidden state is (batch, sequence, hidden)
_SOFTMAX = (F.softmax, torch.softmax, Tensor.softmax, torch.special.softmax)
_SCORES = (*_SOFTMAX, torch.matmul, Tensor.matmul, Tensor.__matmul__, torch.bmm)
# Ops that mix neighbouring positions outside attention: a block of a sequence model that calls them convolves over
# time (a causal conv1d, a token shift by roll), which a rank's own chunk of the sequence cannot do alone.
_MIXING = (F.conv1d, torch.conv1d, torch.roll, Tensor.roll)


class _Gather(torch.autograd.Function):
    """All-gather equal-size (padded) messages along ``dim``; backward keeps this rank's rows, summed over the
    ranks first when each rank's output feeds different rows (keys and values: every rank's queries read them)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: Any, width: int, rank: int, world: int, reduce: bool) -> Tensor:
        ctx.dim, ctx.group, ctx.rank, ctx.width, ctx.n, ctx.reduce = dim, group, rank, width, x.shape[dim], reduce
        ctx.world = world
        moved = x.movedim(dim, 0)
        if moved.shape[0] < width:  # gloo needs equal sizes: pad the message only, never the compute
            moved = torch.cat([moved, moved.new_zeros((width - moved.shape[0], *moved.shape[1:]))])
        out = moved.new_empty((world * width, *moved.shape[1:]))
        _compat.all_gather_single(out, moved.contiguous(), group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:
        grad = grad.contiguous()
        if ctx.reduce:
            grad = grad.clone()
            dist.all_reduce(grad, group=ctx.group)
        else:
            grad = grad * ctx.world  # identical upstream on every cp rank; averaged over cp by ZeRO
        return grad.narrow(ctx.dim, ctx.rank * ctx.width, ctx.n), None, None, None, None, None, None


@dataclasses.dataclass
class ContextParallel:
    """The installed context parallelism of one model (hooks on its trunk blocks).

    Args:
        cp: the degree; ``rank`` this rank's index in ``group``.
        group: the cp process group (``None`` only for checks that refuse before any communication).
        uneven: accept lengths that ``2 * cp`` does not divide.
        names: qualified names of the trunk blocks (for messages).
        mode: how attention sees the whole sequence: ``"allgather"`` (keys and values gathered) or ``"ulysses"``
            (heads <-> sequence all-to-all, ulysses.py).
    """

    cp: int
    rank: int
    group: Any
    uneven: bool
    names: tuple[str, ...]
    mode: str = "allgather"
    current: Optional[Layout] = None
    handles: list[Any] = dataclasses.field(default_factory=list)
    forwards: list[tuple[nn.Module, Any]] = dataclasses.field(default_factory=list)  # (block, its forward before)
    entered: list[int] = dataclasses.field(default_factory=list)  # the trunk positions run in this forward so far
    gathered: Any = None  # the autograd node of the trunk's gathered output in the forward under way

    def start(self, length: int, device: torch.device) -> Layout:
        """A new forward pass enters the trunk: check ``length`` and lay it out."""
        if length < 2 * self.cp:
            raise ValueError(
                f"sequence length {length} is shorter than 2 * cp = {2 * self.cp} chunks; use longer sequences or a "
                "smaller cp"
            )
        if length % (2 * self.cp) and not self.uneven:
            raise ValueError(
                f"sequence length {length} is not a multiple of 2 * cp = {2 * self.cp} (the load-balanced chunks); "
                f"use a multiple of {2 * self.cp}, or pass cp_uneven=True to the strategy (chunks then differ by one "
                "token)"
            )
        self.current = layout(length, self.cp, self.rank, device)
        return self.current

    def local_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape of this rank's part of a whole-sequence hidden state of ``shape`` (a pipeline's messages)."""
        lay = self.start(int(shape[_SEQ]), torch.device("cpu"))
        return (*shape[:_SEQ], len(lay.local), *shape[_SEQ + 1 :])

    def gather(self, x: Tensor, dim: int, reduce: bool, lay: Optional[Layout] = None) -> Tensor:
        """This rank's rows of ``x`` along ``dim`` -> the whole sequence, in order (autograd included); ``lay``:
        the layout of the forward that produced ``x`` (default: the current one)."""
        lay = lay if lay is not None else self._layout()
        full = _Gather.apply(x, dim, self.group, max(lay.sizes), self.rank, self.cp, reduce)
        return full.index_select(dim, lay.order)

    def gather_kv(self, k: Tensor, v: Tensor, lay: Layout) -> tuple[Tensor, Tensor]:
        """Keys and values of the whole sequence (dim -2), in order: one all-gather for both (and one all-reduce of
        their gradients) when their shapes agree, as they do unless value heads are narrower (latent attention).
        A collective costs ~0.3 ms of latency on 2 CPU ranks over gloo, far more than stacking two local chunks.

        Args:
            k, v: this rank's keys and values, ``[..., local positions, head dim]``.
            lay: the layout of the forward that produced them.
        """
        dim = k.dim() - 2
        if k.shape != v.shape or k.dtype != v.dtype:
            return self.gather(k, dim, True, lay), self.gather(v, dim, True, lay)
        both = self.gather(torch.stack([k, v]), dim + 1, True, lay)
        return both[0], both[1]

    def _layout(self) -> Layout:
        if self.current is None:
            raise RuntimeError("context parallel attention ran outside the trunk's forward")
        return self.current

    def remove(self) -> None:
        """Take the hooks and the forward wrappers off again."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for block, forward in self.forwards:
            block.forward = forward  # type: ignore[method-assign]
        self.forwards.clear()


def _seq_dim(t: Tensor, length: int, batch: int, whole_masks: bool) -> Optional[int]:
    if t.dim() >= 2 and t.shape[-1] == length and t.shape[-2] == length:
        # A mask or bias over (queries, keys): all-gather attention keeps this rank's query rows and every key.
        # Ulysses attention computes every query (of some heads), so it keeps the mask whole; there only what is
        # surely a mask (4-D as SDPA takes it, or boolean), since a 2-D / 3-D float table whose width happens to
        # equal the length must be cut by its rows (a mask taken for one is refused by the attention, not misused).
        if not whole_masks:
            return t.dim() - 2
        if t.dim() == 4 or t.dtype == torch.bool:
            return None
    dims = [d for d in range(t.dim()) if t.shape[d] == length]
    if len(dims) > 1 and t.shape[0] == batch:
        dims = dims[1:]  # batch-first: a batch as long as the sequence is still the batch
    return dims[0] if dims else None


def _slice(value: Any, cpar: ContextParallel, batch: int, hidden: bool = False) -> Any:
    lay = cpar._layout()
    if isinstance(value, Tensor) and value.dim() > 0:
        # The hidden state is (batch, sequence, hidden) by the trunk contract, even when hidden == sequence length.
        dim = _SEQ if hidden else _seq_dim(value, lay.length, batch, whole_masks=cpar.mode == "ulysses")
        return value if dim is None else value.index_select(dim, lay.local.to(value.device))
    if isinstance(value, tuple):  # Hugging Face's position_embeddings = (cos, sin)
        return tuple(_slice(v, cpar, batch) for v in value)
    return value


class _AttentionMode(TorchFunctionMode):
    """Active inside each trunk block: SDPA over the whole sequence's keys and values; hand-written attention
    (a softmax over a square local score matrix) refused."""

    def __init__(self, cpar: ContextParallel, block: str) -> None:
        super().__init__()
        self.cpar, self.block = cpar, block

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            # SDPA's tensors may come by keyword (query=, key=, value=): both modes take them by position.
            args = (*args, *(kwargs.pop(n) for n in ("query", "key", "value")[len(args) :] if n in kwargs))
            cpar = self.cpar
            _check_self_attention(cpar, self.block, args[0], args[1])
            if cpar.mode == "ulysses":
                return ulysses_attention(cpar._layout(), cpar.group, cpar.rank, self.block, *args, **kwargs)
            return _attention(cpar, self.block, *args, **kwargs)
        if func in _SCORES and _local_scores(self.cpar, func, args):
            n = len(self.cpar._layout().local)
            raise NotImplementedError(
                f"{self.block} computes attention without scaled_dot_product_attention ({n} x {n} local scores): under "
                "cp each rank holds only part of the sequence, so it would attend within its part; make the model "
                "call torch.nn.functional.scaled_dot_product_attention (Hugging Face: attn_implementation='sdpa'), "
                "or train without cp"
            )
        if func in _MIXING:
            raise NotImplementedError(
                f"{self.block} mixes positions with {getattr(func, '__name__', func)}() outside attention (a "
                "convolution over the sequence: Mamba's and LFM's short convolutions): under cp each rank holds only "
                "part of the sequence, so it would see only its own part's neighbours; train this model without cp"
            )
        return func(*args, **kwargs)


def _local_scores(cpar: ContextParallel, func: Any, args: tuple) -> bool:
    # Hand-written attention shows as q @ k^T over per-head (>= 4-D) tensors, or a softmax of the square result.
    n = len(cpar._layout().local)
    tensors = [a for a in args[:2] if isinstance(a, Tensor)]
    if func in _SOFTMAX:
        return bool(tensors) and tensors[0].dim() >= 2 and tuple(tensors[0].shape[-2:]) == (n, n)
    if len(tensors) < 2 or min(t.dim() for t in tensors) < 4:
        return False
    return (tensors[0].shape[-2], tensors[1].shape[-1]) == (n, n)


def _check_self_attention(cpar: ContextParallel, block: str, q: Tensor, k: Tensor) -> None:
    n = len(cpar._layout().local)
    if q.shape[-2] != n or k.shape[-2] != n:
        raise NotImplementedError(
            f"{block} calls scaled_dot_product_attention on {q.shape[-2]} queries / {k.shape[-2]} keys, not this cp "
            f"rank's {n} positions (cross-attention, or a cache): context parallelism splits self-attention only; "
            "train this model without cp"
        )


def _attention(
    cpar: ContextParallel,
    block: str,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Optional[Tensor] = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: Optional[float] = None,
    enable_gqa: bool = False,
) -> Tensor:
    lay = cpar._layout()
    if is_causal:
        mask = lay.local.to(q.device)[:, None] >= torch.arange(lay.length, device=q.device)[None, :]
    elif attn_mask is not None:
        if attn_mask.shape[-1] != lay.length:
            raise NotImplementedError(
                f"{block} passes an attention mask over {attn_mask.shape[-1]} keys, built inside the block from its "
                f"local length; build the mask before the trunk (it is then split by rows), or use is_causal=True"
            )
        mask = attn_mask
    else:
        mask = None

    def attend(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        full_k, full_v = cpar.gather_kv(k, v, lay)
        return F.scaled_dot_product_attention(
            q, full_k, full_v, attn_mask=mask, dropout_p=dropout_p, is_causal=False, scale=scale, enable_gqa=enable_gqa
        )

    if not (torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))):
        return attend(q, k, v)
    # Recomputed in backward: autograd keeps this rank's keys and values, not the whole sequence's, so the memory a
    # layer holds for backward falls by cp like the rest of the block; backward gathers them again (ring attention
    # also moves K and V again in backward) and reruns this rank's attention forward.
    return checkpoint(attend, q, k, v, use_reentrant=False)


def apply_context_parallel(
    blocks: list[tuple[str, nn.Module]],
    cp: int,
    rank: int,
    group: Any,
    uneven: bool = False,
    mode: str = "allgather",
    *,
    indices: Optional[Sequence[int]] = None,
    running: Optional[Callable[[], Optional[tuple[int, int]]]] = None,
    last: Optional[int] = None,
) -> ContextParallel:
    """Split the sequence over cp ranks inside the trunk ``blocks`` (hooks only; the model is unchanged).

    Args:
        blocks: (qualified name, module) of the trunk blocks this rank runs, in execution order.
        cp: context-parallel degree (> 1).
        rank: this rank's index in the cp group.
        group: the cp process group.
        uneven: accept sequence lengths that ``2 * cp`` does not divide.
        mode: ``"allgather"`` (keys and values all-gathered over cp) or ``"ulysses"`` (an all-to-all of heads and
            sequence around each attention call; the heads must divide by cp).
        indices: each block's position in the whole trunk (default ``0 .. len(blocks) - 1``, the whole trunk);
            under a pipeline, the blocks of this rank's stages.
        running: the trunk positions ``(start, end)`` the forward now in progress computes (a pipeline stage's);
            the sequence is cut at ``start`` and gathered after the trunk's last block only. Default: all of them.
        last: the trunk's last block position (default: the last of ``blocks``).
    """
    where = list(indices) if indices is not None else list(range(len(blocks)))
    end = last if last is not None else where[-1]
    span = running if running is not None else (lambda: (0, len(blocks)))
    cpar = ContextParallel(cp, rank, group, uneven, tuple(n for n, _ in blocks), mode)
    names_at = dict(zip(where, (n for n, _ in blocks)))

    def enter(i: int, name: str, mod: nn.Module, args: Any, kwargs: Any) -> Any:
        now = span()
        if now is None or not now[0] <= i < now[1]:
            return None  # a pipeline's pass-through of a block another of this rank's stages computes
        hidden: Any = 0 if args else next(iter(kwargs))  # where the hidden state is: first positional, or kwarg
        x = args[0] if args else kwargs[hidden]
        first = i == now[0]
        if first and _reaches(x, cpar.gathered):
            raise NotImplementedError(
                f"{name} runs again in one forward on what the trunk's last block returned (a loop over the whole "
                "trunk): context parallelism gathers the sequence after the last block for code that runs alike on "
                "every rank, which a second pass is not; train this model without it (e.g. strategy='zero3')"
            )
        if first:  # the trunk's (or this stage's) first block: the hidden state is whole, the layout starts
            cpar.entered.clear()  # (a pipeline's stage runs and probes end early, leaving their blocks here)
            cpar.gathered = None
            cpar.start(int(x.shape[_SEQ]), x.device)
        elif cpar.entered and i <= cpar.entered[-1]:
            # A block run again, or out of order (weights reused at several depths: a looped section): the sequence
            # was cut where the trunk starts and is gathered after its last block, once each per forward.
            order = [names_at[j] for j in [*cpar.entered, i]]
            cpar.entered.clear()
            raise NotImplementedError(
                f"{name} runs again in one forward, after {order[-2] if len(order) > 1 else 'no block'} (blocks run "
                f"{' -> '.join(order)}): context parallelism needs each trunk block once per forward, in order; train "
                "this model without it (e.g. strategy='zero3')"
            )
        cpar.entered.append(i)
        batch = int(x.shape[0])

        def cut(at: Any, value: Any) -> Any:
            # The hidden state of later blocks is already local; every other sequence-shaped argument is whole.
            if at == hidden:
                return _slice(value, cpar, batch, hidden=True) if first else value
            return _slice(value, cpar, batch)

        args = tuple(cut(j, a) for j, a in enumerate(args))
        kwargs = {k: cut(k, a) for k, a in kwargs.items()}
        return args, kwargs

    def leave(i: int, mod: nn.Module, args: Any, kwargs: Any, out: Any) -> Any:
        if i != end or not isinstance(out, (Tensor, tuple, list)):
            return None
        now = span()
        if now is None or not now[0] <= i < now[1]:
            return None
        full = cpar.gather(out if isinstance(out, Tensor) else out[0], _SEQ, False)
        cpar.gathered = full.grad_fn  # a first block that reads it again is a loop (`enter`)
        return full if isinstance(out, Tensor) else type(out)([full, *out[1:]])

    for i, (name, block) in zip(where, blocks):
        # The attention mode is entered inside the block's forward, not in its pre-hook: activation checkpointing
        # (installed later, compose.py) wraps this forward, so its recomputation in backward, which calls the
        # forward without the module's hooks, runs under the mode too (on the arguments the pre-hook had cut).
        cpar.forwards.append((block, block.forward))
        block.forward = functools.partial(_in_mode, cpar, name, block.forward)  # type: ignore[method-assign]
        cpar.handles.append(
            block.register_forward_pre_hook(
                lambda m, a, kw, i=i, name=name: enter(i, name, m, a, kw), with_kwargs=True, prepend=True
            )
        )
        cpar.handles.append(
            block.register_forward_hook(lambda m, a, kw, o, i=i: leave(i, m, a, kw, o), with_kwargs=True)
        )
    return cpar


def _reaches(x: Any, node: Any, limit: int = 256) -> bool:
    """Whether ``x`` was computed from the autograd ``node`` (searching at most ``limit`` nodes back)."""
    if node is None or not isinstance(x, Tensor) or x.grad_fn is None:
        return False
    stack: list[Any] = [x.grad_fn]
    seen: set[int] = set()
    while stack and len(seen) < limit:
        fn = stack.pop()
        if fn is node:
            return True
        if fn is not None and id(fn) not in seen:
            seen.add(id(fn))
            stack.extend(f for f, _ in fn.next_functions)
    return False


def _in_mode(cpar: ContextParallel, name: str, forward: Any, *args: Any, **kwargs: Any) -> Any:
    # A recomputation runs in the same step as its forward, whose microbatches share one length, so the current
    # layout is the forward's; a mismatch would mean a new length started in between, which nothing here allows.
    with _AttentionMode(cpar, name):
        return forward(*args, **kwargs)
