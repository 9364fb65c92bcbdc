"""ZeRO data parallelism (Rajbhandari et al., "ZeRO", arXiv 1910.02054).

Stage 3 is FSDP2 (`fully_shard`): parameters, gradients and optimizer state are sharded; each block is
all-gathered for its forward and again for its backward, and gradients are reduce-scattered (3 x Psi x (n-1)/n
bytes per step).

Stages 0-2 keep full parameters on every rank and share one bucketed engine (`ReplicatedZero`):
- stage 0 (DDP): full gradients are all-reduced at the step; the optimizer is untouched.
- stage 1: full gradients are kept through backward (and accumulation); at the step each bucket is
  reduce-scattered, the rank updates only its shard of every parameter, and the shards are all-gathered back.
- stage 2: as stage 1, but each bucket is reduce-scattered as soon as its gradients are ready during backward and
  the full gradients are freed, so a rank only ever accumulates its gradient shard.
Stages 1 and 2 move 2 x Psi x (n-1)/n bytes per step, as DDP does.

A shard is a dim-0 slice of each parameter in ``torch.chunk`` order (ceil(d0/n) rows per rank, the last ranks
possibly short or empty), i.e. exactly a ``DTensor`` with ``Shard(0)`` placement. The optimizer therefore runs on
DTensor "master" parameters whose local tensors are views into the full parameters (no copy of the weights),
its state is sharded DTensors keyed like FSDP2's, and checkpoints move between stages and world sizes.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard

# torch 2.13 renamed the flat-tensor collectives; older releases only have the *_tensor names.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def apply_fsdp(
    root: nn.Module,
    blocks: Sequence[nn.Module],
    mesh: DeviceMesh,
    *,
    reshard_after_forward: bool = True,
    param_dtype: Optional[torch.dtype] = None,
    reduce_dtype: Optional[torch.dtype] = None,
    offload: bool = False,
) -> nn.Module:
    """Shard ``root`` with FSDP2 (ZeRO-3), one communication unit per block plus the root for the rest.

    Args:
        root: the module whose forward the training step calls; it becomes the FSDP root.
        blocks: repeated blocks, each wrapped separately so only one block is unsharded at a time.
        mesh: 1-D (``dp_shard``) or 2-D (``dp_replicate``, ``dp_shard``) mesh; 2-D gives hybrid sharding.
        reshard_after_forward: free the gathered parameters after forward (ZeRO-3); False keeps them to backward.
        param_dtype: dtype parameters are gathered and computed in (mixed precision); the shards stay fp32.
        reduce_dtype: dtype gradients are reduce-scattered in.
        offload: keep sharded parameters, gradients and optimizer state in CPU memory between uses.
    """
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    # Pinned memory needs an accelerator (CPU_FACTS.md); pinning only matters for async H2D copies anyway.
    off: OffloadPolicy = CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy()
    if mesh.ndim == 2 and mesh.size(0) == 1:
        mesh = mesh["dp_shard"]  # HSDP with one replica is plain FSDP; skip the size-1 all-reduce
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp, offload_policy=off)
    # The root's own parameters (embeddings, head) are gathered for the whole step; resharding them after
    # forward would only re-gather them for backward straight away.
    fully_shard(root, mesh=mesh, reshard_after_forward=False, mp_policy=mp, offload_policy=off)
    return root


@torch.no_grad()
def sync_module_states(module: nn.Module, mesh: DeviceMesh) -> None:
    """Broadcast parameters and buffers from the first data-parallel rank, as DDP does at construction.

    Ranks may have initialised differently (no seed, or a seed offset per rank); replicas must start equal.

    Args:
        module: the model, before any sharding.
        mesh: the flattened ``dp`` mesh (1-D).
    """
    if mesh.size() == 1:
        return
    group = mesh.get_group()
    src = dist.get_global_rank(group, 0)
    tensors = [t for t in [*module.parameters(), *module.buffers()] if t.device.type != "meta"]
    for t in tensors:
        dist.broadcast(t.data, src=src, group=group)


class _Bucket:
    """Parameters reduced with one collective; rank j's shards of all of them are contiguous in the buffer."""

    def __init__(self, params: list[nn.Parameter], world: int, rank: int) -> None:
        self.params = params
        self.offsets: list[int] = []
        self.chunks: list[int] = []  # padded shard numel per parameter
        self.local: list[tuple[int, ...]] = []  # this rank's shard shape per parameter
        size = 0
        for p in params:
            rows = p.shape[0]
            chunk_rows = math.ceil(rows / world)
            row_numel = p.numel() // rows if rows else 0
            local_rows = max(0, min(rows - rank * chunk_rows, chunk_rows))
            self.offsets.append(size)
            self.chunks.append(chunk_rows * row_numel)
            self.local.append((local_rows, *p.shape[1:]))
            size += chunk_rows * row_numel
        self.shard_numel = size
        self.ready = 0

    def pack(self, tensors: Iterable[Optional[torch.Tensor]], world: int, dtype: torch.dtype) -> torch.Tensor:
        """Lay out full tensors rank-major: [rank 0's shards | rank 1's shards | ...]."""
        buf = torch.zeros(world, self.shard_numel, dtype=dtype, device=self.params[0].device)
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


class ReplicatedZero:
    """Gradient reduction and optimizer sharding for ZeRO stages 0, 1 and 2 over replicated parameters.

    Args:
        module: the model; its trainable parameters must not change after construction.
        mesh: the 2-D (``dp_replicate``, ``dp_shard``) mesh. Gradients are reduce-scattered (stage 0:
            all-reduced) over ``dp_shard`` and all-reduced over ``dp_replicate``.
        stage: 0, 1 or 2.
        bucket_cap_mb: the largest bucket; one collective per bucket.
    """

    def __init__(self, module: nn.Module, mesh: DeviceMesh, stage: int, bucket_cap_mb: float = 25.0) -> None:
        if stage not in (0, 1, 2):
            raise ValueError(f"ReplicatedZero handles stages 0-2, got {stage}; stage 3 is `apply_fsdp`")
        self.stage = stage
        self.mesh = mesh
        self.shard_group = mesh.get_group("dp_shard")
        self.replicate_group = mesh.get_group("dp_replicate")
        self.world = mesh.size(1)
        self.rank = mesh.get_local_rank("dp_shard")
        self.dp = mesh.size()
        self.names: dict[nn.Parameter, str] = {}
        for name, p in module.named_parameters():
            if not p.requires_grad:
                continue
            if p.dim() == 0:
                raise ValueError(
                    f"parameter {name} is a 0-dim scalar, which ZeRO cannot shard along dim 0; store it with "
                    "shape (1,) instead"
                )
            self.names[p] = name
        self.buckets = self._make_buckets(list(self.names), bucket_cap_mb)
        self.masters: dict[nn.Parameter, nn.Parameter] = {}
        if stage >= 1:
            placements = (Replicate(), Shard(0))
            for bucket in self.buckets:
                for p, shape in zip(bucket.params, bucket.local):
                    start = min(self.rank * self._rows(p), p.shape[0])
                    local = p.data.narrow(0, start, shape[0])  # a view: the optimizer updates the weights in place
                    dt = DTensor.from_local(local, mesh, placements, shape=p.shape, stride=p.stride())
                    self.masters[p] = nn.Parameter(dt)
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        if stage == 2:
            self._bucket_of = {p: b for b in self.buckets for p in b.params}
            for p in self.names:
                self._hooks.append(p.register_post_accumulate_grad_hook(self._on_grad_ready))

    def _rows(self, p: torch.Tensor) -> int:
        return math.ceil(p.shape[0] / self.world)

    def _make_buckets(self, params: list[nn.Parameter], cap_mb: float) -> list[_Bucket]:
        # Reverse order: gradients become ready roughly back to front, so stage-2 buckets fill early.
        buckets: list[_Bucket] = []
        current: list[nn.Parameter] = []
        nbytes = 0
        for p in reversed(params):
            if current and (nbytes + p.numel() * p.element_size() > cap_mb * 2**20 or p.dtype != current[0].dtype):
                buckets.append(_Bucket(current, self.world, self.rank))
                current, nbytes = [], 0
            current.append(p)
            nbytes += p.numel() * p.element_size()
        if current:
            buckets.append(_Bucket(current, self.world, self.rank))
        return buckets

    # ---- optimizer -------------------------------------------------------------------------------------------
    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Point ``optimizer`` (built over the model's parameters) at the sharded masters, in place.

        In place, so LR schedulers that hold the optimizer keep working. Stage 0 leaves it alone.
        """
        if self.stage == 0:
            return
        if optimizer.state:
            raise RuntimeError("shard the optimizer before its first step (its state would be full-size)")
        for group in optimizer.param_groups:
            missing = [p for p in group["params"] if p not in self.masters and p.requires_grad]
            if missing:
                raise ValueError(
                    f"the optimizer holds {len(missing)} parameter(s) that are not trainable parameters of the "
                    "LightningModule; build the optimizer from self.parameters() in configure_optimizers"
                )
            group["params"] = [self.masters.get(p, p) for p in group["params"]]
        optimizer.register_step_post_hook(lambda *_: self.gather_params())

    def masters_module(self) -> nn.Module:
        """A module tree holding the masters under the original parameter names.

        ``torch.distributed.checkpoint.state_dict`` keys optimizer state by the names of the module that owns
        the optimizer's parameters; this gives the sharded optimizer the same keys as FSDP2's, so checkpoints
        move between ZeRO stages and world sizes.
        """
        root = nn.Module()
        for p, master in self.masters.items():
            *path, leaf = self.names[p].split(".")
            owner = root
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, master)
        return root

    # ---- gradients -------------------------------------------------------------------------------------------
    def reduce_gradients(self) -> None:
        """Finish the gradient reduction of one optimizer step (after the last backward of accumulation)."""
        for bucket in self.buckets:
            if self.stage == 2:
                if bucket.ready:  # unused parameters never fired their hook: flush with zeros for them
                    self._reduce_scatter(bucket)
                continue
            if self.stage == 0:
                self._all_reduce(bucket)
            else:
                self._reduce_scatter(bucket)

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        bucket = self._bucket_of[p]  # type: ignore[index]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            self._reduce_scatter(bucket)

    def _all_reduce(self, bucket: _Bucket) -> None:
        grads = [p.grad for p in bucket.params]
        if all(g is None for g in grads):
            return
        flat = torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in zip(grads, bucket.params)])
        dist.all_reduce(flat, group=self.shard_group)
        if self.mesh.size(0) > 1:
            dist.all_reduce(flat, group=self.replicate_group)
        flat.div_(self.dp)
        offset = 0
        for p in bucket.params:
            p.grad = flat[offset : offset + p.numel()].view_as(p)
            offset += p.numel()

    def _reduce_scatter(self, bucket: _Bucket) -> None:
        bucket.ready = 0
        grads = [p.grad for p in bucket.params]
        dtype = bucket.params[0].dtype
        packed = bucket.pack(grads, self.world, dtype)
        out = torch.empty(bucket.shard_numel, dtype=dtype, device=packed.device)
        _reduce_scatter(out, packed.view(-1), group=self.shard_group)
        if self.mesh.size(0) > 1:
            dist.all_reduce(out, group=self.replicate_group)
        out.div_(self.dp)
        for p, shard in zip(bucket.params, bucket.shard_views(out)):
            p.grad = None  # the full gradient is not needed again: this is where ZeRO saves gradient memory
            master = cast(DTensor, self.masters[p])
            if master.grad is None:
                master.grad = DTensor.from_local(
                    shard, self.mesh, master.placements, shape=master.shape, stride=master.stride()
                )
            else:
                cast(DTensor, master.grad).to_local().add_(shard)

    # ---- parameters ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def gather_params(self) -> None:
        """All-gather the updated shards so every rank holds the full parameters again."""
        for bucket in self.buckets:
            dtype = bucket.params[0].dtype
            send = torch.zeros(bucket.shard_numel, dtype=dtype, device=bucket.params[0].device)
            for view, p in zip(bucket.shard_views(send), bucket.params):
                view.copy_(cast(DTensor, self.masters[p]).to_local())
            recv = torch.empty(self.world, bucket.shard_numel, dtype=dtype, device=send.device)
            _all_gather(recv.view(-1), send, group=self.shard_group)
            for p, off, chunk in zip(bucket.params, bucket.offsets, bucket.chunks):
                p.data.view(-1).copy_(recv[:, off : off + chunk].reshape(-1)[: p.numel()])

    def remove_hooks(self) -> None:
        """Detach the stage-2 gradient hooks (at teardown)."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
