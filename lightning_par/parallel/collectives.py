"""Collectives shared by more than one technique.

`reduce_scatter_single` and `all_gather_single` are torch's flat collectives, except on gloo, where they are direct
sends and receives: gloo's reduce-scatter all-reduces the whole buffer, and ZeRO's all-gather need not copy a
rank's own part.

`apart_from_default` gives collectives left in flight while the training loop runs their own communicator.

`UnitAllGather` is the base of a replacement for FSDP2's all-gather of a unit (`FSDPModule.set_custom_all_gather`:
ZeRO-3's int8 weights, compression/quantized.py; fp8 units as bytes, fp8/gather.py): the buffers FSDP2 allocates as
it would, and the flat all-gather looked up where `comm_counter.CommCounter` counts it.

`all_to_all` exchanges rows with split sizes, which may be uneven and zero (gloo's ``all_to_all_single`` takes
them): expert parallelism's token dispatch (experts/dispatch.py) and Ulysses context parallelism's heads <->
sequence exchange (context/ulysses.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_par import _compat


class _Exchange:
    """The work of a collective made of point-to-point sends and receives; `wait` finishes them, then runs the local
    step that completes the collective (a reduce-scatter's sum)."""

    def __init__(self, works: list[Any], finish: Optional[Callable[[], None]] = None) -> None:
        self.works, self.finish = works, finish

    def wait(self) -> bool:
        for work in self.works:
            work.wait()
        if self.finish is not None:
            self.finish()
            self.finish = None
        return True


def _exchange(
    sends: Sequence[Tensor], recvs: Sequence[Optional[Tensor]], group: Optional[dist.ProcessGroup]
) -> list[Any]:
    """Post, without waiting, a send of ``sends[j]`` to and a receive into ``recvs[j]`` from every other rank j of
    ``group`` (``recvs[rank]`` is not touched and may be None)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    peers = [j for j in range(world) if j != rank]
    works = [dist.irecv(cast(Tensor, recvs[j]), group=group, group_src=j) for j in peers]
    return works + [dist.isend(sends[j], group=group, group_dst=j) for j in peers]


def reduce_scatter_single(output: Tensor, input: Tensor, group: Optional[dist.ProcessGroup] = None,
                          async_op: bool = False) -> Any:  # fmt: skip
    """Sum ``input`` (``world x len(output)`` elements, rank j's part j-th) over ``group`` and keep this rank's part.

    gloo's reduce-scatter clones the input, all-reduces all of it and copies one part out (ProcessGroupGloo's
    ``reduce_scatter_tensor_coalesced``): 2(n-1)/n of the input on the wire instead of (n-1)/n, which made ZeRO 1-2
    send half again what DDP sends there. On gloo, every rank instead sends part j straight to rank j and sums what it
    receives with its own part, in rank order: the optimal (n-1)/n on the wire, and no copy of its own part (an
    all-to-all would copy it into the receive buffer). Other backends: torch's own. Returns the work with
    ``async_op`` (its ``wait`` also does the sum), else ``None``.
    """
    if dist.get_backend(group) != "gloo":
        return _compat.reduce_scatter_single(output, input, group=group, async_op=async_op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    parts = input.view(world, -1)
    # One row per other rank: this rank's own part is read from `input` where it is.
    recv = iter(input.new_empty(world - 1, output.numel()))
    terms = [parts[j] if j == rank else next(recv) for j in range(world)]

    def total() -> None:
        if world == 1:
            output.copy_(terms[0])
            return
        torch.add(terms[0], terms[1], out=output)
        for t in terms[2:]:
            output.add_(t)

    work = _Exchange(_exchange(list(parts), [None if j == rank else terms[j] for j in range(world)], group), total)
    if async_op:
        return work
    work.wait()
    return None


def all_gather_single(output_tensor: Tensor, input_tensor: Tensor, group: Optional[dist.ProcessGroup] = None,
                      async_op: bool = False, skip_own: bool = False) -> Any:  # fmt: skip
    """Gather every rank's ``input_tensor`` into ``output_tensor`` (``world x input_tensor.numel()``, rank order).

    Args:
        skip_own: leave this rank's own part of ``output_tensor`` unwritten (the caller already has it in place:
            ZeRO's masters are views of the parameters), which saves copying it. On gloo the gather is then direct
            sends and receives; other backends run torch's own and write it anyway.
    """
    if dist.get_backend(group) != "gloo":
        return _compat.all_gather_single(output_tensor, input_tensor, group=group, async_op=async_op)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    rows = output_tensor.view(world, -1)
    if not skip_own:
        rows[rank].copy_(input_tensor.reshape(-1))
    work = _Exchange(_exchange([input_tensor] * world, list(rows), group))
    if async_op:
        return work
    work.wait()
    return None


_TWIN: list[tuple[dist.ProcessGroup, dist.ProcessGroup]] = []  # (default group, its twin), for `apart_from_default`


def apart_from_default(group: dist.ProcessGroup, timeout: Optional[timedelta]) -> dist.ProcessGroup:
    """``group``, or, when it is the default process group, a new group over the same ranks.

    For collectives started and left in flight while other code runs (ZeRO's deferred all-gather, `zero.prefetch`).
    Lightning's training loop broadcasts a flag on the default group at the start of every batch and reads it on
    the host (`_TrainingEpochLoop._broadcast_sigterm_tensor`). On one communicator that broadcast runs after the
    started all-gathers (NCCL: the same stream; gloo: the same connections), so the host would wait for all of them
    before it issues the next forward, and nothing would overlap. A group of its own costs one more communicator
    (NCCL creates it on first use). Every rank of the default group must call this, in the same order.

    Args:
        timeout: the new group's collective timeout (None: torch's default for the backend).
    """
    if group is not dist.group.WORLD:
        return group
    # One per process: another fit (a test, a sweep's trial) reuses it rather than holding one more communicator each
    # time. A new default group (the old one destroyed, and every group with it) gets a new twin.
    if not _TWIN or _TWIN[0][0] is not group:
        _TWIN[:] = [(group, dist.new_group(dist.get_process_group_ranks(group), timeout=timeout))]
    return _TWIN[0][1]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with split sizes; its gradient is the same exchange with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None]:
        out_splits, in_splits = ctx.splits
        back = grad.new_empty((sum(in_splits), *grad.shape[1:]))
        dist.all_to_all_single(back, grad.contiguous(), in_splits, out_splits, group=ctx.group)
        return back, None, None, None


def all_to_all(x: Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup) -> Tensor:
    """Differentiable all-to-all of rows: ``in_splits[j]`` rows of ``x`` go to rank ``j``; ``out_splits[j]``
    rows arrive from rank ``j``, in rank order.

    Args:
        x: ``[sum(in_splits), ...]``.
        out_splits: rows received from each rank of ``group``.
        in_splits: rows sent to each rank of ``group``.
        group: the ranks exchanging (every one of them must call this, even with zero rows).
    """
    out: Tensor = _AllToAll.apply(x, out_splits, in_splits, group)
    return out


class UnitAllGather(_compat.FSDPAllGather):  # type: ignore[misc]
    """FSDP2's all-gather of a unit's flat buffer, replaced (module docstring); subclasses define ``__call__``."""

    def allocate(self, size: Sequence[Any], *, dtype: torch.dtype, device: torch.device) -> Tensor:
        return torch.empty(size, dtype=dtype, device=device)

    @staticmethod
    def gather() -> Callable[..., Any]:
        """The flat all-gather (torch 2.13's name, 2.11's), looked up at each call, where it is counted."""
        return getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
