"""Bytes a rank puts on the wire per optimizer step, per collective kind, as this suite's strategies issue them.

Convention (`lightning_par.parallel.comm_counter.CommCounter`, ring algorithms over n ranks): an all-reduce of B bytes
moves 2B(n-1)/n per rank, a reduce-scatter of a B-byte input and an all-gather producing B bytes B(n-1)/n. The ZeRO
paper counts this way (Rajbhandari et al., arXiv 1910.02054, section 7: DDP and ZeRO-1/2 2Psi, ZeRO-3 3Psi, times
(n-1)/n); the suite adds its padding and its precision to it.

Covered, exactly (``tests/test_plan_state.py`` counts the same collectives on the strategies):
- data parallelism, per the ZeRO stage (`lightning_par.parallel.zero.fsdp`, `zero.replicated`): stage 0 all-reduces the
  gradients once per step (unpadded, one flat buffer per bucket); stages 1-2 reduce-scatter buckets padded to
  ``ceil(d0/n)`` rows of every parameter and all-gather the updated shards (stage 2 reduces during each backward,
  stage 1 once per step); stage 3 (FSDP2) all-gathers each block for forward and again for backward (once under a
  pipeline, which keeps blocks gathered), the root (embedding, head) once, in the compute dtype under mixed
  precision, and reduce-scatters fp32 (or bf16 under ``bf16-true``) gradients; hybrid sharding all-reduces the
  shards over ``dp_replicate``; with ``zero_quantized_weights`` each unit's all-gather carries int8 codes and an fp32
  scale per 256 elements of a rank's padded input; with ``fp8`` the fp8 weights travel at one byte per element and
  their scales (one fp32 each) are all-reduced over the shards before every forward that gathers them; with
  PowerSGD (``powersgd_rank``, ZeRO 0-1) one all-reduce of ``(n + m) r`` elements per compressed ``n x m`` gradient
  and ``n m`` per other, then stage 1's all-gather;
- expert gradients all-reduced over the ranks holding the same experts (``edp``), and over tp when each tp rank
  computed a share of the tokens (`lightning_par.parallel.experts.apply`);
- a router's logits gathered over the data-parallel ranks for the load-balancing loss (and all-reduced back when
  ``router_aux``), per MoE layer and microbatch (`lightning_par.parallel.experts.router_stats`);
- a tied embedding's gradient summed between a pipeline's end stages (`lightning_par.parallel.pipeline.tied`);
- tensor parallelism's activations, per split region (attention, dense MLP) and microbatch: one all-reduce forward
  (the row-parallel output, compute dtype) and one backward (the region input's gradient, the residual stream's
  dtype: the weights', or the compute dtype under ZeRO-3's mixed precision); under sequence parallelism an
  all-gather and a reduce-scatter each way instead, the trunk's exit gather and its entry's gradient gather, and
  each norm's gradient all-reduced over tp.
Not covered: the token all-to-alls of expert parallelism (they depend on the routing), pipeline point-to-point sends
(the counter does not see them), context parallelism, control scalars and object broadcasts (logged losses, the
pipeline's metadata), and the first step's one-off traffic (FSDP2's lazy set-up, the pipeline's shape probe).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import Optional

from lightning_par.parallel.compression.powersgd import compressed_numel
from lightning_par.parallel.compression.quantized import quantized_bytes
from lightning_par.planner.layout import Layout, LayoutError, compute_bytes
from lightning_par.planner.params import ParamSpec
from lightning_par.planner.state import (
    Held,
    coords,
    held,
    local_stages,
    param_bytes,
    pipeline_copies,
    stage_ranges,
)

KINDS = ("all_reduce", "reduce_scatter", "all_gather")


def _ring(kind: str, payload: float, n: int) -> float:
    """Wire bytes per rank of one collective over ``n`` ranks (``payload``: the all-reduced tensor, the
    reduce-scatter input, the all-gather output)."""
    if n <= 1:
        return 0.0
    return (2.0 if kind == "all_reduce" else 1.0) * payload * (n - 1) / n


def comm_terms(
    specs: Sequence[ParamSpec],
    layout: Layout,
    global_batch: int,
    seq_len: int,
    hidden: int,
    *,
    rank: int = 0,
    router_aux: bool = False,
) -> list[tuple[str, str, float]]:
    """Every term of `comm_bytes` for global ``rank``: ``(source, kind, wire bytes per step)``.

    ``source`` is one of ``"dp"`` (gradients and parameters over the data-parallel ranks), ``"experts"``,
    ``"router"``, ``"tied"``, ``"every stage"`` (parameters every pipeline stage holds), ``"tp"`` (activations),
    ``"sp_norms"``.
    """
    if layout.cp > 1:
        raise LayoutError("comm_bytes does not model context parallelism (cp > 1) yet; price it with cp=1")
    if global_batch % layout.dp:
        raise LayoutError(f"global_batch={global_batch} does not split over dp={layout.dp} ranks")
    pp_rank, shard = coords(layout, rank)
    every = held(specs, layout, pp_rank)
    tensors = [t for t in every if t.spec.trainable]
    n, r, prec = layout.dp_shard * layout.cp, layout.dp_replicate, layout.precision
    # Microbatches a rank runs per step: the pipeline's (the suite's default 2 x pp), else gradient accumulation.
    m = (layout.microbatches or 2 * layout.pp) if layout.pp > 1 else layout.m(global_batch)
    tokens = global_batch // layout.dp * seq_len  # through this rank's blocks per step, all microbatches
    terms: list[tuple[str, str, float]] = []
    copies = pipeline_copies(specs, layout, pp_rank, every) if layout.powersgd_rank else set()
    terms += _data_parallel([t for t in every if t.in_zero], layout, n, r, m, copies)
    experts = sum(t.numel * param_bytes(t.spec, prec) for t in tensors if not t.in_zero and t.shape)
    scalars = sum(1 for t in tensors if not t.shape)
    if scalars:  # their fp32 values and a flag each, over dp_replicate then dp_shard (zero/scalars.py)
        terms += [("scalars", "all_reduce", _ring("all_reduce", 8 * scalars, size)) for size in (r, n)]
    if experts:
        terms.append(("experts", "all_reduce", _ring("all_reduce", experts, layout.dp // layout.ep)))
        if layout.tp > 1:  # each tp rank computed a share of the tokens (etp = 1): summed over tp too
            terms.append(("experts", "all_reduce", _ring("all_reduce", experts, layout.tp)))
    terms += _router(tensors, layout, tokens, m, router_aux)
    terms += _tied(specs, tensors, layout, pp_rank, shard, n)
    terms += _on_every_stage(tensors, layout)
    terms += _tensor_parallel(specs, every, layout, tokens, hidden, n, m)
    return [t for t in terms if t[2]]


def comm_bytes(
    specs: Sequence[ParamSpec],
    layout: Layout,
    global_batch: int,
    seq_len: int,
    hidden: int,
    *,
    rank: Optional[int] = None,
    router_aux: bool = False,
) -> dict[str, float]:
    """Wire bytes per rank per optimizer step, by collective kind (``all_reduce``, ``reduce_scatter``,
    ``all_gather``), for what the module docstring covers.

    Args:
        specs: the model's parameters (`lightning_par.planner.params`).
        layout: the parallel layout (``cp = 1``).
        global_batch: samples per optimizer step over all data-parallel ranks.
        seq_len: tokens per sample.
        hidden: the residual stream's width (tensor-parallel activations).
        rank: a global rank; ``None``: the rank moving the most bytes.
        router_aux: the model's loss includes its routers' load-balancing term (``output_router_logits=True``), so
            the gathered router logits carry a gradient back.

    Raises:
        LayoutError: ``cp > 1``, or a batch that does not split over the data-parallel ranks.
    """
    # Ranks differ by pipeline stage and by shard (a tied weight's FSDP2 rows): one of each pair stands for the rest.
    inner = layout.dp_replicate * layout.dp_shard * layout.cp * layout.tp
    shards = range(layout.dp_shard * layout.cp)
    ranks = [rank] if rank is not None else [p * inner + s * layout.tp for p in range(layout.pp) for s in shards]
    best: dict[str, float] = {}
    for k in ranks:
        got: dict[str, float] = defaultdict(float)
        for _, kind, wire in comm_terms(specs, layout, global_batch, seq_len, hidden, rank=k, router_aux=router_aux):
            got[kind] += wire
        if rank is not None or sum(got.values()) > sum(best.values()):
            best = dict(got)
    return best


def _data_parallel(every: Sequence[Held], layout: Layout, n: int, r: int, m: int,
                   exact: set[str]) -> list[tuple[str, str, float]]:  # fmt: skip
    """Gradient and parameter traffic of the ZeRO engine (stage 0-2) or FSDP2 (stage 3) over ``n x r`` ranks.

    The engine of stages 0-2 handles trainable parameters only; FSDP2 gathers frozen ones too.
    """
    tensors = [t for t in every if t.spec.trainable]
    if layout.dp == 1 or not every:
        return []
    prec = layout.precision
    full = sum(t.numel * param_bytes(t.spec, prec) for t in tensors)
    padded = sum(t.padded(n) * n * param_bytes(t.spec, prec) for t in tensors)
    if layout.powersgd_rank:  # ZeRO 0-1: an all-reduce of P, Q, what is not compressed and ``exact``, over all dp
        rank = layout.powersgd_rank
        sent = sum((t.numel if t.spec.name in exact else compressed_numel([t.shape], rank)) * param_bytes(t.spec, prec)
                   for t in tensors)  # fmt: skip
        shards = [("dp", "all_gather", _ring("all_gather", padded, n))] if layout.zero_stage else []
        return [("dp", "all_reduce", _ring("all_reduce", sent, n * r)), *shards]  # over every replica's ranks
    if layout.zero_stage == 0:
        return [("dp", "all_reduce", _ring("all_reduce", full, n) + _ring("all_reduce", full, r))]
    if layout.zero_stage in (1, 2):
        # Stage 2 reduces as each backward's gradients become ready (per microbatch); under a pipeline, or at
        # stage 1, once after the step's last backward.
        times = m if layout.zero_stage == 2 and layout.pp == 1 else 1
        return [
            ("dp", "reduce_scatter", times * _ring("reduce_scatter", padded, n)),
            ("dp", "all_reduce", times * _ring("all_reduce", padded / n, r)),
            ("dp", "all_gather", _ring("all_gather", padded, n)),
        ]
    low = compute_bytes(prec)

    def gather(t: Held) -> int:  # mixed precision gathers the compute dtype (FSDP2's MixedPrecisionPolicy)
        if t.spec.quantised is not None:  # a 4-bit base gathers its codes and scales (torchao's all-gather extension)
            stored, whole = t.spec.quantised
            return stored - whole
        if layout.fp8 and t.spec.fp8:  # cast before the gather: one byte per element (planner/fp8.py)
            return t.padded(n) * n
        return t.padded(n) * n * (param_bytes(t.spec, prec) if prec in ("32-true", "bf16-true") else low)

    gathered = sum(gather(t) for t in every)
    blocks = sum(gather(t) for t in every if t.spec.block is not None)
    if layout.zero_quantized_weights:  # each unit's shards as int8 codes with an fp32 scale per block of its input
        units: dict[Optional[int], int] = defaultdict(int)  # a trunk block's, or the root's (what runs outside)
        for t in every:
            units[t.spec.block] += t.padded(n)
        wire = {unit: n * quantized_bytes(numel) for unit, numel in units.items()}
        gathered, blocks = sum(wire.values()), sum(b for unit, b in wire.items() if unit is not None)
    # Blocks are re-gathered for backward (reshard after forward) except under a pipeline; the root unit (what runs
    # outside the trunk) stays gathered from forward to backward. Without a pipeline every microbatch repeats it.
    times = 1 if layout.pp > 1 else m
    again = 0 if layout.pp > 1 else blocks
    # fp8: one fp32 scale per fp8 weight, all-reduced over the shards before every forward that gathers them
    # (fp8/scales.py): under a pipeline the first microbatch's only, the blocks staying gathered.
    scales = times * _ring("all_reduce", 4 * sum(t.spec.fp8 for t in every), n) if layout.fp8 else 0.0
    return [
        ("dp", "all_gather", times * _ring("all_gather", gathered + again, n)),
        ("dp", "reduce_scatter", times * _ring("reduce_scatter", padded, n)),
        ("dp", "all_reduce", times * _ring("all_reduce", padded / n, r) + scales),
    ]


def _router(tensors: Sequence[Held], layout: Layout, tokens: int, m: int, aux: bool) -> list[tuple[str, str, float]]:
    """Each stacked-experts router's logits gathered over the token group (dp) per microbatch, with its row count."""
    n = layout.dp
    routers = [t for t in tensors if t.spec.role == "router"]
    if n == 1 or not routers:
        return []
    per_mb = tokens // m
    low = compute_bytes(layout.precision)  # the router is a Linear: autocast gives its logits the compute dtype
    terms = []
    for t in routers:
        experts = t.spec.shape[0]
        counts = m * _ring("all_gather", 8 * n, n)  # one int64 row count per rank
        logits = m * _ring("all_gather", per_mb * experts * low * n, n)
        terms += [("router", "all_gather", counts + logits)]
        if aux:
            terms.append(("router", "all_reduce", m * _ring("all_reduce", per_mb * experts * low * n, n)))
    return terms


def _tied(
    specs: Sequence[ParamSpec], tensors: Sequence[Held], layout: Layout, pp_rank: int, shard: int, n: int
) -> list[tuple[str, str, float]]:
    """A tied weight's gradient summed between the first and last stage ranks (2 ranks), once per step."""
    if layout.pp == 1:
        return []
    stages = local_stages(layout, pp_rank)
    last = len(stage_ranges(specs, layout)) - 1
    if 0 in stages and last in stages:
        return []  # one rank runs both ends (the V schedules): the stage modules share the parameter
    out = []
    for t in tensors:
        if t.spec.end == "both":
            # Under ZeRO-3 the copies are FSDP2 shards by then: this rank's real rows.
            numel = t.rows_of(n, shard) if layout.zero_stage == 3 else t.numel
            # ... and a flag beside it, in the same all-reduce: whether a stage used it (tied.py, `_sum_grads`).
            out.append(("tied", "all_reduce",
                        _ring("all_reduce", (numel + 1) * param_bytes(t.spec, layout.precision), 2)))  # fmt: skip
    return out


def _on_every_stage(tensors: Sequence[Held], layout: Layout) -> list[tuple[str, str, float]]:
    """Parameters every stage holds (a block that runs more than once, scalars on the trunk's container): their
    gradients summed over the pipeline group, once per step (`lightning_par.parallel.pipeline.tied.OnEveryStage`)."""
    every = [t for t in tensors if t.spec.end == "every" or t.spec.calls]
    if layout.pp == 1 or not every:
        return []
    size = sum((t.numel + 1) * param_bytes(t.spec, layout.precision) for t in every)  # each with its flag
    return [("every stage", "all_reduce", _ring("all_reduce", size, layout.pp))]


def _tensor_parallel(
    specs: Sequence[ParamSpec], every: Sequence[Held], layout: Layout, tokens: int, hidden: int, n: int, m: int
) -> list[tuple[str, str, float]]:
    """Activations of the split regions (and the sequence-parallel ends and norms) over tp, and the adapters of
    split bases. A backward collective runs only where a gradient flows: into a region when a trainable parameter is
    in it or before it, out of its input when one is before it (a frozen base with adapters: none before the
    first adapter).

    Under fp8 (torchao's tensor-wise scaling), each cast of a split weight or of an activation sharded over tp
    takes the whole tensor's amax: an all-reduce of one fp64 scalar, 4 per split fp8 layer and micro-batch (counted
    on the suite with and without sequence parallelism, no recomputation), and one fp32 amax per region whose input
    sequence parallelism gathers in fp8."""
    tp = layout.tp
    if tp == 1:
        return []
    prec = layout.precision
    low = compute_bytes(prec)
    # The residual stream (a region's input, its gradient) has the dtype of the weights computed with: the stored
    # ones (fp32 under autocast, bf16 under bf16-true), or under ZeRO-3 mixed precision FSDP2's low-precision copies
    # (the embedding's output, and so the whole stream, is then in the compute dtype).
    stream = 2 if prec == "bf16-true" else low if layout.zero_stage == 3 else 4
    act = tokens * hidden  # elements of one region's input, whole over the sequence
    sp = layout.sequence_parallel  # under a pipeline too: the stages hand on each rank's sequence shard
    fwd, out_bwd, in_bwd, (first, last, entry) = _gradient_flow(specs, every)
    ag = rs = ar = 0.0
    # Under fp8, a region whose column-split projections are all fp8 gathers its input cast, one byte a value, after
    # one scalar all-reduce of its amax (parallel/fp8/sequence.py; that its code reads the input nowhere else, the
    # suite's probe checks on the model: assumed here).
    cast = _fp8_gathered(every) if sp and layout.fp8 else 0
    if sp:
        ag += (fwd - cast) * _ring("all_gather", act * stream, tp) + cast * _ring("all_gather", act, tp)
        ag += out_bwd * _ring("all_gather", act * low, tp)
        rs += fwd * _ring("reduce_scatter", act * low, tp) + in_bwd * _ring("reduce_scatter", act * stream, tp)
        # The trunk's exit gather (where its last block runs), its entry's gradient gather (where its first does).
        ag += _ring("all_gather", act * stream, tp) * (last + first * entry)
    else:
        ar += fwd * _ring("all_reduce", act * low, tp) + in_bwd * _ring("all_reduce", act * stream, tp)
    # Gradients covering this rank's tokens or its slice of a sum (sequence-parallel norms and a row split's whole
    # adapter under sequence parallelism; a column split's whole adapter): summed over tp, on the whole tensor
    # (ZeRO 0-2) or on FSDP2's gradient shard (ZeRO-3).
    partial = [t for t in every if t.spec.trainable and t.spec.block is not None and (
        (sp and t.spec.role == "norm") or (t.spec.role == "adapter_a" and not t.spec.tp_row)
        or (sp and t.spec.role == "adapter_b" and t.spec.tp_dim is None))]  # fmt: skip
    per = sum((t.padded(n) if layout.zero_stage == 3 else t.numel) * param_bytes(t.spec, prec) for t in partial)
    # A row split's adapter `a` reduces its rank-r output as its base does (reduce-scattered, its gradient gathered
    # under sequence parallelism).
    rank = sum(t.shape[0] for t in every if t.spec.role == "adapter_a" and t.spec.tp_row)
    if sp:
        rs += _ring("reduce_scatter", tokens * rank * low, tp)
        ag += _ring("all_gather", tokens * rank * low, tp)
    else:
        ar += _ring("all_reduce", tokens * rank * low, tp)
    terms = [("tp", "all_gather", ag), ("tp", "reduce_scatter", rs), ("tp", "all_reduce", ar)]
    if layout.fp8:  # the scales of fp8's casts of split weights and activations, per micro-batch (docstring)
        split = sum(1 for t in every if t.spec.fp8 and t.spec.tp_dim is not None)
        terms.append(("tp_fp8_scales", "all_reduce",
                      m * (4 * split * _ring("all_reduce", 8, tp) + cast * _ring("all_reduce", 4, tp))))  # fmt: skip
    terms.append(("sp_norms" if sp else "tp_partial", "all_reduce", _ring("all_reduce", per, tp)))
    return terms


def _fp8_gathered(every: Sequence[Held]) -> int:
    """How many split regions this rank runs whose column-split projections are all fp8 (`ParamSpec.fp8`)."""
    columns: dict[tuple[int, str], list[bool]] = {}
    for t in every:
        spec = t.spec
        if spec.block is not None and spec.region and spec.tp_dim == 0 and not spec.tp_row and not spec.role:
            if len(spec.shape) == 2:  # a projection's weight (its bias follows it)
                columns.setdefault((spec.block, spec.region), []).append(spec.fp8)
    return sum(all(flags) for flags in columns.values())


def _gradient_flow(specs: Sequence[ParamSpec], every: Sequence[Held]) -> tuple[int, int, int, tuple[int, int, int]]:
    """Over the split regions in forward order (their row-parallel weights' order) of the blocks this rank holds
    (``every``; the whole model's ``specs`` say where a gradient flows): how many run, how many get their output's
    gradient, how many pass a gradient to their input; and (1/0) whether this rank runs the trunk's first block,
    its last, and whether the trunk's entry gets a gradient. Parameters in a block outside its regions (norms)
    count as before the block's regions."""
    flowing = any(s.trainable for s in specs if s.block is None and s.end in ("first", "both", "every"))
    entry = int(flowing)
    blocks: dict[int, list[str]] = {}
    inside: dict[str, bool] = {}
    loose: dict[int, bool] = {}
    for spec in specs:
        b = spec.block
        if b is None:
            continue
        if spec.tp_row and not spec.role.startswith("adapter"):
            key = spec.region or spec.name
            blocks.setdefault(b, []).append(key)
            inside[key] = inside.get(key, False) or spec.trainable
        elif spec.region:
            inside[spec.region] = inside.get(spec.region, False) or spec.trainable
        else:
            loose[b] = loose.get(b, False) or spec.trainable
    mine = {t.spec.block for t in every if t.spec.block is not None}
    everything = set(blocks) | set(loose)
    fwd = out_bwd = in_bwd = 0
    for b in sorted(everything):
        flowing = flowing or loose.get(b, False)
        for key in blocks.get(b, []):
            if b in mine:
                fwd += 1
                out_bwd += int(flowing or inside[key])
                in_bwd += int(flowing)
            flowing = flowing or inside[key]
    ends = (int(min(everything, default=-1) in mine), int(max(everything, default=-1) in mine), entry)
    return fwd, out_bwd, in_bwd, ends
