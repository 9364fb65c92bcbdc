"""Bytes of parameters, gradients and optimizer state one rank holds under a `Layout`, as this suite allocates them
(``framework="lightning_par"``) or as published Megatron-LM runs count them (``framework="megatron"``).

What a rank holds, in this suite (read from its code; ``tests/test_plan_state.py`` compares the predictions with
the strategies' own tensors, rank by rank, for zero1-3, tp, tp_zero1/3, pipe_zero1/3 and moe_zero1/3):
- Pipeline: the blocks of its stages (`lightning_par.parallel.pipeline.partition.partition` balances parameter counts,
the
  code before the trunk charged to the first stage and after it to the last, an embedding lookup charged nothing),
  plus what runs before the trunk on the first stage and after it on the last; a tied embedding and head on both.
- Tensor parallelism divides a split tensor's dim by tp; expert parallelism divides stacked experts by ep (or
  keeps ``E/ep`` whole experts). Experts are outside ZeRO: never sharded over dp, their state whole on each rank.
- Precision: every stored tensor (parameters, gradients, optimizer moments) is fp32, except under ``bf16-true``,
  where all are bf16. The mixed modes keep no second copy: autocast makes the low-precision compute copies
  transiently, and ZeRO-3 gathers them in bf16 only for the block being computed (`lightning_par.precision`).
- ZeRO 0-2 (`lightning_par.parallel.zero.replicated`): every rank keeps the full (tp-local) parameters; the
  optimizer steps "masters" that are views of this rank's rows of each parameter, ``ceil(d0/n)`` rows per rank
  over the ``n = dp_shard x cp`` shard group, the last ranks short: the optimizer state is rank-dependent.
  Gradients: stage 0 holds full gradients (all-reduced in place). Stage 1 holds full gradients through the
  backward passes of an accumulation (``accumulation > 1``) and reduce-scatters them during the backward that ends
  it, as stage 2 does in every backward: then a shard per bucket padded to ``ceil(d0/n)`` rows of every parameter
  (the reduce-scatter output). Under a pipeline both reduce after the step's last backward and so hold full
  gradients first. PowerSGD (``powersgd_rank``) reduces after the backward, so full gradients are held, and keeps
  per rank an error as large as the gradients and the P, Q factors of each compressed one.
- ZeRO 3 (FSDP2 ``fully_shard``): parameters and gradients are ``ceil(d0/n)``-row shards padded on every rank;
  the optimizer state covers the rank's real rows only.
- Optimizer state (torch's): Adam / AdamW keep two moments shaped like each master plus a 4-byte fp32 ``step``
  tensor per parameter; SGD with momentum one buffer. Every master counts, empty ones included.
- PipeDream-2BW (``pp_schedule="2bw"``; Narayanan et al., "Memory-Efficient Pipeline-Parallel DNN Training",
  arXiv 2006.09503): the weights update one step late, so each stage keeps one more version of its trainable
  weights (the one the previous step's in-flight micro-batches run on; the current one is the parameters' own
  storage) and one more gradient buffer (the paper's double buffer: the next step's first micro-batches accumulate
  apart from the complete gradient the optimizer applies): `StateBytes.double_buffer`, the rank's trainable
  parameter bytes (not on the last stage: its micro-batches end within the step) plus its gradient bytes, in their
  stored dtype. The suite runs it with ZeRO 0-1 and no tp, cp,
  ep or PowerSGD (`ParallelConfig` refuses the rest), where both are the stage's whole tensors.
Offloading (ZeRO-3 ``offload``) moves the same bytes to host memory between uses.
"Gradients" is the larger of what a rank holds when the step's backward has returned and at the optimizer step
(transient buckets and FSDP2's unsharded block gradients during backward are not counted).

Megatron-LM (Narayanan et al., arXiv 2104.04473; Korthikanti et al., arXiv 2205.05198): under mixed precision 2
bytes of fp16/bf16 parameters, 4 of fp32 main gradients and 12 of fp32 master weights and Adam moments per
parameter (18), the 12 divided over the data-parallel ranks by the distributed optimizer (``zero_stage=1``); 4 + 4
+ 8 under fp32. Its embedding and head are split over tp by the vocabulary, its stages hold equal block counts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Optional

from lightning_par import axes
from lightning_par.parallel.compression.powersgd import compressed_numel, compresses
from lightning_par.parallel.pipeline.partition import even_split, partition
from lightning_par.planner.layout import SCHEDULES, Layout, LayoutError, stored_bytes
from lightning_par.planner.params import ParamSpec

OPTIMIZERS = {"adamw": 2, "adam": 2, "sgd": 1}  # moments kept per parameter element
FRAMEWORKS = ("lightning_par", "megatron")
_V_STYLE = ("zbv", "dualpipev")  # rank r runs stages r and 2pp-1-r (lightning_par.parallel.pipeline.schedule)
_STEP_BYTES = 4  # torch's Adam keeps `step` as an fp32 scalar tensor per parameter


@dataclasses.dataclass(frozen=True)
class StateBytes:
    """Bytes one rank holds.

    Args:
        parameters: parameter storage (padded shards included).
        gradients: gradient storage (see the module docstring for when).
        optimizer: optimizer state (moments, steps; master weights under Megatron's convention).
        double_buffer: under PipeDream-2BW (``pp_schedule="2bw"``, arXiv 2006.09503), the second version of the
            rank's trainable weights and the second gradient buffer it keeps (module docstring); 0 otherwise.
    """

    parameters: int
    gradients: int
    optimizer: int
    double_buffer: int = 0

    @property
    def total(self) -> int:
        """All four together."""
        return self.parameters + self.gradients + self.optimizer + self.double_buffer


@dataclasses.dataclass(frozen=True)
class Held:
    """One tensor as a rank holds it after pipeline, tensor and expert parallelism (before ZeRO).

    Args:
        spec: the parameter.
        shape: its shape on this rank.
        in_zero: the ZeRO engine manages it (experts are reduced by expert parallelism instead; 0-dim parameters
            stay whole, their gradients averaged apart).
    """

    spec: ParamSpec
    shape: tuple[int, ...]
    in_zero: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def padded(self, n: int) -> int:
        """Elements of a ``ceil(d0/n)``-row shard: a ZeRO bucket's or FSDP2's padded shard."""
        rows = self.shape[0]
        return math.ceil(rows / n) * (self.numel // rows) if rows else 0

    def rows_of(self, n: int, rank: int) -> int:
        """Elements of shard ``rank`` of ``n``: its real rows (``torch.chunk`` order, the last ranks short)."""
        rows = self.shape[0]
        chunk = math.ceil(rows / n) if rows else 0
        return max(0, min(rows - rank * chunk, chunk)) * (self.numel // rows if rows else 0)


def param_bytes(spec: ParamSpec, precision: str) -> int:
    """Bytes per element of a stored parameter (and its gradient and moments) in this suite."""
    return spec.dtype_bytes if spec.dtype_bytes is not None else stored_bytes(precision)


def virtual_stages(layout: Layout, framework: str = "lightning_par") -> int:
    """Stages per pipeline rank: ``vpp`` under the looped interleaved schedules (the suite's 2 when ``vpp = 1``),
    2 under the V ones, 1 otherwise; Megatron's ``vpp``."""
    if framework == "megatron" or layout.pp == 1:
        return layout.vpp if layout.pp > 1 else 1
    suite = SCHEDULES[layout.pp_schedule]
    looped = suite > 1 and layout.pp_schedule not in _V_STYLE
    if layout.vpp not in (1, suite) and not looped:
        raise LayoutError(
            f"vpp={layout.vpp}: this suite runs {suite} stage(s) per rank under pp_schedule={layout.pp_schedule!r}; "
            f"set vpp={suite}, or use a looped interleaved schedule (interleaved_1f1b, looped_bfs, interleaved_zb)"
        )
    return layout.vpp if looped and layout.vpp > 1 else suite


def local_stages(layout: Layout, pp_rank: int, framework: str = "lightning_par") -> list[int]:
    """The pipeline stages rank ``pp_rank`` runs (`lightning_par.parallel.pipeline.schedule.local_stages`)."""
    v = virtual_stages(layout, framework)
    if framework == "lightning_par" and layout.pp_schedule in _V_STYLE and v == 2:
        return sorted({pp_rank, 2 * layout.pp - 1 - pp_rank})
    return [pp_rank + k * layout.pp for k in range(v)]


def stage_ranges(specs: Sequence[ParamSpec], layout: Layout, framework: str = "lightning_par") -> list[tuple[int, int]]:
    """Block ranges of every pipeline stage: the suite's parameter-count balance, or Megatron's equal counts."""
    n_blocks = 1 + max((max(s.calls, default=s.block) for s in specs if s.block is not None), default=-1)
    stages = layout.pp * virtual_stages(layout, framework)
    if n_blocks < stages:
        raise LayoutError(f"{n_blocks} blocks cannot fill {stages} pipeline stages; lower pp (or vpp)")
    if framework == "megatron":
        sizes, start, ranges = even_split(n_blocks, stages), 0, []
        for size in sizes:
            ranges.append((start, start + size))
            start += size
        return ranges
    costs = [0.0] * n_blocks
    for s in specs:
        for call in s.calls or ((s.block,) if s.block is not None else ()):
            costs[call] += s.numel
    # The suite charges the code before the trunk minus embedding lookups to the first stage, and the code after it
    # (a tied table there is the head's matmul) to the last (lightning_par.parallel.pipeline.split._outer_cost).
    first = float(sum(s.numel for s in specs if s.end in ("first", "both") and not s.lookup))
    last = float(sum(s.numel for s in specs if s.end == "both" or (s.end == "last" and not s.lookup)))
    return partition(costs, stages, first_extra=first, last_extra=last)


def coords(layout: Layout, rank: int) -> tuple[int, int]:
    """``(pp rank, rank in the ZeRO shard group)`` of global ``rank`` (mesh order pp, dp_replicate, dp_shard, cp,
    tp: `lightning_par.mesh.MESH_AXES`; the shard group is dp_shard x cp)."""
    if not 0 <= rank < layout.world:
        raise LayoutError(f"rank={rank} is not a rank of the layout's {layout.world}")
    inner = layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp
    shard = (rank % (layout.dp_shard * layout.cp * layout.tp)) // layout.tp
    return rank // inner, shard


def held(specs: Sequence[ParamSpec], layout: Layout, pp_rank: int = 0, framework: str = "lightning_par") -> list[Held]:
    """What a rank of pipeline rank ``pp_rank`` holds, after pipeline, tensor and expert parallelism."""
    blocks: set[int] = set()
    first = last = layout.pp == 1
    if layout.pp > 1:
        ranges = stage_ranges(specs, layout, framework)
        for stage in local_stages(layout, pp_rank, framework):
            blocks.update(range(*ranges[stage]))
            first, last = first or stage == 0, last or stage == len(ranges) - 1
    vocab = max((s.shape[0] for s in specs if s.end is not None and len(s.shape) == 2), default=0)
    out = []
    for s in specs:
        if s.block is not None and layout.pp > 1 and s.block not in blocks and not s.calls:
            continue  # a block that runs more than once: on every stage
        if s.end is not None and not {"first": first, "last": last, "both": first or last, "every": True}[s.end]:
            continue
        shape = list(s.shape)
        tp_dim = s.tp_dim
        if framework == "megatron" and s.end is not None and len(s.shape) == 2 and s.shape[0] == vocab:
            tp_dim = 0  # Megatron's vocabulary-parallel embedding and head
        if tp_dim is not None and layout.tp > 1:
            if shape[tp_dim] % layout.tp:
                raise LayoutError(f"tp={layout.tp} does not divide dim {tp_dim} ({shape[tp_dim]}) of {s.name}")
            shape[tp_dim] //= layout.tp
        if s.expert_axis is not None:
            if shape[s.expert_axis] % layout.ep:
                raise LayoutError(f"ep={layout.ep} does not divide the {shape[s.expert_axis]} experts of {s.name}")
            shape[s.expert_axis] //= layout.ep
        if s.expert is not None:
            if s.expert[1] % layout.ep:
                raise LayoutError(f"ep={layout.ep} does not divide the {s.expert[1]} experts holding {s.name}")
            if s.expert[0] // (s.expert[1] // layout.ep):
                continue  # ep rank 0's whole experts stand for every ep rank's: each holds E/ep of them
        # Experts leave ZeRO only when ep > 1: at ep = 1 expert parallelism shards nothing and excludes nothing.
        # 0-dim parameters stay whole on every rank (`lightning_par.parallel.zero.scalars`).
        expert = s.expert_axis is not None or s.expert is not None
        out.append(Held(s, tuple(shape), not (expert and layout.ep > 1) and len(shape) > 0))
    return out


def state_bytes(
    specs: Sequence[ParamSpec],
    layout: Layout,
    rank: Optional[int] = None,
    optimizer: str = "adamw",
    framework: str = "lightning_par",
    accumulation: int = 1,
) -> StateBytes:
    """Parameter, gradient and optimizer-state bytes of one rank (see the module docstring for the conventions).

    Args:
        specs: the model's parameters (`specs_from_module` or `specs_from_desc`).
        layout: the parallel layout.
        rank: a global rank; ``None``: the rank holding the most in total.
        optimizer: one of `OPTIMIZERS` (``"sgd"``: with momentum).
        framework: ``"lightning_par"`` (this suite's allocations) or ``"megatron"`` (published Megatron-LM runs).
        accumulation: backward passes per optimizer step without a pipeline (gradient accumulation): ZeRO-1 holds
            full gradients through all but the last.

    Raises:
        ValueError: an unknown optimizer or framework, or a layout the framework does
            not run; `LayoutError` when a degree does not divide a tensor.
    """
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is not modelled; choose one of {sorted(OPTIMIZERS)}")
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework={framework!r} is unknown; choose one of {FRAMEWORKS}")
    if framework == "megatron":
        _check_megatron(layout, optimizer)
    n = layout.dp_shard * layout.cp
    if rank is not None:
        pp_rank, shard = coords(layout, rank)
        return _rank_bytes(specs, layout, pp_rank, shard, n, optimizer, framework, accumulation)
    return max(
        (_rank_bytes(specs, layout, p, s, n, optimizer, framework, accumulation)
         for p in range(layout.pp) for s in range(n)),
        key=lambda b: b.total,
    )  # fmt: skip


def pipeline_copies(specs: Sequence[ParamSpec], layout: Layout, pp_rank: int, tensors: Sequence[Held]) -> set[str]:
    """Names of the parameters of which a pipeline keeps a copy on several stages (a tied weight's ends on two
    ranks, what every stage holds): PowerSGD averages their gradients exactly, so the copies stay equal."""
    if layout.pp == 1:
        return set()
    stages = local_stages(layout, pp_rank)
    both_here = 0 in stages and len(stage_ranges(specs, layout)) - 1 in stages  # the V schedules: one module
    return {t.spec.name for t in tensors
            if t.spec.end == "every" or t.spec.calls or (t.spec.end == "both" and not both_here)}  # fmt: skip


def _rank_bytes(
    specs: Sequence[ParamSpec],
    layout: Layout,
    pp_rank: int,
    shard: int,
    n: int,
    optimizer: str,
    framework: str,
    accumulation: int = 1,
) -> StateBytes:
    tensors = held(specs, layout, pp_rank, framework)
    two_bw = layout.pp > 1 and axes.SCHEDULES[layout.pp_schedule].asynchronous  # PipeDream-2BW: weights one step late
    if framework == "megatron":
        state = _megatron(tensors, layout, optimizer)
        return dataclasses.replace(state, double_buffer=state.parameters + state.gradients) if two_bw else state
    zero, moments = layout.zero_stage, OPTIMIZERS[optimizer]
    params = grads = opt = double = 0
    copies = pipeline_copies(specs, layout, pp_rank, tensors) if layout.powersgd_rank else set()
    for t in tensors:
        size = param_bytes(t.spec, layout.precision)
        if t.spec.quantised is not None:  # frozen: no gradient, no state; whole on every tp rank (split_quantised),
            stored, whole = t.spec.quantised  # ZeRO-3 splits all but the parts each shard carries whole
            params += (stored - whole) // n + whole if t.in_zero and zero == 3 else stored
            continue
        sharded = t.in_zero and zero >= 1
        weight = (t.padded(n) if t.in_zero and zero == 3 else t.numel) * size
        params += weight
        if not t.spec.trainable:
            continue
        full_grads = zero == 0 or (zero == 1 and accumulation > 1) or (zero in (1, 2) and layout.pp > 1)
        full_grads = full_grads or not t.in_zero or bool(layout.powersgd_rank)
        grad = (t.numel if full_grads else t.padded(n)) * size
        grads += grad
        # PipeDream-2BW (Narayanan et al., arXiv 2006.09503): one more weight version (the previous step's, which
        # its in-flight micro-batches run on; none on the last stage, which has none in flight at the step's end)
        # and one more gradient buffer (the paper's double buffer).
        double += (weight if pp_rank < layout.pp - 1 else 0) + grad if two_bw else 0
        if layout.powersgd_rank and t.in_zero and t.spec.name not in copies:  # its error, P and Q (powersgd)
            r = layout.powersgd_rank
            grads += (t.numel + (compressed_numel([t.shape], r) if compresses(t.shape, r) else 0)) * size
        opt += (t.rows_of(n, shard) if sharded else t.numel) * size * moments
        opt += _STEP_BYTES if optimizer in ("adam", "adamw") else 0
    return StateBytes(params, grads, opt, double)


def _check_megatron(layout: Layout, optimizer: str) -> None:
    if layout.precision == "bf16-true":
        raise ValueError(
            "framework='megatron' models Megatron-LM's mixed precision (18 bytes per parameter) and fp32 (16); "
            "bf16-true has no Megatron counterpart: use framework='lightning_par' or precision='bf16-mixed'"
        )
    if layout.zero_stage > 1:
        raise ValueError(
            f"framework='megatron' has no zero_stage={layout.zero_stage}: 0 (plain data parallelism) or 1 (its "
            "distributed optimizer); use framework='lightning_par' for ZeRO-2/3"
        )
    if optimizer not in ("adam", "adamw"):
        raise ValueError(f"framework='megatron' counts Adam's state; got optimizer={optimizer!r}")


def _megatron(tensors: Sequence[Held], layout: Layout, optimizer: str) -> StateBytes:
    mixed = layout.precision != "32-true"
    dense = sum(t.numel for t in tensors if t.in_zero)
    experts = sum(t.numel for t in tensors if not t.in_zero)
    total = dense + experts
    # Master weights (mixed only) and two Adam moments, fp32; the distributed optimizer shards them over the
    # data-parallel ranks holding the same tensors (dp for dense ones, dp/ep for experts).
    per = 12 if mixed else 8
    if layout.zero_stage == 1:
        opt = per * (math.ceil(dense / layout.dp) + math.ceil(experts / (layout.dp // layout.ep)))
    else:
        opt = per * total
    return StateBytes(parameters=(2 if mixed else 4) * total, gradients=4 * total, optimizer=opt)
