"""Private torch APIs read while training runs: how a pipeline schedule waits and acts (the pipeline trace,
`lightning_par.analysis`), and what the watchdog reads of a stuck rank (`lightning_par.guards`). Each accessor names
the API and the torch versions it was checked on; tests/_private_apis.py probes every one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as dist


# ---- torch: the job's store, group sequence numbers, FSDP2's parameter groups ------------------------------------
def default_store() -> Any:
    """The key-value store the default process group was built on (torchrun's, or rank 0's): the watchdog's
    heartbeats and reports travel through it, apart from the collectives they watch."""
    # distributed_c10d._get_default_store, torch 2.11 + 2.13.
    return dist.distributed_c10d._get_default_store()


def group_sequence_number(group: Any) -> Optional[int]:
    """How many collectives ``group`` has issued on this rank (``None`` where the backend does not count)."""
    # ProcessGroup._get_sequence_number_for_group, torch 2.11 + 2.13 (gloo and NCCL count; the flight recorder's key).
    try:
        return int(group._get_sequence_number_for_group())
    except (AttributeError, RuntimeError):
        return None


def flight_recorder() -> Optional[dict[str, Any]]:
    """torch's flight recorder of this process's collectives (``None`` where this torch has none): ``pg_status``
    (per group name: the last enqueued / started / completed collective) and ``entries`` (per collective: its group
    ``process_group`` = (name, description), ``collective_seq_id``, ``profiling_name`` such as ``gloo:all_gather``,
    ``input_sizes``, ``state``, ``time_created_ns``). Recorded only with ``TORCH_FR_BUFFER_SIZE`` > 0 when the groups
    were made."""
    # torch._C._distributed_c10d._dump_fr_trace, torch 2.13 (2.11: _dump_nccl_trace, NCCL only): pickled dict.
    import pickle

    from torch._C import _distributed_c10d as c10d

    dump = getattr(c10d, "_dump_fr_trace", None) or getattr(c10d, "_dump_nccl_trace", None)
    if dump is None:
        return None
    try:
        return dict(pickle.loads(dump(True, False, False)))  # torch's own dump of this process
    except Exception:  # not enabled, or nothing recorded on this backend
        return None


def fsdp_group_name(param_group: Any) -> Optional[str]:
    """The module path of an FSDP2 parameter group (``None`` for another object)."""
    # FSDPParamGroup._module_fqn, torch 2.11 + 2.13: the prefixed module name FSDP2 labels its profiler ranges with.
    return getattr(param_group, "_module_fqn", None)


# ---- torch: pipelining (benchmarks) ------------------------------------------------------------------------------
def pipeline_p2p_wait() -> Callable[[list[Any]], None]:
    """The function every torch pipeline schedule waits on its point-to-point transfers through."""
    # torch.distributed.pipelining.schedules._wait_batch_p2p, torch 2.11 + 2.13.
    from torch.distributed.pipelining import schedules

    return schedules._wait_batch_p2p


def set_pipeline_p2p_wait(fn: Callable[[list[Any]], None]) -> None:
    """Make every torch pipeline schedule wait on its transfers through ``fn`` (see `pipeline_p2p_wait`)."""
    from torch.distributed.pipelining import schedules

    schedules._wait_batch_p2p = fn  # type: ignore[assignment]


# PipelineSchedule*._step_microbatches, torch 2.11 + 2.13: the method that runs a step's actions; its frame's locals
# (``action``; ``fwd_mb_index`` / ``bwd_mb_index`` and ``self._stage`` in single-stage schedules) say where it is.
SCHEDULE_STEP = "_step_microbatches"


def schedule_stage(schedule: Any) -> Any:
    """A single-stage torch schedule's stage (``None`` for a multi-stage one)."""
    # PipelineScheduleSingle._stage, torch 2.11 + 2.13.
    return getattr(schedule, "_stage", None)


def pipeline_order(schedule: Any) -> dict[int, list[Any]]:
    """A torch schedule's action table ``{rank: [action or None, ...]}``, as `analysis.pipeline_timeline` replays."""
    # PipelineSchedule*.pipeline_order, torch 2.11 + 2.13: set in __init__, undocumented.
    return schedule.pipeline_order


def schedule_rank_actions(schedule: str, local_stages: int, pp: int, microbatches: int, rank: int) -> list[Any]:
    """The action list torch's multi-stage schedule ``schedule`` (``"interleaved_1f1b"``, ``"looped_bfs"``,
    ``"interleaved_zb"``, ``"zbv"``, ``"dualpipev"``) builds for pipeline rank ``rank``: no stages, no process group
    (the planner replays it for the bubble, `lightning_par.planner.steptime`)."""
    from types import SimpleNamespace

    from torch.distributed.pipelining import schedules as s

    cls: Any = {"interleaved_1f1b": s.ScheduleInterleaved1F1B, "looped_bfs": s.ScheduleLoopedBFS,
           "interleaved_zb": s.ScheduleInterleavedZeroBubble, "zbv": s.ScheduleZBVZeroBubble,
           "dualpipev": s.ScheduleDualPipeV}[schedule]  # fmt: skip
    rounds = max(1, microbatches // pp)
    # PipelineScheduleMulti subclasses' _calculate_single_rank_operations(self, rank), torch 2.11 + 2.13: a pure
    # function of these attributes, which each class's __init__ sets from its stages (unused here beyond their count).
    state = SimpleNamespace(n_local_stages=local_stages, pp_group_size=pp, _n_microbatches=microbatches,
                            num_stages=local_stages * pp, _stages=[None] * local_stages, number_of_rounds=rounds,
                            microbatches_per_round=microbatches // rounds)  # fmt: skip
    return list(cls._calculate_single_rank_operations(state, rank))
