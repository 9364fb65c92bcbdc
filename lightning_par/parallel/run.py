"""`ParallelRun`: everything a parallelized model needs after set-up, in one object.

`compose.parallelize` builds it; the strategy (Trainer glue, or any other loop) only calls it and re-derives no
rule of its own. What a technique needs at run time is a hook here:

| hook | who acts |
|---|---|
| `wrap_optimizer` | ZeRO 1-2 points the optimizer at this rank's shards; ZeRO-3 refuses one that cannot step DTensors |
| `defer_param_gather`, `before_forward`, `wait_params` | ZeRO 1-2 gathers parameters during the next forward |
| `before_backward` | ZeRO 0-2 learns whether the backward ends an accumulation (then it reduces during it) |
| `after_backward` | ZeRO 0-2 reduces gradients (when: the engine's rule); experts reduce expert gradients |
| `optimizer_owner`, `distribute_model` | ZeRO 1-2 and experts describe their shards as DTensors (checkpoints) |
| `merge_param_groups`, `other_stage_keys` | checkpoint entries of a pipeline (and whole-parameter ZeRO) span ranks |
| `norm_groups` | a pipeline: the gradient norm sums over the stages |
| `pipeline` | a pipeline runs the training / evaluation step through its schedule |

No Lightning here.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.parallel.experts.apply import ExpertParallel
from lightning_par.parallel.optimizers import check_dtensor_step, prefer_foreach_on_dtensors
from lightning_par.parallel.pipeline.schedule import PipelineRunner
from lightning_par.parallel.zero.replicated import ReplicatedZero
from lightning_par.parallel.zero.scalars import ScalarGrads

Distribute = Callable[[str, Any], Any]  # (qualified name, tensor) -> the tensor as its DTensor, for checkpoints


@dataclasses.dataclass
class ParallelRun:
    """What `lightning_par.parallel.compose.parallelize` built.

    Args:
        model: the module the trainer calls (the user's module, or a `StepRoot` around it under ZeRO-3).
        module: the user's module (parameter names, checkpoints).
        zero: the ZeRO 0-2 engine, or ``None`` under ZeRO-3 (FSDP2 reduces in its own hooks).
        experts: the expert parallelism, or ``None`` when the model has no MoE layer.
        pipeline: the runner of pipeline steps when ``pp > 1``.
        norm_groups: groups over which ranks hold different parameters altogether (pipeline stages): the gradient
            norm sums its squares over them too.
        notes: start-up log lines of set-up (meta-device construction, pretrained weights read).
        scalars: the 0-dim parameters, whole on every rank, with their gradient averaging (`zero.scalars`).
    """

    model: nn.Module
    module: nn.Module
    zero: Optional[ReplicatedZero] = None
    experts: Optional[ExpertParallel] = None
    pipeline: Optional[PipelineRunner] = None
    norm_groups: tuple[dist.ProcessGroup, ...] = ()
    notes: tuple[str, ...] = ()
    scalars: Optional[ScalarGrads] = None

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer) -> list[str]:
        """Make an optimizer built over the module's parameters step on this rank's shards (in place).

        Returns:
            lines for the start-up log (how ZeRO-1/2 step an optimizer that is not element-wise).

        Raises:
            ValueError: the optimizer cannot be right on this layout, naming the fix.
        """
        if self.zero is None:  # ZeRO-3: FSDP2's DTensor parameters
            check_dtensor_step(optimizer, "zero_stage=3 (FSDP2)")
            prefer_foreach_on_dtensors(optimizer)
            return []
        if self.zero.stage == 0 and any(isinstance(p, DTensor) for g in optimizer.param_groups for p in g["params"]):
            check_dtensor_step(  # stage 0 steps the tensor-parallel DTensors themselves
                optimizer, "tensor parallelism", "Use tp=1, or an element-wise optimizer such as AdamW"
            )
            prefer_foreach_on_dtensors(optimizer)
        line = self.zero.shard_optimizer(optimizer)
        return [line] if line else []

    def defer_param_gather(self, on: bool) -> bool:
        """Let ZeRO 1-2 start the parameter all-gather after each optimizer step and return at once, each trunk
        block waiting for its weights when its forward starts (`lightning_par.parallel.zero.prefetch`).

        The caller then owes the contract: `before_forward` at every training step's start, and `wait_params`
        before anything else reads the weights. Returns whether the deferral is on (ZeRO 1-2 over dp_shard > 1,
        one optimizer stepping row slices, no pipeline: a schedule calls the stages itself).
        """
        return self.zero is not None and self.pipeline is None and self.zero.defer_gather(on)

    def before_forward(self) -> Any:
        """At a training step's start: the weights outside the trunk blocks are complete on return. Returns the
        context manager to run the step's forward in."""
        return self.zero.before_forward() if self.zero is not None else contextlib.nullcontext()

    def wait_params(self) -> None:
        """Complete a deferred parameter all-gather (before anything outside the forward reads the weights)."""
        if self.zero is not None:
            self.zero.wait_params()

    def before_backward(self, accumulating: bool) -> None:
        """Tell the ZeRO 0-2 engine whether the coming backward ends an accumulation (it then reduces each bucket
        as soon as its gradients are final, overlapping the rest of the backward)."""
        if self.zero is not None:
            self.zero.before_backward(accumulating)

    def after_backward(self, accumulating: bool) -> None:
        """Reduce gradients after a backward pass, before clipping and ``on_before_optimizer_step`` see them.

        Args:
            accumulating: more backward passes follow before the optimizer step (gradient accumulation).
        """
        if self.zero is not None:
            self.zero.after_backward(accumulating)
        if self.experts is not None and not accumulating:
            self.experts.reduce_gradients()
        if self.scalars is not None and not accumulating:
            self.scalars.reduce()

    def optimizer_owner(self) -> tuple[nn.Module, Optional[Distribute]]:
        """The module whose parameter names key the optimizer's state, and how to wrap that state for DCP."""
        owner, distribute = self.module, cast(Optional[Distribute], None)
        if self.zero is not None and (self.zero.stage >= 1 or self.zero.local_views.views):
            owner, distribute = self.zero.masters_module(), self.zero.distribute_state
        if self.experts is not None and self.experts.params:
            distribute = self.experts.distribute_then(distribute)
        if self.pipeline is not None and self.pipeline.tied is not None:  # a tied weight's copy: one name
            owner = self.pipeline.tied.optimizer_owner(owner)
        return owner, distribute

    def distribute_model(self) -> Optional[Distribute]:
        """How to wrap model tensors that are plain shards (expert shards) as DTensors, or ``None``."""
        # As DTensors, DCP saves every rank's experts, not rank 0's alone.
        return self.experts.distribute if self.experts is not None and self.experts.params else None

    def one_process_names(self) -> dict[str, str]:
        """Parameter names this rank holds under another name than one process gives them -> that name (the last
        pipeline stage's copy of a tied weight), so that copies of one weight can be matched across ranks."""
        tied = self.pipeline.tied if self.pipeline is not None else None
        return tied.renames if tied is not None else {}

    def merge_param_groups(self, state: dict[str, Any]) -> dict[str, Any]:
        """The optimizer state with every pipeline rank's parameter names in its ``param_groups``.

        A checkpoint keeps one copy of non-tensor entries, so each rank's groups (listing only its own stage's
        parameters) would overwrite the others'; merged, every rank finds its parameters' hyperparameters on load.
        Groups are matched by their hyperparameters, so a stage without some group is fine. The same holds over
        ``dp_shard`` when ZeRO-1/2 step whole parameters (each rank's groups list the parameters it owns). Collective
        over those groups; the state unchanged without either.
        """
        groups = [self.zero.shard_group] if self.zero is not None and self.zero.whole and self.zero.world > 1 else []
        groups += [self.pipeline.group] if self.pipeline is not None else []
        for over in groups:  # dp_shard first: a stage's merged groups are then merged over the stages
            state = {**state, "param_groups": _merged_groups(state["param_groups"], over)}
        return state

    def other_stage_keys(self) -> frozenset[str]:
        """Checkpoint keys (``state_dict.<name>``) of the parameters and buffers other pipeline ranks hold, and of
        the ``nn.ModuleList`` experts other ep ranks hold.

        Collective over the pipeline group; only the experts' keys without a pipeline.
        """
        remote = self.experts.remote_keys if self.experts is not None else frozenset()
        if self.pipeline is None:
            return remote
        mine = {f"state_dict.{k}" for k in self.module.state_dict()}
        every: list[Any] = [None] * dist.get_world_size(self.pipeline.group)
        dist.all_gather_object(every, mine, group=self.pipeline.group)
        return frozenset(set().union(*every) - mine) | remote

    def describe(self) -> list[str]:
        """Lines for the start-up log (the pipeline's stages, how the weights were made)."""
        return ([self.pipeline.describe()] if self.pipeline is not None else []) + list(self.notes)


def _merged_groups(param_groups: list[dict[str, Any]], group: dist.ProcessGroup) -> list[dict[str, Any]]:
    every: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(every, param_groups, group=group)
    merged: dict[str, dict[str, Any]] = {}
    for groups in every:
        for g in groups:
            key = repr(sorted((k, v) for k, v in g.items() if k != "params"))
            if key not in merged:
                merged[key] = {**g, "params": []}
            merged[key]["params"] += [p for p in g["params"] if p not in merged[key]["params"]]
    return list(merged.values())
