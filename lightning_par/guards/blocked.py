"""What a rank's main thread is blocked in, read off its Python stack from another thread.

A rank stuck in a collective sits in a C++ wait whose Python caller is still on the stack: the collective's entry
point in ``torch.distributed`` (its ``group`` among the frame's locals), FSDP2's wait for an all-gather (the
parameter group it waits for), a pipeline schedule's wait on a point-to-point transfer (the schedule's own locals
name the action: stage, microbatch, forward or backward, and the source line names the transfer), or the data
loader's ``__next__``. Reading the stack costs nothing while training runs: it is read only when a step has
already overrun (`lightning_par.guards.watchdog`). Each group is named by the mesh dimension it belongs to
(``dp_shard``, ``tp``, ``pp``, ``ep``, ``cp``, ...) when the strategy told its names, else by its ranks; its
sequence number (collectives issued on it so far, ```lightning_par._compat.group_sequence_number```) tells ranks
that reached the same collective from those that did not.
"""

from __future__ import annotations

import dataclasses
import linecache
import os
import re
import sys
import threading
from collections.abc import Mapping
from types import FrameType
from typing import Any, Optional

import torch.distributed as dist

from lightning_par import _compat

_DIST = os.path.join("torch", "distributed", "")
_DATA = os.path.join("torch", "utils", "data", "")
_DESC = re.compile(r'desc="([a-z_]+)"')


@dataclasses.dataclass
class Blocked:
    """Where one rank is: a collective (``op`` on ``group``, its ``seq`` there), a pipeline action, the data loader,
    or plain code (``where``). JSON-friendly: reports travel through the job's store."""

    rank: int
    op: str = ""  # the torch.distributed function, or "data loader"
    group: str = ""  # the group's name (mesh dimension) or its ranks
    ranks: list[int] = dataclasses.field(default_factory=list)  # the group's global ranks
    seq: Optional[int] = None
    action: str = ""  # under a pipeline: "stage 1 forward microbatch 3: fwd_recv from rank 0"
    where: str = ""  # the innermost frame of the library or the user's code: file:line function
    step: Optional[int] = None
    seconds: float = 0.0  # how long the step has run
    recorder: str = ""  # the last collectives torch's flight recorder saw on this rank, per group

    def line(self) -> str:
        """One line for the report."""
        what = self.op or "running"
        if self.group:
            what += f" on {self.group} (ranks {self.ranks}, collective #{self.seq})" if self.seq is not None else (
                f" on {self.group} (ranks {self.ranks})")  # fmt: skip
        if self.action:
            what += f"; pipeline: {self.action}"
        step = f"step {self.step}, {self.seconds:.0f} s in" if self.step is not None else "outside a training step"
        recorded = f"; last collectives (flight recorder): {self.recorder}" if self.recorder else ""
        return f"rank {self.rank} ({step}): {what} at {self.where}{recorded}"


def group_names(meshes: Any) -> dict[Any, str]:
    """Each process group of the ``DeviceMesh`` objects among ``meshes``' attributes (a
    `lightning_par.mesh.ParallelMesh`, its expert view included) -> the mesh dimension it is (``dp_shard``, ``tp``,
    ``pp``, ``ep``; flattened ones such as ``dp`` too). The first name found for a group wins (the root mesh's)."""
    names: dict[Any, str] = {}
    pending: list[Any] = [meshes]
    while pending:
        obj = pending.pop(0)
        dims = getattr(obj, "mesh_dim_names", None)
        if dims:
            for i, dim in enumerate(dims):
                try:
                    names.setdefault(obj.get_group(i), dim)
                except Exception:  # a dimension this rank holds no group for
                    continue
        elif dataclasses.is_dataclass(obj):
            pending += [getattr(obj, f.name) for f in dataclasses.fields(obj)]
    return names


def _groups_in(frame: FrameType) -> list[Any]:
    """Process groups a frame holds: its locals, and the groups of ``self`` that FSDP2 and pipeline stages keep."""
    found = [v for v in frame.f_locals.values() if isinstance(v, dist.ProcessGroup)]
    owner = frame.f_locals.get("self")
    if owner is not None and not found:
        mesh_info = getattr(owner, "mesh_info", None)
        for candidate in (getattr(mesh_info, "shard_process_group", None), getattr(owner, "group", None)):
            if isinstance(candidate, dist.ProcessGroup):
                found.append(candidate)
    return found


def _pipeline_action(frames: list[FrameType]) -> str:
    """The schedule's current action and transfer, from a ``_step_microbatches`` frame (outermost first)."""
    for frame in frames:
        if frame.f_code.co_name != _compat.SCHEDULE_STEP:
            continue
        local = frame.f_locals
        source = linecache.getline(frame.f_code.co_filename, frame.f_lineno).strip()
        desc = _DESC.search(source)
        transfer = desc.group(1) if desc else ""
        if "fwd_recv_ops" in source:
            transfer = "fwd_recv"
        elif "bwd_recv_ops" in source:
            transfer = "bwd_recv"
        elif "send_ops" in source or "send_work" in source:
            transfer = "send"
        owner = local.get("self")
        stage = _compat.schedule_stage(owner)
        if "action" in local and local["action"] is not None:
            action = f"action {local['action']}"  # torch's notation: stage, F/B/I/W, microbatch ("1F3")
        else:
            index = getattr(stage, "stage_index", "?")
            action = f"stage {index}, forward microbatch {local.get('fwd_mb_index', '?')}, backward microbatch " \
                     f"{local.get('bwd_mb_index', '?')}"  # fmt: skip
        peer = _peer(stage, transfer)
        return f"{action}; waiting on {transfer or 'a transfer'}{peer}" if transfer else action
    return ""


def _peer(stage: Any, transfer: str) -> str:
    """`` from rank R`` / `` to rank R`` for a single-stage schedule's transfer, from the stage's rank map."""
    if stage is None or not transfer:
        return ""
    index = getattr(stage, "stage_index", None)
    ranks = getattr(stage, "stage_index_to_group_rank", None)
    group = getattr(stage, "group", None)
    if index is None or not ranks:
        return ""
    other = index - 1 if transfer.startswith(("fwd_recv", "bwd_send")) else index + 1
    if other not in ranks:
        return ""
    rank = dist.get_global_rank(group, ranks[other]) if group is not None else ranks[other]
    return f" {'from' if 'recv' in transfer else 'with'} rank {rank} (stage {other})"


def recorded(names: Mapping[Any, str], shown: int = 3) -> str:
    """The last collective torch's flight recorder saw on each of the ``shown`` groups used most recently: the one a
    rank waits in even when its stack does not name the group (DTensor's collectives run below Python)."""
    dump = _compat.flight_recorder()
    if not dump:
        return ""
    ours = {getattr(g, "group_name", None): name for g, name in names.items()}
    last: dict[str, dict[str, Any]] = {}
    for entry in dump.get("entries", []):
        last[str(entry.get("process_group", ("?",))[0])] = entry
    recent = sorted(last.items(), key=lambda kv: -int(kv[1].get("time_created_ns", 0)))[:shown]
    return ", ".join(
        f"{ours.get(pg, f'group {pg}')} #{e.get('collective_seq_id')} {e.get('profiling_name', '?')} "
        f"{e.get('input_sizes', '')}" for pg, e in recent
    )


def where_blocked(thread: threading.Thread, rank: int, names: Mapping[Any, str]) -> Blocked:
    """Where ``thread`` (the main thread) is now, as a `Blocked` for rank ``rank``."""
    frame: Optional[FrameType] = sys._current_frames().get(thread.ident or -1)
    frames: list[FrameType] = []
    while frame is not None:
        frames.append(frame)
        frame = frame.f_back
    frames.reverse()  # outermost first
    blocked = Blocked(rank)
    if not frames:
        return blocked
    inner = frames[-1]
    blocked.where = f"{inner.f_code.co_filename}:{inner.f_lineno} {inner.f_code.co_name}"
    if any(_DATA in f.f_code.co_filename for f in frames):
        blocked.op = "data loader (fetching the next batch)"
    dist_frames = [f for f in frames if _DIST in f.f_code.co_filename and "pipelining" not in f.f_code.co_filename]
    if dist_frames and not blocked.op:
        blocked.op = dist_frames[-1].f_code.co_name
        for f in reversed(dist_frames):
            groups = _groups_in(f)
            if groups:
                group = groups[0]
                blocked.group = names.get(group, "")
                blocked.ranks = list(dist.get_process_group_ranks(group))
                blocked.group = blocked.group or f"the group of ranks {blocked.ranks}"
                blocked.seq = _compat.group_sequence_number(group)
                fqn = _compat.fsdp_group_name(f.f_locals.get("self"))
                if fqn is not None:
                    blocked.op += f" (FSDP2 parameters of {fqn or 'the root'})"
                break
    blocked.action = _pipeline_action(frames)
    if blocked.action and not blocked.op:
        blocked.op = "pipeline transfer"
    return blocked
