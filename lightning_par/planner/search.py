"""Every layout this suite can run for a model on a cluster, predicted and ranked by step time.

The space: tp over the divisors of a node's GPUs (tensor parallelism never crosses a node), pp over the divisors of
what is left (up to the block count), cp in {1, 2, 4}, the rest data parallel with ZeRO 0-3 (and hybrid sharding,
ZeRO-3 inside a node and replicas across, when the data-parallel ranks span nodes), ep over the divisors of the
data-parallel ranks that divide the experts, micro-batch sizes 1-8, recomputation none / selective / full, the
1F1B and interleaved schedules, sequence parallelism whenever tp > 1 (and no pipeline: this suite's stages exchange
whole activations). PipeDream-2BW (``"2bw"``, arXiv 2006.09503) is priced when asked for (`Layout(pp_schedule="2bw")`,
``lightning-par estimate --schedule 2bw``) but never proposed: its weights update one step late, which changes the
optimisation, not only its speed. A layout is feasible when `Layout.check`
accepts it and its predicted memory fits `USABLE_FRACTION` of the GPU (the rest: the CUDA context, NCCL buffers and
the caching allocator's fragmentation, about 6-8 % in practice).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterable, Iterator, Sequence
from typing import Optional

from lightning_par.planner.devices import GIB, Device
from lightning_par.planner.estimate import Estimate, estimate
from lightning_par.planner.layout import Layout, LayoutError
from lightning_par.planner.model import ModelDesc
from lightning_par.planner.params import ParamSpec

USABLE_FRACTION = 0.92


@dataclasses.dataclass(frozen=True)
class Ranking:
    """Feasible layouts fastest first, and the infeasible ones with their reason."""

    feasible: list[Estimate]
    infeasible: list[tuple[Layout, str]]

    def reasons(self) -> dict[str, int]:
        """How many layouts each kind of reason ruled out (the reason's first clause)."""
        counts: dict[str, int] = {}
        for _, why in self.infeasible:
            key = why.split(";")[0].split(":")[0]
            counts[key] = counts.get(key, 0) + 1
        return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(
    desc: ModelDesc,
    world: int,
    gpus_per_node: int,
    global_batch: Optional[int] = None,
    per_rank_batch: Optional[int] = None,
    precision: str = "bf16-mixed",
) -> Iterator[tuple[Layout, int]]:
    """Every layout of the module docstring's space for ``world`` ranks, not yet checked, with its global batch.

    Give ``global_batch`` (fixed; layouts differ in micro-batch size and accumulation) or ``per_rank_batch`` (the
    samples one data-parallel rank loads per step, as a Lightning data loader's ``batch_size``: the global batch
    is then that times the data-parallel degree, and pipelines split it into micro-batches).
    """
    if (global_batch is None) == (per_rank_batch is None):
        raise ValueError("give exactly one of global_batch and per_rank_batch")
    for tp in [d for d in _divisors(world) if d <= gpus_per_node]:
        for pp in [d for d in _divisors(world // tp) if d <= desc.layers]:
            for cp in [c for c in (1, 2, 4) if (world // (tp * pp)) % c == 0]:
                dp = world // (tp * pp * cp)
                batch = global_batch if global_batch is not None else dp * (per_rank_batch or 0)
                eps = [e for e in _divisors(dp) if desc.experts % e == 0] if desc.experts else [1]
                # Interleaved with 2 stages per rank and, where the blocks allow, 3 and 4 (Megatron's virtual sizes).
                looped = [("interleaved_1f1b", v) for v in (2, 3, 4) if v == 2 or pp * v <= desc.layers]
                schedules = [("1f1b", 1), *looped] if pp > 1 else [("1f1b", 1)]
                sizes = (1, 2, 4, 8) if global_batch is not None or pp > 1 else (per_rank_batch or 1,)
                for zero, ep, (sched, vpp), mbs, recompute in itertools.product(
                    range(4) if dp > 1 else [0], eps, schedules, sizes, ("none", "selective", "full")
                ):
                    if batch % (dp * mbs):
                        continue
                    base = Layout(
                        tp=tp, pp=pp, vpp=vpp, dp_shard=dp, zero_stage=zero, ep=ep, cp=cp, pp_schedule=sched,
                        microbatches=batch // (dp * mbs) if pp > 1 else None, micro_batch_size=mbs,
                        recompute=recompute, sequence_parallel=tp > 1, precision=precision,
                    )  # fmt: skip
                    yield base, batch
                    inner = gpus_per_node // (tp * cp) if gpus_per_node % (tp * cp) == 0 else 0
                    if zero == 3 and inner > 1 and dp > inner and dp % inner == 0:
                        yield dataclasses.replace(base, dp_replicate=dp // inner, dp_shard=inner), batch


def rank_layouts(
    desc: ModelDesc,
    dev: Device,
    layouts: Iterable[tuple[Layout, int]],
    seq_len: int,
    profile: str = "torch",
    specs: Optional[Sequence[ParamSpec]] = None,
) -> Ranking:
    """Predict every ``(layout, global batch)`` and rank the ones that fit by time per sample (by step time when
    the global batch is the same for all).

    Args:
        profile, specs: as for `lightning_par.planner.estimate.estimate`.
    """
    usable = dev.hbm_gib * GIB * USABLE_FRACTION
    feasible: list[tuple[float, Estimate]] = []
    infeasible: list[tuple[Layout, str]] = []
    for layout, batch in layouts:
        try:
            est = estimate(desc, layout, dev, batch, seq_len, profile=profile, specs=specs)
        except LayoutError as err:
            infeasible.append((layout, str(err)))
            continue
        if est.total > usable:
            infeasible.append((layout, f"out of memory: {est.total / GIB:.1f} GiB > {usable / GIB:.1f} GiB usable"))
            continue
        feasible.append((est.time.total / batch, est))
    feasible.sort(key=lambda pair: (pair[0], pair[1].total))
    return Ranking([e for _, e in feasible], infeasible)


def format_ranking(ranking: Ranking, top: int = 10) -> str:
    """A table of the ``top`` fastest layouts and a count of the others by reason."""
    rows = [f"{'#':>3}  {'step s':>9}  {'MFU':>6}  {'TFLOP/s':>8}  {'GiB':>7}  layout"]
    for i, e in enumerate(ranking.feasible[:top], 1):
        rows.append(f"{i:>3}  {e.time.total:9.4g}  {e.mfu:6.1%}  {e.tflops_per_gpu:8.1f}  {e.total / GIB:7.2f}  "
                    f"{e.layout.describe()}")  # fmt: skip
    if len(ranking.feasible) > top:
        rows.append(f"     ... {len(ranking.feasible) - top} more feasible layouts")
    if not ranking.feasible:
        rows.append("     no layout fits: add GPUs, lower the micro-batch or sequence length, or use offload")
    for why, n in ranking.reasons().items():
        rows.append(f"  infeasible x{n}: {why}")
    return "\n".join(rows)
