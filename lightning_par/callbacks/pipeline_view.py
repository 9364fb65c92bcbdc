"""The pipeline's measured step for `ParallelismMonitor`: its bubble as metrics, and its timeline as a picture.

Both come from the latest training step's `lightning_par.parallel.pipeline.trace.StepRecord` of each rank (the
schedule's own actions and point-to-point waits), so they show the step that was just logged, not a model of it.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist

from lightning_par.parallel.pipeline.trace import StepRecord


def step_record(trainer: Any) -> Optional[StepRecord]:
    """This rank's latest pipeline training step, or ``None`` without a pipeline (or before its first step)."""
    run = getattr(trainer.strategy, "parallel_run", None)
    pipeline = getattr(run, "pipeline", None)
    return pipeline.trace.last if pipeline is not None else None


def bubble_metrics(record: StepRecord, device: torch.device) -> dict[str, float]:
    """``pipe/bubble`` (this rank's waiting over its step time), ``pipe/bubble_mean`` and ``pipe/bubble_max_rank``
    over all ranks, and ``pipe/step_ms``. Collective over the world when it is distributed."""
    mine = record.bubble
    total, most = mine, mine
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        values = torch.tensor([mine, mine], dtype=torch.float64, device=device)
        dist.all_reduce(values[:1], op=dist.ReduceOp.SUM)
        dist.all_reduce(values[1:], op=dist.ReduceOp.MAX)
        total, most = values[0].item() / dist.get_world_size(), values[1].item()
    return {"pipe/bubble": mine, "pipe/bubble_mean": total, "pipe/bubble_max_rank": most,
            "pipe/step_ms": record.duration * 1e3}  # fmt: skip


def gather_records(record: StepRecord) -> list[StepRecord]:
    """Every rank's record, in global-rank order (collective over the world)."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return [record]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, record)
    return every
