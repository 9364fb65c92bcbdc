"""The ZeRO 0-2 engine's bucket layout (`lightning_par.parallel.zero.replicated`): parameters packed rank-major,
rank j's row shards of every parameter contiguous (the layout FSDP2 uses), so one reduce-scatter per bucket hands
each rank its shard; and the local views of tensor-parallel (DTensor) parameters and gradients the engine works on.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from lightning_par import _compat
from lightning_par.parallel.grad_norm import mark_sharded
from lightning_par.utils import dtensors
from lightning_par.utils.dtensors import local_data


def settle_grad(p: torch.Tensor) -> None:
    """Reduce a tensor-parallel gradient whose placement differs from its parameter's, in place.

    A replicated parameter used on sequence shards (a norm under sequence parallelism) gets a Partial gradient:
    each tp rank holds the sum over its own tokens. It is reduced over tp before anything else reads it.
    """
    g = p.grad
    if isinstance(g, DTensor) and g.placements != p.placements:  # type: ignore[attr-defined]
        p.grad = g.redistribute(g.device_mesh, p.placements)  # type: ignore[attr-defined]


def settle_grads(params: Sequence[torch.Tensor]) -> None:
    """`settle_grad` for many parameters, with one flat all-reduce per tensor-parallel group and dtype for the
    gradients that are sums over that group (Partial) of a replicated parameter.

    Why: a sequence-parallel model has such a gradient for every norm weight and bias (9 in a 2-block GPT), and one
    collective each costs ~0.4 ms of latency per step on gloo (docs/benchmarks_history.md, per-step overhead). Any other
    placement change goes through `settle_grad` alone.
    """
    batches: dict[tuple[Any, torch.dtype], list[torch.Tensor]] = {}
    for p in params:
        g = p.grad
        if not isinstance(g, DTensor) or g.placements == p.placements:  # type: ignore[attr-defined]
            continue
        if g.device_mesh.ndim == 1 and g.placements == (Partial("sum"),) and p.placements == (Replicate(),):  # type: ignore[attr-defined]
            batches.setdefault((g.device_mesh, g.dtype), []).append(p)
        else:
            settle_grad(p)
    for (mesh, _), ps in batches.items():
        parts = [p.grad.to_local() for p in ps]  # type: ignore[union-attr]
        flat = torch.cat([t.reshape(-1) for t in parts])
        dist.all_reduce(flat, group=mesh.get_group())
        offset = 0
        for p, t in zip(ps, parts):
            set_grad(p, flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()


def local_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    settle_grad(p)
    g = p.grad
    return dtensors.local(g)


def tp_groups(p: torch.Tensor) -> tuple[dist.ProcessGroup, ...]:
    """The tensor-parallel group a DTensor parameter is split over (for the global gradient norm), if any."""
    if isinstance(p, DTensor) and any(not isinstance(pl, Replicate) for pl in p.placements):
        return (p.device_mesh.get_group(),)
    return ()


def set_grad(p: torch.Tensor, local: torch.Tensor) -> None:
    p.grad = dtensors.like(local, p)


class Bucket:
    """Parameters reduced with one collective; rank j's shards of all of them are contiguous in the buffer."""

    def __init__(self, params: list[nn.Parameter], world: int, rank: int) -> None:
        self.params = params
        self.rank = rank
        self.offsets: list[int] = []
        self.chunks: list[int] = []  # padded shard numel per parameter
        self.local: list[tuple[int, ...]] = []  # this rank's shard shape per parameter
        self.starts: list[int] = []  # this rank's first row per parameter
        size = 0
        self.data = [local_data(p) for p in params]  # under tensor parallelism: the tp-local shards
        for p in self.data:
            rows = p.shape[0]
            chunk_rows = math.ceil(rows / world)
            row_numel = p.numel() // rows if rows else 0
            local_rows = max(0, min(rows - rank * chunk_rows, chunk_rows))
            self.offsets.append(size)
            self.chunks.append(chunk_rows * row_numel)
            self.local.append((local_rows, *p.shape[1:]))
            self.starts.append(min(rank * chunk_rows, rows))
            size += chunk_rows * row_numel
        self.shard_numel = size
        self.mine = params  # every parameter has a (possibly empty) row shard here
        self.ready = 0  # parameters whose gradient this backward has finished (hooks)
        self.launched = False  # its reduction of this step has started

    def pack(self, tensors: Iterable[Optional[torch.Tensor]], world: int, dtype: torch.dtype) -> torch.Tensor:
        """Lay out full tensors rank-major: [rank 0's shards | rank 1's shards | ...]."""
        tensors = list(tensors)
        device = self.data[0].device
        if all(t is not None and t.dtype == dtype for t in tensors):
            buf = torch.empty(world, self.shard_numel, dtype=dtype, device=device)
            _compat.chunk_cat(tensors, world, buf)  # type: ignore[arg-type]  # one op, padding included
            return buf
        buf = torch.zeros(world, self.shard_numel, dtype=dtype, device=device)
        for t, off, chunk in zip(tensors, self.offsets, self.chunks):
            if t is None or chunk == 0:
                continue  # an unused parameter contributes a zero gradient
            flat = t.reshape(-1)
            if flat.numel() != world * chunk:
                flat = torch.nn.functional.pad(flat, (0, world * chunk - flat.numel()))
            buf[:, off : off + chunk].copy_(flat.view(world, chunk))
        return buf

    def shard_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Views of this rank's shards inside a buffer of ``shard_numel`` elements."""
        return [flat[off : off + math.prod(shape)].view(shape) for off, shape in zip(self.offsets, self.local)]

    def unpack(self, recv: torch.Tensor) -> None:
        """Copy the other ranks' rows of the all-gathered ``(world, shard_numel)`` shards into the full parameters.

        This rank's own rows are skipped: its masters are views of them, so the optimizer step already wrote them (the
        gather leaves them unwritten in ``recv``, `collectives.all_gather_single` with ``skip_own``).
        """
        world = recv.shape[0]
        dst, src = [], []
        for d, off, chunk in zip(self.data, self.offsets, self.chunks):
            rows = d.view(-1)
            for j in range(world):
                if j == self.rank or j * chunk >= rows.numel():
                    continue
                n = min(chunk, rows.numel() - j * chunk)  # the last rows may be padding
                dst.append(rows[j * chunk : j * chunk + n])
                src.append(recv[j, off : off + n])
        if dst:
            _compat.foreach_copy(dst, src)  # one fused copy per bucket


# DDP's choice: a small first bucket so the first reduction starts early in backward and overlaps the rest.
_FIRST_BUCKET_MB = 1.0


def make_buckets(params: list[nn.Parameter], cap_mb: float, world: int, rank: int) -> list[Bucket]:
    """Buckets of at most ``cap_mb`` (the first 1 MB) of one dtype each, in reverse order: gradients become ready
    roughly back to front, so stage-2 buckets fill early."""
    buckets: list[Bucket] = []
    current: list[nn.Parameter] = []
    nbytes = 0
    for p in reversed(params):
        cap = min(cap_mb, _FIRST_BUCKET_MB) if not buckets else cap_mb
        local = local_data(p)
        if current and (nbytes + local.numel() * local.element_size() > cap * 2**20 or p.dtype != current[0].dtype):
            buckets.append(Bucket(current, world, rank))
            current, nbytes = [], 0
        current.append(p)
        nbytes += local.numel() * local.element_size()
    if current:
        buckets.append(Bucket(current, world, rank))
    return buckets


def row_masters(buckets: Sequence[Bucket], group: dist.ProcessGroup) -> dict[nn.Parameter, nn.Parameter]:
    """Stages 1-2: each parameter's master, a view of this rank's rows of it (the optimizer's in-place update writes
    straight into the full weights), marked as sharded over ``group`` (and tp) for the gradient norm."""
    masters = {}
    for bucket in buckets:
        for p, shape, start in zip(bucket.params, bucket.local, bucket.starts):
            masters[p] = master = nn.Parameter(local_data(p).narrow(0, start, shape[0]))
            mark_sharded(master, (group, *tp_groups(p)))
    return masters


def flat_grads(bucket: Bucket) -> Optional[torch.Tensor]:
    """Stage 0: the bucket's gradients in one flat tensor (zeros for an unused parameter), or ``None`` if all unused."""
    settle_grads(bucket.params)
    grads = [local_grad(p) for p in bucket.params]
    if all(g is None for g in grads):
        return None
    return torch.cat([(torch.zeros_like(d) if g is None else g).reshape(-1) for g, d in zip(grads, bucket.data)])


@torch.no_grad()
def gather_buckets(buckets: Sequence[Any], masters: dict[nn.Parameter, nn.Parameter], world: int,
                   group: dist.ProcessGroup, gather: Callable[..., Any]) -> None:  # fmt: skip
    """All-gather every bucket's shards from this rank's masters (all started, then all waited for) and copy them
    back into the full parameters. ``gather``: the flat all-gather (`collectives.all_gather_single`; this rank's own
    rows are already in place, so it skips them)."""
    inflight = []
    for bucket in buckets:  # a `Bucket`, or `zero.whole`'s WholeBucket (``mine``: the parameters this rank owns)
        dtype = bucket.params[0].dtype
        # Empty, not zeros: the padding rows are sent but `unpack` never reads them.
        send = torch.empty(bucket.shard_numel, dtype=dtype, device=bucket.data[0].device)
        _compat.foreach_copy(bucket.shard_views(send), [masters[p] for p in bucket.mine])
        recv = torch.empty(world, bucket.shard_numel, dtype=dtype, device=send.device)
        inflight.append((gather(recv.view(-1), send, group=group, async_op=True, skip_own=True), bucket, recv))
    for work, bucket, recv in inflight:
        work.wait()
        bucket.unpack(recv)


def hand_over(bucket: Any, masters: dict[nn.Parameter, nn.Parameter], dtype: torch.dtype) -> None:
    """One data-parallel rank: give each parameter's (settled, local) gradient to its master as it is, and free it.

    What packing, a reduce-scatter over one rank and dividing by one would give, without the three passes over
    every gradient (the ZeRO-1/2 engine's per-step overhead against ``ddp`` on one H200: docs/benchmarks_history.md). At
    world 1 a master is the whole (tp-local) parameter. A gradient left from before adds up, as in the packed path;
    an unused parameter keeps no gradient, as in one process (the packed path, which cannot know that no other rank
    used it, gives zeros).
    """
    for p in bucket.params:
        g = local_grad(p)
        if g is None:
            continue
        master = masters[p]
        p.grad = None
        if master.grad is None:
            master.grad = g.to(dtype)
        else:
            master.grad.add_(g)


def state_dtensor(full: torch.Tensor, value: torch.Tensor, mesh: Any, state_mesh: Optional[Any]) -> DTensor:
    """A master's optimizer-state tensor as the ``Shard(0)`` DTensor of the full parameter ``full`` on the 2-D
    data-parallel ``mesh`` (under tensor parallelism: on the 3-D ``state_mesh``), for DCP."""
    if isinstance(full, DTensor):
        if state_mesh is None:
            raise ValueError("tensor-parallel parameters need state_mesh to describe their optimizer state")
        tp_placement = full.placements[0]
        # Rows of the tp-local shard: for a row-split (Shard(0)) parameter that is a strided shard of the full
        # one, as FSDP2 describes 2-D sharding; a fused parameter's layout is canonicalized when saved.
        rows: Placement = Shard(0)
        if type(tp_placement) is Shard and tp_placement.dim == 0:
            rows = _compat.StridedShard(0, split_factor=full.device_mesh.size())
        return DTensor.from_local(value, state_mesh, (Replicate(), rows, tp_placement), shape=full.shape,
                                  stride=full.stride(), run_check=False)  # fmt: skip
    return DTensor.from_local(
        value, mesh, (Replicate(), Shard(0)), shape=full.shape, stride=full.stride(), run_check=False
    )


class StateDTensors:
    """`state_dtensor` for the optimizer state of many masters, one spec per parameter and dtype: built once through
    the public constructor, then reused by the plain one (~2 us against ~20-50 us per tensor; a save wraps every
    moment of every parameter)."""

    def __init__(self, mesh: Any, state_mesh: Optional[Any]) -> None:
        self.mesh, self.state_mesh = mesh, state_mesh
        self._specs: dict[tuple[str, torch.dtype], Any] = {}

    def wrap(self, name: str, full: torch.Tensor, value: torch.Tensor) -> DTensor:
        spec = self._specs.get((name, value.dtype))
        if spec is not None:
            return _compat.dtensor_from_spec(value, spec)
        wrapped = state_dtensor(full, value, self.mesh, self.state_mesh)
        self._specs[(name, value.dtype)] = _compat.dtensor_spec(wrapped)
        return wrapped


def weak_grad_hook(method: Callable[[torch.Tensor], None]) -> Callable[[torch.Tensor], None]:
    """``method`` (a bound method) as a gradient-ready hook that does not keep its object alive.

    A parameter's hooks are not traversed by Python's cycle collector while autograd holds the parameter, so a
    strong cycle parameter -> hook -> engine -> parameter is never freed: every parameter, gradient and bucket of a
    finished fit stayed allocated on the device (found on the first GPU run; tests/test_released.py).
    """
    ref = weakref.WeakMethod(method)

    def hook(p: torch.Tensor) -> None:
        bound = ref()
        if bound is not None:
            bound(p)

    return hook
