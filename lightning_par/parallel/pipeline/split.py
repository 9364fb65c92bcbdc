"""Cut a model into this rank's pipeline stages: the first step of `compose.parallelize` under ``pp > 1``.

torchtitan's order: cut the model into stages first, then parallelize each stage like a model of its own. The cut
balances the trunk's blocks over ``pp x virtual`` stages by cost (`lightning_par.parallel.pipeline.partition`, the
embedding's
and head's cost charged to the end stages), removes what other stages own (`pipeline.PipelineModel`), and gives
the rest as `ModelPart`s. Its own hooks (the stage dispatch around each owned block's forward and the probe that
stops at the trunk's entry) go on last, `PipelineSplit.install`, outside every wrapping the other techniques add:
activation checkpointing's recomputed region and FSDP2's pre-forward hooks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_par.blocks.trunk import Trunk
from lightning_par.parallel.parts import ModelPart
from lightning_par.parallel.pipeline.cuts import no_split_possible
from lightning_par.parallel.pipeline.owners import find_ownership
from lightning_par.parallel.pipeline.partition import param_costs, partition
from lightning_par.parallel.pipeline.schedule import (
    PipelineRunner,
    Shape,
    check_schedule,
    end_ranks,
    local_stages,
    n_stages,
)
from lightning_par.parallel.pipeline.stages import PipelineError, PipelineModel
from lightning_par.parallel.pipeline.tied import OnEveryStage, TiedWeights, tie_group


@dataclasses.dataclass
class PipelineSplit:
    """This rank's stages of a cut model, and what its runner is built from once the stages are laid out.

    Args:
        model: the cut model (`PipelineModel`).
        parts: one `ModelPart` per stage this rank runs, in stage order.
        tied: on an end stage's rank of a model with a weight used before and after the trunk, its two copies.
        schedule, group, microbatches, vpp: the runner's (`PipelineRunner`).
        everywhere: parameters directly on a module that contains the trunk, held by every stage.
    """

    model: PipelineModel
    parts: list[ModelPart]
    tied: Optional[TiedWeights]
    schedule: str
    group: dist.ProcessGroup
    microbatches: int
    everywhere: Optional[OnEveryStage] = None
    vpp: Optional[int] = None

    def mark_replicas(self, masters: Optional[dict[nn.Parameter, nn.Parameter]] = None) -> None:
        """Once ZeRO built its masters: the copies the gradient norm must not count again (a tied weight's second
        copy, the parameters every stage holds, off their first rank)."""
        for held in (self.tied, self.everywhere):
            if held is not None:
                held.mark_replicas(masters)

    def install(self, wire_shape: Optional[Callable[[Shape], Shape]] = None) -> PipelineRunner:
        """Put the stage dispatch and the trunk-entry probe on the owned blocks, after every other wrapping, and
        return the runner of the steps.

        Args:
            wire_shape: the hidden state's shape between stages from its shape entering the trunk (context
                parallelism: this rank's sequence chunks); default the same.
        """
        self.model.install()
        self.model.install_probe_hooks()
        return PipelineRunner(self.model, self.schedule, self.group, self.microbatches, tied=self.tied,
                              wire_shape=wire_shape, everywhere=self.everywhere, vpp=self.vpp)  # fmt: skip


def _outer_cost(modules: Sequence[nn.Module]) -> float:
    # An embedding lookup costs no FLOPs; a head's matmul costs as much as its parameter count says.
    return float(
        sum(p.numel() for m in modules for sub in m.modules() if not isinstance(sub, nn.Embedding)
            for p in sub.parameters(recurse=False))
    )  # fmt: skip


def split_pipeline(
    module: nn.Module,
    trunk: Trunk,
    *,
    schedule: str,
    pp: int,
    pp_rank: int,
    group: dist.ProcessGroup,
    microbatches: int,
    device: torch.device,
    split: Optional[Sequence[int]] = None,
    costs: Optional[Sequence[float]] = None,
    timeout: Optional[timedelta] = None,
    vpp: Optional[int] = None,
) -> PipelineSplit:
    """Cut ``module`` in place for pipeline rank ``pp_rank``; return its stages (`PipelineSplit.install` gives the
    runner of its steps).

    Args:
        module: the user's module (on ``device``); blocks and outer modules of other stages are removed.
        trunk: its trunk.
        schedule: a key of `lightning_par.parallel.pipeline.schedule.SCHEDULES`.
        pp: pipeline ranks; ``pp_rank``: this rank's index among them; ``group``: their process group.
        microbatches: microbatches per training step.
        device: this rank's device.
        split: blocks per stage, by hand (``pp x virtual`` counts); overrides ``costs``.
        costs: one cost per block (default: parameter counts;
        `lightning_par.parallel.pipeline.partition.measure_block_times`
            measures times).
        timeout: collective timeout of the group that sums tied weights' gradients (default: the backend's).
        vpp: stages per rank of a looped interleaved schedule (default: the schedule's).
    """
    # Decided on the whole model, before the cut: who runs before and after the trunk, and whether a block runs
    # more than once (one layer called at every depth, ALBERT's): then the stages cut the trunk's calls.
    own = find_ownership(module, trunk)
    trunk = own.calls or trunk
    check_schedule(schedule, pp, microbatches, len(trunk.blocks), vpp)
    block_costs = list(costs) if costs is not None else param_costs(trunk.blocks)
    if len(block_costs) != len(trunk.blocks):
        raise PipelineError(f"pp_costs has {len(block_costs)} entries but the trunk has {len(trunk.blocks)} blocks")
    stages = n_stages(schedule, pp, vpp)
    if (why := no_split_possible(own.cut_conflicts, trunk.names, stages)) is not None:
        raise PipelineError(why)
    ranges = partition(
        block_costs, stages, first_extra=_outer_cost([m for _, m in own.pre]),
        last_extra=_outer_cost([m for _, m in own.post]), split=split, forbidden=own.cut_conflicts,
    )  # fmt: skip
    model = PipelineModel(module, trunk, ranges, local_stages(schedule, pp, pp_rank, vpp), device, own)
    first, last = end_ranks(schedule, group, vpp)
    tied = None
    if own.tied and first != last:
        tie = tie_group(first, last, timeout)
        if tie is not None:  # this rank runs an end stage
            tied = TiedWeights(module, own.tied, tie, first, not model.owns_first)
            tied.sync_values()
    # Each block this rank holds in one part: a block that runs more than once (held by every stage) in the first.
    parts: list[ModelPart] = []
    placed: set[str] = set()
    for stage in model.stage_modules():
        names = [trunk.names[i] for i in range(stage.spec.start, stage.spec.end)]
        names += list(model.shared) if not parts else []
        blocks = {n: module.get_submodule(n) for n in names if n not in placed}
        placed |= set(blocks)
        parts.append(ModelPart(stage, tuple(blocks.items()), whole_trunk=False))
    everywhere = None
    if own.everywhere:  # a parameter on a module that contains the trunk: on every stage, gradients summed
        everywhere = OnEveryStage(module, own.everywhere, group, model.owns_first)
        everywhere.sync_values()
    return PipelineSplit(model, parts, tied, schedule, group, microbatches, everywhere, vpp)
