"""Pipeline schedules from `torch.distributed.pipelining`, microbatching, and one training / evaluation step.

| ``pp_schedule``    | torch class                     | stages per rank | stage -> rank   |
|--------------------|---------------------------------|-----------------|-----------------|
| ``gpipe``          | `ScheduleGPipe`                 | 1               | s               |
| ``1f1b``           | `Schedule1F1B`                  | 1               | s               |
| ``interleaved_1f1b`` | `ScheduleInterleaved1F1B`     | 2               | s mod pp (loop) |
| ``looped_bfs``     | `ScheduleLoopedBFS`             | 2               | s mod pp (loop) |
| ``interleaved_zb`` | `ScheduleInterleavedZeroBubble` | 2               | s mod pp (loop) |
| ``zbv``            | `ScheduleZBVZeroBubble`         | 2               | V: r and 2pp-1-r |
| ``dualpipev``      | `ScheduleDualPipeV`             | 2               | V: r and 2pp-1-r |
| ``2bw``            | `two_bw.TwoBW` (ours; PipeDream-2BW) | 1          | s               |

Bubble fraction with p stages and m microbatches: (p-1)/(m+p-1) for GPipe and 1F1B (Huang et al., arXiv
1811.06965; Narayanan et al., arXiv 2104.04473), divided by the virtual stages per rank for interleaved 1F1B;
the zero-bubble schedules fill it with weight-gradient work (Qi et al., arXiv 2401.10241).

Gradients: the schedule's loss function divides each microbatch's loss by the microbatch count (and the caller's
accumulation factor), so gradients sum to those of the mean loss; torch's own ``scale_grads`` is off because it
divides the stage's whole ``.grad``, which would also shrink gradients accumulated over earlier steps.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.fsdp import FSDPModule
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleDualPipeV,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)

from lightning_par import _compat, axes
from lightning_par.parallel.pipeline.microbatches import _signature, split_microbatches
from lightning_par.parallel.pipeline.preflight import Shape, preflight
from lightning_par.parallel.pipeline.stages import PipelineError, PipelineModel, StageSpec
from lightning_par.parallel.pipeline.tied import OnEveryStage, TiedWeights
from lightning_par.parallel.pipeline.trace import StepTrace
from lightning_par.parallel.pipeline.two_bw import TwoBW


@dataclasses.dataclass(frozen=True)
class ScheduleInfo:
    """How a schedule name maps onto torch.

    Args:
        cls: the torch schedule class.
        virtual: stages per rank.
        style: ``"loop"`` (stage s on rank s mod pp) or ``"v"`` (rank r runs r and 2pp-1-r).
    """

    cls: Any
    virtual: int
    style: str
    asynchronous: bool = False


# 2bw trains with `two_bw.TwoBW` (torch's schedules flush every step); GPipe's forward-only order evaluates it.
_TORCH = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B,
          "looped_bfs": ScheduleLoopedBFS, "interleaved_zb": ScheduleInterleavedZeroBubble,
          "zbv": ScheduleZBVZeroBubble, "dualpipev": ScheduleDualPipeV,
          "2bw": ScheduleGPipe}  # fmt: skip
# The suite's schedules (lightning_par.axes.SCHEDULES: stages per rank, placement) with the torch class of each.
SCHEDULES: dict[str, ScheduleInfo] = {
    name: ScheduleInfo(_TORCH[name], s.virtual, s.style, s.asynchronous) for name, s in axes.SCHEDULES.items()
}


def stages_per_rank(schedule: str, vpp: Optional[int] = None) -> int:
    """Stages each rank runs: ``vpp`` for a looped interleaved schedule that sets it, else the schedule's own."""
    return vpp or SCHEDULES[schedule].virtual


def n_stages(schedule: str, pp: int, vpp: Optional[int] = None) -> int:
    """Total pipeline stages for ``pp`` ranks under ``schedule`` (``vpp``: stages per rank, `stages_per_rank`)."""
    return pp * stages_per_rank(schedule, vpp)


def local_stages(schedule: str, pp: int, pp_rank: int, vpp: Optional[int] = None) -> list[int]:
    """The stage indices rank ``pp_rank`` of the pipeline group runs, in increasing order."""
    info = SCHEDULES[schedule]
    if info.style == "v":
        return sorted({pp_rank, 2 * pp - 1 - pp_rank})
    return [pp_rank + k * pp for k in range(stages_per_rank(schedule, vpp))]


def check_schedule(schedule: str, pp: int, microbatches: int, n_blocks: int, vpp: Optional[int] = None) -> None:
    """Reject a schedule / microbatch / trunk combination torch would refuse, before any step runs.

    Args:
        schedule: a key of `SCHEDULES`.
        pp: pipeline ranks.
        microbatches: microbatches per step.
        n_blocks: blocks in the trunk.
        vpp: stages per rank of a looped interleaved schedule (default: the schedule's).
    """
    if schedule not in SCHEDULES:
        raise PipelineError(f"pp_schedule={schedule!r} is unknown; choose one of {tuple(SCHEDULES)}")
    stages = n_stages(schedule, pp, vpp)
    if stages > n_blocks:
        fix = ("use a smaller pp" if SCHEDULES[schedule].virtual == 1 else
               f"use vpp <= {n_blocks // pp}" if vpp else "use pp_schedule='1f1b' or a smaller pp")  # fmt: skip
        per = f" and vpp={vpp}" if vpp else ""
        raise PipelineError(
            f"pp={pp} with pp_schedule={schedule!r}{per} needs {stages} stages but the trunk has {n_blocks} blocks "
            f"(each stage needs >= 1); {fix}"
        )
    if schedule == "1f1b" and microbatches < stages:
        raise PipelineError(f"pp_schedule='1f1b' needs microbatches >= {stages} stages; got {microbatches}")
    if schedule == "dualpipev" and microbatches < stages:
        raise PipelineError(
            f"pp_schedule='dualpipev' needs microbatches >= {stages} (pp x 2 virtual stages); got {microbatches}: use "
            f"microbatches={stages}"
        )
    if schedule in ("interleaved_1f1b", "interleaved_zb", "looped_bfs"):
        rounds = max(1, microbatches // pp)
        if microbatches % rounds:
            raise PipelineError(
                f"pp_schedule={schedule!r} needs microbatches to be a multiple of "
                f"max(1, microbatches // pp) = {rounds}; got {microbatches}: use a multiple of pp={pp}"
            )


class PipelineRunner:
    """Runs one pipeline step on every rank of a pipeline group with a torch schedule.

    Args:
        model: the cut model (`PipelineModel`).
        schedule: a key of `SCHEDULES`.
        group: the pipeline process group (ranks that share data-parallel and tensor-parallel coordinates).
        microbatches: microbatches per training step.
        tied: on an end stage's rank of a model with a weight used before and after the trunk, the two copies
            whose gradients each step sums (`pipeline.tied`).
        everywhere: the parameters every stage holds, whose gradients each step sums over the pipeline group.
        wire_shape: the hidden state's shape between stages from its shape entering the trunk (default: the
            same): context parallelism sends this rank's sequence chunks only.
        vpp: stages per rank of a looped interleaved schedule (default: the schedule's).
    """

    def __init__(
        self,
        model: PipelineModel,
        schedule: str,
        group: dist.ProcessGroup,
        microbatches: int,
        *,
        tied: Optional[TiedWeights] = None,
        everywhere: Optional[OnEveryStage] = None,
        wire_shape: Optional[Callable[[Shape], Shape]] = None,
        vpp: Optional[int] = None,
    ) -> None:
        self.model, self.schedule_name, self.group, self.vpp = model, schedule, group, vpp
        self.microbatches = microbatches
        self.pp = dist.get_world_size(group)
        self._first_rank, self._last_rank = end_ranks(schedule, group, vpp)
        self._cache: dict[tuple, Any] = {}
        self.tied, self.everywhere = tied, everywhere
        self._loss_fn: Callable[[Tensor], Tensor] = lambda t: t
        self.wire_shape: Callable[[Shape], Shape] = wire_shape if wire_shape is not None else (lambda shape: shape)
        self.trace = StepTrace()  # this rank's actions and waits in the latest training step
        # Told the hidden state's whole shape entering each trunk block whenever a step's schedule is chosen.
        self.shape_listeners: list[Callable[[list[Shape]], None]] = []
        self._full_shapes: list[Shape] = []
        # PipeDream-2BW trains with a runtime of its own (torch's schedules flush every step).
        self.two_bw = TwoBW(model, group, self.trace) if SCHEDULES[schedule].asynchronous else None

    @property
    def last_stage_rank(self) -> int:
        """Global rank that runs the last stage (it holds the losses and the user's logged values)."""
        return self._last_rank

    @property
    def first_stage_rank(self) -> int:
        """Global rank that runs the first stage."""
        return self._first_rank

    def describe(self) -> str:
        """One line naming the schedule, the microbatches and every stage's blocks (printed at start-up)."""
        model = self.model
        names = model.trunk.names
        stages = [f"stage {s}: {names[a]}..{names[b - 1]}" for s, (a, b) in enumerate(model.ranges)]
        ends = f"before the trunk {model.pre_names or '-'} on stage 0, after it {model.post_names or '-'} on the last"
        own = model.ownership
        if own.tied:
            ends += f"; tied {[names[0] for names in own.tied]} held by both"
        if own.source != "probe":
            ends += f" (by registration order: {own.reason})"
        return (f"pipeline {self.schedule_name}, {model.n_stages} stages over pp={self.pp}, {self.microbatches} "
                f"microbatches; " + "; ".join(stages) + f"; {ends}")  # fmt: skip

    @property
    def is_last(self) -> bool:
        """Whether this rank runs the last stage."""
        return any(s.is_last for s in self.model.specs)

    def _hidden_meta(self, mb0: Any, step_fn: Callable[[Any, StageSpec], Any]) -> tuple[list[Shape], torch.dtype]:
        """The hidden state's shape entering each trunk block (as sent between stages: through `wire_shape`), and its
        dtype, probed on the first stage's rank.

        One shape throughout when every block keeps it; a trunk whose blocks change it (`Ownership.reshaped`: Swin's
        stages merge patches) is walked with stand-ins (`PipelineModel.walk`)."""
        meta: list[Any] = [None]
        model, n = self.model, len(self.model.trunk.names)
        if dist.get_rank() == self._first_rank:
            probe_spec = model.specs[0]
            device = model.device
            first = model.stage_modules()[0]
            root = cast(FSDPModule, first) if isinstance(first, FSDPModule) else None
            if root is not None:  # ZeRO-3: the embedding belongs to the stage's root unit; gather it for the probe
                root.unshard()
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                if model.ownership.reshaped:
                    seen = model.walk(lambda: step_fn(mb0, probe_spec))
                else:
                    seen = [model.probe(lambda: step_fn(mb0, probe_spec))] * n
            if root is not None:
                root.reshard()
            meta = [([tuple(t.shape) for t in seen], seen[0].dtype)]
        dist.broadcast_object_list(meta, src=self._first_rank, group=self.group)
        shapes, dtype = meta[0]
        self._full_shapes = [tuple(shape) for shape in shapes]
        self._tell_shapes(self._full_shapes)
        return [self.wire_shape(shape) for shape in shapes], dtype

    def _tell_shapes(self, shapes: list[Shape]) -> None:
        """Hand the hidden state's whole shape entering each trunk block to `shape_listeners` (sequence
        parallelism's true length on a stage that receives shards), before anything of a step runs."""
        for listen in self.shape_listeners:
            listen(shapes)

    def _schedule(self, mbs: list[Any], step_fn: Callable[[Any, StageSpec], Any], training: bool) -> Any:
        key = (_signature(mbs[0]), len(mbs), training, torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled())
        if key in self._cache:
            self._tell_shapes(self._cache[key][2])
            return self._cache[key][:2]
        shapes, dtype = self._hidden_meta(mbs[0], step_fn)
        self.model.hidden_dtype = dtype
        side = preflight(self.model, shapes, dtype, self.group)
        n = len(shapes)

        def meta(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
            # requires_grad in the metadata is what makes the receiving stage's buffers differentiable.
            return torch.empty(shape, dtype=dtype, device="meta", requires_grad=training and dtype.is_floating_point)

        loss = torch.empty((), dtype=torch.float32, device="meta")
        stages = []
        for mod in self.model.stage_modules():
            spec = mod.spec
            ins, outs = ([meta(shapes[at], dtype)] + [meta(*side[k]) for k in self._side_slots(at)] if at < n else []
                         for at in (spec.start, spec.end))  # fmt: skip
            stages.append(
                PipelineStage(
                    mod,
                    spec.index,
                    self.model.n_stages,
                    self.model.device,
                    input_args=() if spec.is_first else tuple(ins),
                    output_args=loss if spec.is_last else (tuple(outs) if len(outs) > 1 else outs[0]),
                    group=self.group,
                )
            )
        for stage in stages:
            self.trace.watch(stage)
        info = SCHEDULES[self.schedule_name]
        loss_fn = (lambda out, _target: self._loss_fn(out)) if training else None
        try:
            if stages_per_rank(self.schedule_name, self.vpp) == 1:
                # Forward only, GPipe's order is 1F1B's without the minimum microbatch count (a short last batch).
                cls = info.cls if training else ScheduleGPipe
                sched = cls(stages[0], n_microbatches=len(mbs), loss_fn=loss_fn, scale_grads=False)
            else:
                sched = info.cls(stages, n_microbatches=len(mbs), loss_fn=loss_fn, scale_grads=False)
        except ValueError as err:
            raise PipelineError(f"pp_schedule={self.schedule_name!r} with {len(mbs)} microbatches: {err}") from err
        self._cache[key] = (sched, side, self._full_shapes)
        return sched, side

    def _side_slots(self, end: int) -> list[int]:
        return self.model.sides.before(end) if self.model.sides is not None else []

    def _scheduled(self, mbs: list[Any], step_fn: Callable[[Any, StageSpec], Any], training: bool) -> Any:
        sched, side = self._schedule(mbs, step_fn, training)
        if self.model.sides is not None:  # what this schedule's microbatches must give (eval may differ from train)
            self.model.sides.meta = side
        return sched

    def _wire(self, mbs: list[Any], step_fn: Callable[[Any, StageSpec], Any], tag: str) -> tuple[list[Shape], Any, Any]:
        """The hidden state's shape entering each block, its dtype and the side outputs' metadata, for a runtime of
        our own (``tag`` keys its cache): probed once per batch signature, as `_schedule` does for torch's."""
        key = (_signature(mbs[0]), tag, torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled())
        if key not in self._cache:
            shapes, dtype = self._hidden_meta(mbs[0], step_fn)
            self.model.hidden_dtype = dtype
            side = preflight(self.model, shapes, dtype, self.group)
            self._cache[key] = (shapes, dtype, side, self._full_shapes)
        shapes, dtype, side, full = self._cache[key]
        self._tell_shapes(full)
        self.model.hidden_dtype = dtype
        if self.model.sides is not None:
            self.model.sides.meta = side
        return shapes, dtype, side

    def _metas(self, at: int, shapes: list[Shape], dtype: torch.dtype, side: Any) -> list[tuple[tuple, torch.dtype]]:
        """Shape and dtype of what travels between stages at trunk block ``at``: the hidden state, then sides."""
        return [(shapes[at], dtype)] + [side[k] for k in self._side_slots(at)]

    def train_step(
        self, batch: Any, step_fn: Callable[[Any, StageSpec], Optional[Tensor]], loss_fn: Callable[[Tensor], Tensor]
    ) -> None:
        """Forward and backward of one batch through the pipeline; gradients accumulate into ``.grad``.

        Args:
            batch: this data-parallel rank's batch (the same on every rank of the pipeline group).
            step_fn: ``step_fn(microbatch, spec)`` runs the user's step on a microbatch as stage ``spec``; on
                the last stage it returns the microbatch's loss.
            loss_fn: maps a microbatch's loss to what is differentiated (divide by microbatches, scale for fp16).
        """
        mbs = split_microbatches(batch, self.microbatches)
        self.model.begin_step(lambda i, spec: step_fn(mbs[i], spec))
        self._loss_fn = loss_fn
        if self.two_bw is not None:  # PipeDream-2BW: our own runtime; steps overlap
            shapes, dtype, side = self._wire(mbs, step_fn, "2bw")
            spec = self.two_bw.spec
            ins = self._metas(spec.start, shapes, dtype, side) if not spec.is_first else []
            with self.trace:
                self.two_bw.step(mbs, loss_fn, ins)
        else:
            sched = self._scheduled(mbs, step_fn, training=True)
            device = self.model.device
            m = len(mbs)
            with self.trace:  # the actions and waits of this step: `trace.last` (ParallelismMonitor's bubble)
                sched.step(target=torch.zeros(m, device=device), mb=torch.arange(m, device=device),
                           return_outputs=False)  # fmt: skip
        if self.tied is not None:  # this step's gradients of the two copies, before anything else reads them
            self.tied.reduce_grads()
        if self.everywhere is not None:  # each stage's share of the parameters every stage holds
            self.everywhere.reduce_grads()

    @torch.no_grad()
    def eval_step(self, batch: Any, step_fn: Callable[[Any, StageSpec], Optional[Tensor]]) -> None:
        """Forward only (validation / test): the last stage runs ``step_fn`` to the end for every microbatch.

        A batch the training microbatch count does not divide (a short last batch) uses the largest divisor of
        its size that is <= that count.
        """
        leaves, _ = _compat.tree_flatten(batch)
        size = next((t.shape[0] for t in leaves if isinstance(t, Tensor) and t.dim() > 0), self.microbatches)
        m = max(d for d in range(1, min(self.microbatches, size) + 1) if size % d == 0)
        mbs = split_microbatches(batch, m)
        self.model.begin_step(lambda i, spec: step_fn(mbs[i], spec))
        device = self.model.device
        if SCHEDULES[self.schedule_name].style == "v":
            # torch's V schedules have no forward-only mode (their eval() asserts on the missing backward).
            self._forward_only(mbs, step_fn)
            return
        sched = self._scheduled(mbs, step_fn, training=False)
        sched.eval(mb=torch.arange(m, device=device), return_outputs=False)

    def _forward_only(self, mbs: list[Any], step_fn: Callable[[Any, StageSpec], Any]) -> None:
        """Every microbatch through every stage in stage order, activations sent point to point."""
        shapes, dtype, side = self._wire(mbs, step_fn, "forward_only")
        modules = self.model.stage_modules()
        stages = {mod.spec.index: mod for mod in modules}
        owner = {s: r for r in range(self.pp) for s in local_stages(self.schedule_name, self.pp, r, self.vpp)}
        me = dist.get_rank(self.group)
        device = self.model.device
        sends = []
        for i in range(len(mbs)):
            carry: list[Tensor] = []  # the hidden state, then the trunk's side outputs
            for s in range(self.model.n_stages):
                if owner[s] != me:
                    continue
                if s > 0 and owner[s - 1] != me:
                    start = self.model.ranges[s][0]
                    metas = self._metas(start, shapes, dtype, side)
                    carry = [torch.empty(sh, dtype=dt, device=device) for sh, dt in metas]
                    for t in carry:
                        dist.recv(t, src=dist.get_global_rank(self.group, owner[s - 1]), group=self.group)
                out = stages[s](*carry, mb=torch.tensor([i], device=device))
                carry = list(out) if isinstance(out, tuple) else [out]
                if s + 1 < self.model.n_stages and owner[s + 1] != me:
                    dst = dist.get_global_rank(self.group, owner[s + 1])
                    for t in carry:
                        work = dist.isend(t.contiguous(), dst=dst, group=self.group)
                        if work is not None:
                            sends.append(work)
        for work in sends:
            work.wait()


def end_ranks(schedule: str, group: dist.ProcessGroup, vpp: Optional[int] = None) -> tuple[int, int]:
    """The global ranks that run the first and the last stage of ``schedule`` over ``group``."""
    pp = dist.get_world_size(group)
    last = n_stages(schedule, pp, vpp) - 1
    # Stage 0 is on the group's first rank under every schedule.
    return dist.get_global_rank(group, 0), dist.get_global_rank(group, next(
        r for r in range(pp) if last in local_stages(schedule, pp, r, vpp)))
