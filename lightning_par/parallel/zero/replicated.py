"""The ZeRO stage 0-2 engine over replicated parameters (see `lightning_par.parallel.zero.fsdp` for the stages).

Gradients are packed into buckets laid out rank-major (rank j's shards of every parameter contiguous, the layout
FSDP2 uses) so one reduce-scatter per bucket hands each rank its shard. The optimizer runs on plain "master"
tensors that are views into this rank's rows of each parameter; after its step the shards are all-gathered back.
An optimizer that is not element-wise gets whole parameters instead, one owner rank each (`zero.whole`), through
the same buckets and collectives.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import nullcontext
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from lightning_par import _compat
from lightning_par.parallel import collectives
from lightning_par.parallel.compression import PowerSGD
from lightning_par.parallel.local_sgd.outer import LocalSGD, OuterSync
from lightning_par.parallel.optimizers import check_per_parameter, is_elementwise
from lightning_par.parallel.param_tree import parameter_tree
from lightning_par.parallel.zero import buckets as zero_buckets
from lightning_par.parallel.zero import whole as zero_whole
from lightning_par.parallel.zero.buckets import Bucket, local_data, local_grad, settle_grads, tp_groups
from lightning_par.parallel.zero.local_views import LocalViews
from lightning_par.parallel.zero.prefetch import ParamPrefetch

# Module attributes, not calls of _compat's: lightning_par.parallel.comm_counter patches these two to count bytes.
_reduce_scatter = collectives.reduce_scatter_single  # torch's, or direct sends on gloo
_all_gather = collectives.all_gather_single

# Stage-2 reductions in flight during backward; each holds a packed bucket, so this bounds the extra memory.
_MAX_INFLIGHT = 2


class ReplicatedZero:
    """Gradient reduction and optimizer sharding for ZeRO stages 0, 1 and 2 over replicated parameters.

    Args:
        module: the model; its trainable parameters must not change after construction.
        mesh: the 2-D (``dp_replicate``, ``dp_shard``) mesh. Gradients are reduce-scattered (stage 0:
            all-reduced) over ``dp_shard`` and all-reduced over ``dp_replicate``.
        stage: 0, 1 or 2.
        bucket_cap_mb: the largest bucket; one collective per bucket.
        state_mesh: under tensor parallelism, the 3-D (``dp_replicate``, ``dp_shard``, ``tp``) mesh that
            optimizer state is described on for checkpoints; parameters are then DTensors on its ``tp`` axis and
            this engine works on their local shards.
        exclude: parameters another engine reduces (expert shards under expert parallelism); they stay in the
            optimizer unsharded.
        reduce_during_backward: stage 2 reduce-scatters each bucket during backward, as soon as its gradients are
            ready (autograd's accumulation hooks). ``False`` reduces after every backward instead: under a pipeline
            schedule, which runs several backward passes per step and whose zero-bubble weight passes compute
            gradients outside those hooks (docs/pipeline.md).
        blocks: the trunk blocks in execution order: the units in which stages 1-2 can overlap the parameter
            all-gather after the step with the next forward (`defer_gather`, `lightning_par.parallel.zero.prefetch`).
        local_sgd: synchronise the ``dp_replicate`` replicas every ``local_sgd.every`` steps (DiLoCo,
            `lightning_par.parallel.local_sgd.outer`) instead of reducing gradients over them every step.
        timeout: collective timeout of the group the deferred all-gather may get (`collectives.apart_from_default`).
        compression: PowerSGD for the gradient all-reduce (stages 0-1, over every data-parallel rank: hybrid
            sharding's replicas too): each bucket is reduced after the backward, one after another, by
            `PowerSGD.reduce`.
    """

    def __init__(
        self,
        module: nn.Module,
        mesh: DeviceMesh,
        stage: int,
        bucket_cap_mb: float = 25.0,
        state_mesh: Optional[DeviceMesh] = None,
        exclude: Iterable[nn.Parameter] = (),
        reduce_during_backward: bool = True,
        blocks: Sequence[nn.Module] = (),
        local_sgd: Optional[LocalSGD] = None,
        timeout: Optional[timedelta] = None,
        compression: Optional[PowerSGD] = None,
    ) -> None:
        if stage not in (0, 1, 2):
            raise ValueError(f"ReplicatedZero handles stages 0-2, got {stage}; stage 3 is `apply_fsdp`")
        self.stage = stage
        self.mesh = mesh
        self.shard_group = mesh.get_group(1)  # dp_shard, or dp_shard_cp under context parallelism (mesh.py)
        self.replicate_group = mesh.get_group(0)
        self.world = mesh.size(1)
        self.rank = mesh.get_local_rank(1)
        # Gradients are averaged over dp_shard, and over dp_replicate too unless the replicas train apart (local SGD).
        self.local_sgd, self.timeout, self.compression = local_sgd, timeout, compression
        self.reduce_replicas = mesh.size(0) > 1 and local_sgd is None
        self.dp = mesh.size() if local_sgd is None else self.world
        self.outer: Optional[OuterSync] = None  # built once the optimizer's layout is known (`shard_optimizer`)
        self.state_mesh = state_mesh
        self._state_specs = zero_buckets.StateDTensors(mesh, state_mesh)  # distribute_state's DTensor specs
        self._masters_root: Optional[nn.Module] = None
        self.names: dict[nn.Parameter, str] = {}
        self.excluded = set(exclude)
        self._excluded_names: dict[str, nn.Parameter] = {}
        for name, p in module.named_parameters():
            if p in self.excluded:
                self._excluded_names[name] = p
            if not p.requires_grad or p in self.excluded:
                continue
            if p.dim() == 0:
                raise ValueError(
                    f"parameter {name} is a 0-dim scalar, which ZeRO cannot shard along dim 0; pass it in exclude "
                    "and average its gradient apart (lightning_par.parallel.zero.scalars, as parallelize does)"
                )
            self.names[p] = name
        # Bucket or WholeBucket
        self.buckets: list[Any] = zero_buckets.make_buckets(list(self.names), bucket_cap_mb, self.world, self.rank)
        self.whole = False  # whole-parameter layout (`zero.whole`), chosen by the first optimizer that needs it
        self._wrapped = 0  # optimizers pointed at the masters
        self.masters = zero_buckets.row_masters(self.buckets, self.shard_group) if stage >= 1 else {}
        self._full_of: dict[str, nn.Parameter] = {self.names[p]: p for p in self.masters}
        self.local_views = LocalViews()  # stage 0 under tp: what element-wise optimizers step (zero_local_views)
        self._pending: list[tuple[Any, Bucket, torch.Tensor]] = []
        self._blocks = list(blocks)
        self.prefetch: Optional[ParamPrefetch] = None  # built by `defer_gather(True)`
        self._armed = False  # a training step started: its optimizer step may defer the gather
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        # Whether the running backward ends an accumulation (the step follows): stages 0 and 1 then reduce each
        # bucket as soon as its gradients are final, overlapping the rest of that backward. None: not told (a loop
        # that does not call `before_backward`), so they reduce after it, as before.
        self._final: Optional[bool] = None
        if reduce_during_backward and (stage == 2 or self.dp > 1) and compression is None:
            self._bucket_of: dict[nn.Parameter, Any] = {p: b for b in self.buckets for p in b.params}
            hook = zero_buckets.weak_grad_hook(self._on_grad_ready)  # a strong one kept a finished fit's memory
            self._hooks += [p.register_post_accumulate_grad_hook(hook) for p in self.names]

    # ---- optimizer -------------------------------------------------------------------------------------------
    def shard_optimizer(self, optimizer: torch.optim.Optimizer) -> Optional[str]:
        """Point ``optimizer`` (built over the model's parameters) at this rank's masters, in place.

        In place, so LR schedulers that hold the optimizer keep working. An element-wise optimizer steps row slices
        of every weight; any other the whole parameters this rank owns (`zero.whole`). Stage 0 only points
        element-wise ones at plain views of tensor-parallel shards (`zero.local_views`).
        Returns a start-up line for the latter. Raises ValueError for a step that couples parameters (LBFGS), or one
        not element-wise over tensor-parallel shards.
        """
        if self.local_sgd is not None:  # stage 0: a post-hook of its own; stages 1-2: `_after_step`, before the gather
            # The excluded parameters are the 0-dim ones here (local SGD refuses ep): whole, synchronised too.
            parts = lambda: ([(self.names[p], m) for p, m in self.masters.items()] if self.stage  # noqa: E731
                             else [(n, local_data(p)) for p, n in self.names.items()]) + [
                (n, local_data(p)) for n, p in self._excluded_names.items()]  # fmt: skip
            self.outer = OuterSync.attach(optimizer, parts, self.replicate_group, self.local_sgd, self.stage == 0,
                                          self.outer)  # fmt: skip
        if self.stage == 0:
            if self.local_views.adopt(optimizer, self.names):
                self._masters_root = None  # its names now lead to the views
            return None
        check_per_parameter(optimizer, self.stage)
        if optimizer.state:
            raise RuntimeError("shard the optimizer before its first step (its state would be full-size)")
        line = None if is_elementwise(optimizer) else self._use_whole_params(optimizer)
        for group in optimizer.param_groups:
            missing = [p for p in group["params"] if p not in self.names and p not in self.excluded and p.requires_grad]
            if missing:
                raise ValueError(
                    f"the optimizer holds {len(missing)} parameter(s) that are not trainable parameters of the "
                    "LightningModule; build the optimizer from self.parameters() in configure_optimizers"
                )
            # Whole-parameter layout: the parameters other ranks own leave this rank's optimizer.
            kept = [p for p in group["params"] if p in self.masters or p not in self.names]
            group["params"] = [self.masters.get(p, p) for p in kept]
        # First of the optimizer's post-hooks: the others (the user's) must see the gathered weights.
        _compat.run_step_post_hook_first(optimizer, optimizer.register_step_post_hook(self._after_step))
        self._wrapped += 1
        return line

    def _after_step(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        # Deferred only for the step of a training step (not one made elsewhere, as when a checkpoint load creates
        # optimizer state and then writes the weights), and only when no other post-hook (the user's, a global one)
        # runs right after this one and may read the weights.
        armed, self._armed = self._armed, False
        if self.outer is not None:
            self.outer.after_inner_step()
        self.gather_params(defer=armed and _compat.step_post_hooks(optimizer) == 1)

    def defer_gather(self, on: bool) -> bool:
        """Let `gather_params` start the all-gather after the step and return, each block waiting for its weights
        in a forward pre-hook (`zero.prefetch`); the caller then promises to call `wait_params` (or
        `before_forward`) before any other read of the weights. Returns whether it is on: only stages 1-2 over more
        than one rank, with one optimizer stepping row slices."""
        on = on and self.stage >= 1 and self.world > 1 and not self.whole and self._wrapped <= 1
        if on and self.prefetch is None:
            group = collectives.apart_from_default(self.shard_group, self.timeout)  # Lightning's per-batch broadcast
            self.prefetch = ParamPrefetch(list(self.names), self.masters, self._blocks, group, self.world, self.rank)
        if self.prefetch is not None:
            self.prefetch.wait_all()
            self.prefetch.enabled = on
        return on

    def wait_params(self) -> None:
        """Complete a deferred parameter all-gather: afterwards every rank holds the full updated weights."""
        if self.prefetch is not None:
            self.prefetch.wait_all()

    def before_forward(self) -> Any:
        """At the start of a training step: wait for the weights outside the trunk blocks (the blocks wait in
        their pre-hooks). Returns the context to run the step in."""
        if self.prefetch is None:
            return nullcontext()
        self._armed = True
        return self.prefetch.wait_first()

    def _use_whole_params(self, optimizer: torch.optim.Optimizer) -> Optional[str]:
        """Switch to whole parameters owned by one rank each (`zero.whole`), before any optimizer uses the rows."""
        name = type(optimizer).__name__
        if self.whole:
            return None
        if self._wrapped:  # whole parameters are right for element-wise ones too, rows are not for this one
            raise ValueError(
                f"{name} is not element-wise and needs whole parameters, but an earlier optimizer already steps row "
                f"slices; return {name} first from configure_optimizers"
            )
        zero_whole.check_not_tp_sharded(name, self.stage, [self.names[p] for p in self.names if tp_groups(p)])
        self.buckets = zero_whole.whole_buckets(self.buckets, self.world, self.rank)
        self.masters = zero_whole.whole_masters(self.buckets, self.masters, self.shard_group)
        self._full_of = {self.names[p]: p for p in self.masters}
        self._masters_root, self._state_specs = None, zero_buckets.StateDTensors(self.mesh, self.state_mesh)
        if self.prefetch is not None:  # whole parameters are gathered by their owners' broadcasts, at once
            self.prefetch.wait_all()
            self.prefetch = None
        if self._hooks:
            self._bucket_of = {p: b for b in self.buckets for p in b.params}
        self.whole = True
        return zero_whole.note(optimizer, self.stage, self.world, self.buckets)

    def masters_module(self) -> nn.Module:
        """A module tree holding the masters (stage 0: `zero.local_views`'s views), and the excluded parameters,
        under the original parameter names.

        ``torch.distributed.checkpoint.state_dict`` keys optimizer state by the names of the module that owns
        the optimizer's parameters; this gives the sharded optimizer the same keys as FSDP2's. Built once: the
        masters never change identity (loading copies into them), and the same owner every save lets
        `lightning_par.checkpoint.fast_state` replay its name mapping.
        """
        if self._masters_root is not None:
            return self._masters_root
        # Stage 0 (under tp): the plain views element-wise optimizers step, else the parameters. The excluded
        # parameters are in the optimizer as they are.
        named = ([(n, self.local_views.owner_of(p)) for p, n in self.names.items()] if self.stage == 0
                 else [(self.names[p], master) for p, master in self.masters.items()])  # fmt: skip
        self._masters_root = parameter_tree([*named, *self._excluded_names.items()])
        return self._masters_root

    def distribute_state(self, name: str, value: Any) -> Any:
        """Wrap a master's optimizer-state tensor as the ``Shard(0)`` DTensor of the full parameter, for DCP.

        Tensors shaped like the shard (``exp_avg``, momentum, ...) are sharded; scalars (``step``) are not. Under
        whole parameters a state tensor stays plain: only its owner holds (and saves) it, whole, which DCP reads
        into any layout (the owners of another world size, or one process).
        """
        if self.stage == 0:
            return self.local_views.distribute(name, value)
        full = self._full_of.get(name)
        if self.whole or full is None or not isinstance(value, torch.Tensor) or value.dim() == 0:
            return value
        return value if value.shape != self.masters[full].shape else self._state_specs.wrap(name, full, value)

    # ---- gradients -------------------------------------------------------------------------------------------
    def before_backward(self, accumulating: bool) -> None:
        """Say whether the coming backward pass is followed by more before the optimizer step (stages 0 and 1
        reduce during the one that is not)."""
        self.wait_params()  # a unit no forward waited for (its parameters unused) completes before gradients exist
        self._final = not accumulating

    def after_backward(self, accumulating: bool) -> None:
        """Reduce what a backward pass leaves to reduce.

        Args:
            accumulating: more backward passes follow before the optimizer step (gradient accumulation). Full
                gradients then keep accumulating, except under stage 2 without gradient hooks, which reduces after
                every backward so that full gradients never outlive one (the ZeRO-2 memory bound).
        """
        if not accumulating or (self.stage == 2 and not self._hooks):
            self.reduce_gradients()
        self._final = None

    def reduce_gradients(self) -> None:
        """Finish the gradient reduction of one optimizer step (after the last backward of accumulation): start
        what the backward did not (every bucket without hooks; buckets with an unused parameter, whose hook never
        fired, with zeros for it), then wait for all.

        A step whose backward reached no parameter of this rank (PipeDream-2BW's first step, whose gradient comes one
        step late) reduces nothing: one process's optimizer skips a parameter without a gradient, where a reduced
        zero would still move AdamW's moments and weight decay. Every data-parallel peer runs the same stage and
        schedule, so they skip together."""
        untouched = not self._pending and not any(b.launched or b.ready for b in self.buckets)
        if untouched and all(local_grad(p) is None for p in self.names):
            return
        for index, bucket in enumerate(self.buckets):
            if self.compression is not None:  # one bucket after another, each complete (compression.powersgd)
                flat = zero_buckets.flat_grads(bucket)
                if flat is not None:
                    self._pending.append(self.compression.reduce(index, flat, bucket, self.stage > 0, self.world))
                continue
            if self.stage == 2 and self._hooks and not bucket.ready:
                continue  # launched by its hooks (or every parameter unused: no gradient, as in one process)
            if self.stage < 2 and self._hooks and self._final and bucket.launched:
                continue  # launched during the backward
            if self.stage == 0:
                self._launch_all_reduce(bucket) if self.dp > 1 else self._all_reduce(bucket)
            else:
                self._launch(bucket)
        self._drain(0)
        for bucket in self.buckets:
            bucket.launched, bucket.ready = False, 0
        if self.compression is not None:
            self.compression.step_done()

    def _on_grad_ready(self, p: torch.Tensor) -> None:
        if self.stage < 2 and not self._final:
            return  # full gradients keep accumulating until the backward that ends the accumulation
        bucket = self._bucket_of[p]  # type: ignore[index]
        bucket.ready += 1
        if bucket.ready == len(bucket.params):
            if self.stage == 0:
                self._launch_all_reduce(bucket)
            else:
                self._launch(bucket)
            self._drain(_MAX_INFLIGHT)

    def _all_reduce(self, bucket: Bucket) -> None:
        if self.dp == 1:
            # Nothing to average (tensor parallelism alone): only settle Partial tensor-parallel gradients.
            settle_grads(bucket.params)
            self.local_views.hand_grads(bucket.params)
            return
        flat = zero_buckets.flat_grads(bucket)
        if flat is None:
            return
        dist.all_reduce(flat, group=self.shard_group)
        if self.reduce_replicas:
            dist.all_reduce(flat, group=self.replicate_group)
        flat.div_(self.dp)
        self.local_views.set_full_grads(bucket.params, bucket.data, flat)

    def _launch_all_reduce(self, bucket: Bucket) -> None:
        """Stage 0: pack the bucket's gradients into one flat tensor and start its all-reduce without waiting."""
        bucket.ready, bucket.launched = 0, True
        flat = zero_buckets.flat_grads(bucket)
        if flat is None:
            return
        work = dist.all_reduce(flat, group=self.shard_group, async_op=True)
        self._pending.append((work, bucket, flat))

    def _launch(self, bucket: Bucket) -> None:
        """Pack the bucket's gradients, free them, and start the reduce-scatter without waiting for it."""
        bucket.ready, bucket.launched = 0, True
        dtype = bucket.params[0].dtype
        settle_grads(bucket.params)
        if self.dp == 1:  # one data-parallel rank: the reduction is the identity (zero_buckets.hand_over)
            zero_buckets.hand_over(bucket, self.masters, dtype)
            return
        packed = bucket.pack([local_grad(p) for p in bucket.params], self.world, dtype)
        for p in bucket.params:
            p.grad = None  # the full gradient is not needed again: this is where ZeRO saves gradient memory
        out = torch.empty(bucket.shard_numel, dtype=dtype, device=packed.device)
        work = _reduce_scatter(out, packed.view(-1), group=self.shard_group, async_op=True)
        self._pending.append((work, bucket, out))

    def _drain(self, keep: int) -> None:
        """Wait for reductions in flight until at most ``keep`` remain, and hand their shards to the masters."""
        while len(self._pending) > keep:
            work, bucket, out = self._pending.pop(0)
            work.wait()
            if self.compression is None:  # PowerSGD hands back the mean over every data-parallel rank
                if self.reduce_replicas:
                    dist.all_reduce(out, group=self.replicate_group)
                if self.dp > 1:
                    out.div_(self.dp)
            if self.stage == 0:  # the all-reduced full gradients go back to the parameters
                self.local_views.set_full_grads(bucket.params, bucket.data, out)
                continue
            for p, shard in zip(bucket.mine, bucket.shard_views(out)):
                master = self.masters[p]
                if master.grad is None:
                    master.grad = shard
                else:
                    master.grad.add_(shard)

    # ---- parameters ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def gather_params(self, defer: bool = False) -> None:
        """All-gather the updated shards so every rank holds the full parameters again.

        Args:
            defer: when `defer_gather` is on, start the gather and return; the next forward waits for it.
        """
        if self.prefetch is not None and self.prefetch.enabled:
            if defer:
                self.prefetch.launch(_all_gather)
                return
            self.prefetch.wait_all()
        if self.world == 1:
            return  # every row is this rank's, and its masters are views of them: the step already wrote them
        zero_buckets.gather_buckets(self.buckets, self.masters, self.world, self.shard_group, _all_gather)
