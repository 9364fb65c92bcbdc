"""The pipeline's pre-flight: each rank runs each of its stages once on the shapes it will receive, before the
schedule's first step.

A stage whose code fails on the real shapes is refused here, on every rank of the group, naming the stage and the
error, instead of mid-step with the other ranks left waiting in a receive; what the stages measured gives the shape
and dtype of each side output of the trunk (`pipeline.sides`), which the schedule's buffers need.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from lightning_par.parallel.pipeline.stages import PipelineError, PipelineModel

Shape = tuple[int, ...]


def preflight(
    model: PipelineModel, shapes: list[Shape], dtype: torch.dtype, group: dist.ProcessGroup
) -> dict[int, tuple[Shape, torch.dtype]]:
    """Run every stage once, in stage order, without gradients, on zeros of the shapes it receives (the hidden state,
    and the side tensors the stages before it measured), to its last block.

    Args:
        model: the cut model.
        shapes: the hidden state's shape entering each trunk block, as sent between stages.
        dtype: the hidden state's dtype.
        group: the pipeline group; every rank of it calls this (the outcome is gathered).

    Returns:
        each side output's slot -> (shape, dtype), from whichever rank's stage produced it.

    Raises:
        PipelineError: on every rank, when a stage of any rank failed, or a side output the code after the trunk
            reads was never produced.
    """
    device = model.device
    found: dict[int, tuple[Shape, torch.dtype]] = {}
    carrier = model.sides
    mine = {mod.spec.index: mod for mod in model.stage_modules()}
    # Stage by stage, so that each receives zeros of the side tensors its predecessor measured (a bias split by tp
    # heads has this rank's shape, not the whole model's): one gather of what each stage measured per stage.
    for index in range(model.n_stages):
        made: dict[int, tuple[Shape, torch.dtype]] = {}
        failed = ""
        mod = mine.get(index)
        if mod is not None:
            spec = mod.spec
            received = torch.zeros(shapes[spec.start], dtype=dtype, device=device)
            ins = carrier.before(spec.start) if carrier is not None and not spec.is_first else []
            sides = [torch.zeros(found[k][0], dtype=found[k][1], device=device) for k in ins if k in found]
            try:
                mb = torch.zeros(1, dtype=torch.long, device=device)
                with model.shape_pass(), torch.no_grad(), \
                        torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):  # fmt: skip
                    made = mod(*(() if spec.is_first else (received, *sides)), mb=mb)
            except Exception as err:  # one message for the whole group, below
                names = model.trunk.names
                failed = (f"stage {index} ({names[spec.start]} .. {names[spec.end - 1]}, receiving "
                          f"{tuple(received.shape)}) fails: {type(err).__name__}: {err}")  # fmt: skip
        every: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(every, (made, failed), group=group)
        if errors := [f for _, f in every if f]:
            how = model.ownership.reason if model.ownership.source != "probe" else ""
            fix = (f"the probe of the forward could not run ({how}): give the LightningModule an example_input_array "
                   "of a real input" if how else "train this model without pipeline parallelism (e.g. "
                   "strategy='zero3')")  # fmt: skip
            raise PipelineError(f"the pipeline's pre-flight (each stage once on the shapes it receives) failed: "
                                f"{errors[0]}; {fix}")  # fmt: skip
        for d, _ in every:
            found.update(d)
    side = found
    missing = [carrier.slots[k].name for k in range(len(carrier.slots)) if k not in side] if carrier else []
    if missing:
        raise PipelineError(
            f"{missing[0]} did not run when the pipeline measured its side output, but code after the trunk read "
            "what it returned when the pipeline probed the model; train this model without pipeline parallelism "
            "(e.g. strategy='moe' or 'zero3')"
        )
    return side
