"""What `tests/_worker.py` reads off a strategy after a job's fit for its result: the auto planner's choice, ZeRO's
deferred all-gather statistics, whole expert weights gathered over expert parallelism, DeepSpeed's batch sizes,
FSDP2's parameter groups, and objects gathered from every rank."""

from __future__ import annotations

from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist

import lightning_par


def auto_choice(strategy: Any) -> dict[str, Any] | None:
    from lightning_par.strategies.auto import AutoParallelStrategy, explain

    if not isinstance(strategy, AutoParallelStrategy) or strategy.ranking is None:
        return None
    return {
        "chosen": strategy.chosen,
        "top": explain(strategy.ranking),
        "n_feasible": len(strategy.ranking.feasible),
        "ruled_out": [why for _, why in strategy.ranking.infeasible],
    }


def prefetch_stats(strategy: Any) -> dict[str, Any] | None:
    """ZeRO-1/2's deferred all-gather: how often it was deferred and where it was waited for, and the units."""
    zero = getattr(getattr(strategy, "parallel_run", None), "zero", None)
    prefetch = getattr(zero, "prefetch", None)
    if prefetch is None:
        return None
    group = prefetch.group
    return {**prefetch.stats, "enabled": prefetch.enabled, "units": len(prefetch.units),
            "default_group": group is dist.group.WORLD, "group_ranks": dist.get_process_group_ranks(group)}  # fmt: skip


def gather_experts(trainer: L.Trainer, model: torch.nn.Module, params: dict[str, torch.Tensor]) -> None:
    """Replace the local expert shards in ``params`` by the full stacked weights (all-gathered over ep); add the
    ``nn.ModuleList`` experts other ep ranks hold, under their names."""
    experts = getattr(getattr(trainer.strategy, "parallel_run", None), "experts", None)
    if experts is None or experts.mesh is None:
        return
    group = experts.mesh.ep.get_group()
    names = {p: n for n, p in model.named_parameters()}
    whole = {names[p]: p.detach().float().cpu() for n, p in experts.names.items() if n not in experts._full_shapes}
    held: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(held, whole, group=group)
    for part in held:
        params.update(part)
    for n, p in experts.names.items():
        if n not in experts._full_shapes:
            continue
        local = p.detach().contiguous()
        if n in experts.tp_dims:  # etp = tp: the hidden width split over tp first
            slices = [torch.empty_like(local) for _ in range(dist.get_world_size(experts.tp_group))]
            dist.all_gather(slices, local, group=experts.tp_group)
            local = torch.cat(slices, dim=experts.tp_dims[n]).contiguous()
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local, group=group)
        params[names[p]] = torch.cat(parts).float().cpu()


def ds_batch(strategy: Any) -> Optional[tuple[int, int, int]]:
    """DeepSpeed's (micro batch per rank, train batch size, throughput timer's batch size), or ``None``."""
    if not isinstance(strategy, lightning_par.DeepSpeedParallelStrategy) or strategy._engine is None:
        return None
    engine = strategy.engine
    return engine.train_micro_batch_size_per_gpu(), engine.train_batch_size(), engine.tput_timer.batch_size


def fsdp_groups(strategy: Any) -> int:
    """FSDP2 parameter groups (one reduce-scatter each per reduction) on this rank, pipeline stages included."""
    from torch.distributed.fsdp import FSDPModule

    run = strategy.parallel_run
    roots = run.pipeline.model.stage_modules() if run.pipeline is not None else [strategy.model]
    units = {id(m): m for r in roots for m in r.modules() if isinstance(m, FSDPModule)}
    return sum(m._get_fsdp_state()._fsdp_param_group is not None for m in units.values())  # type: ignore[operator]


def as_dict(report: Any) -> Any:
    import dataclasses

    return dataclasses.asdict(report) if report is not None else None


def gathered_objects(obj: Any) -> list[Any]:
    if not dist.is_initialized():
        return [obj]
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, obj)
    return every
