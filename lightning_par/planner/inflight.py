"""Micro-batches a pipeline rank holds activations for, per schedule of the suite, and the blocks each rank runs.

A micro-batch's activations live from its forward until its backward (its weight backward under the zero-bubble
schedules, whose input backward keeps the graph for it). The closed forms below are those of the tables torch's
schedules run (`torch.distributed.pipelining`, as `lightning_par.parallel.pipeline.schedule` drives them);
``tests/test_plan_activations.py`` replays those tables with `inflight_from_table` and compares. Pure Python.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Optional

from lightning_par import axes
from lightning_par.planner.layout import SCHEDULES, Layout

_V_STYLE = ("zbv", "dualpipev")  # rank r runs stages r and 2 pp - 1 - r (parallel/pipeline/schedule.py)


def inflight_microbatches(
    schedule: str, pp: int, microbatches: Optional[int] = None, rank: int = 0, virtual: Optional[int] = None
) -> float:
    """Peak micro-batches whose activations pipeline rank ``rank`` holds at once, in units of one micro-batch
    through all the rank's blocks (each of its ``virtual`` stages holds 1 / virtual of them).

    Closed forms of the tables torch's schedules run (checked against them in ``tests/test_plan_activations.py``;
    a micro-batch counts from its forward until its full or weight backward): GPipe and looped BFS hold all ``m``;
    1F1B ``min(m, p - r)``, and so does PipeDream-2BW (Narayanan et al., arXiv 2006.09503), which runs 1F1B's
    steady state across the step boundary (`lightning_par.analysis.pipeline_timeline.two_bw_order`); interleaved
    1F1B warms up ``(v - 1) m_r + 2 (p - 1 - r)`` chunk forwards (``m_r``: the micro-batches of one round), so rank
    0 holds ``p (1 + (p - 1) / (p v))``, the factor of Korthikanti et al. section 4.2.3; interleaved zero-bubble
    ``((v - 1) m_r + p) / v``; ZBV ``min(m, p, (m + 1 + r) / 2)``; DualPipeV ``p + 1/2``: each overlapped
    forward-backward pair runs its forward first, so both are held for a moment.

    Args:
        microbatches: per step; ``None``: enough to reach the steady state (GPipe and looped BFS need a number).
        virtual: stages per rank (default: the suite's, `lightning_par.planner.layout.SCHEDULES`).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"pp_schedule={schedule!r} is not one of {sorted(SCHEDULES)}")
    if pp == 1:
        return 1.0
    v = virtual or SCHEDULES[schedule]
    if microbatches is None:
        if axes.SCHEDULES[schedule].all_forwards_first:
            raise ValueError(
                f"{schedule} holds every micro-batch of the step: pass microbatches (or set Layout.microbatches)"
            )
        m, per_round = float("inf"), pp
    else:
        m, per_round = microbatches, microbatches // max(1, microbatches // pp)
    if axes.SCHEDULES[schedule].all_forwards_first:
        return float(m)
    if schedule in ("1f1b", "2bw"):  # 2bw: 1F1B's steady state across the step boundary (arXiv 2006.09503)
        return float(min(m, pp - rank))
    if schedule == "interleaved_1f1b":
        return min(m * v, (v - 1) * per_round + 2 * (pp - 1 - rank) + 1) / v
    if schedule == "interleaved_zb":
        return min(m * v, (v - 1) * per_round + pp) / v
    if schedule == "zbv":
        return float(min(m, pp, (m + 1 + rank) / 2))
    return pp + (0.5 if m > pp else 0.0)  # dualpipev


def inflight_from_table(order: Mapping[int, Sequence[Any]], virtual: int) -> dict[int, float]:
    """Per rank, the peak micro-batches in flight in a schedule table shaped like torch's ``pipeline_order``
    (actions with ``stage_index``, ``computation_type`` F / B / I / W and ``sub_actions`` for overlapped pairs): a
    micro-batch of a stage counts from its ``F`` to its ``B`` or ``W``, divided by ``virtual`` stages per rank."""
    peaks = {}
    for rank, actions in order.items():
        live: dict[int, int] = {}
        peak = 0
        for action in actions:
            for part in (getattr(action, "sub_actions", None) or (action,)) if action is not None else ():
                kind = str(getattr(part.computation_type, "value", part.computation_type))
                step = 1 if kind == "F" else -1 if kind in ("B", "W") else 0
                live[part.stage_index] = live.get(part.stage_index, 0) + step
                peak = max(peak, sum(live.values()))
        peaks[rank] = peak / virtual
    return peaks


def rank_blocks(layout: Layout, layers: int, rank: int) -> tuple[list[int], bool, bool, int]:
    """(indices of the blocks pipeline rank ``rank`` runs, whether it runs the embedding, the head, its stages).

    Blocks split into ``pp x v`` contiguous stages, earlier stages taking the remainder; the loop schedules put
    stage s on rank s mod pp, the V schedules put stages r and 2 pp - 1 - r on rank r."""
    if layout.pp == 1:
        return list(range(layers)), True, True, 1
    v = layout.vpp if layout.vpp > 1 else SCHEDULES[layout.pp_schedule]
    n = layout.pp * v
    starts = [i * (layers // n) + min(i, layers % n) for i in range(n + 1)]  # earlier stages take the remainder
    own = (
        [rank, 2 * layout.pp - 1 - rank] if layout.pp_schedule in _V_STYLE else [rank + k * layout.pp for k in range(v)]
    )
    return [i for s in sorted(own) for i in range(starts[s], starts[s + 1])], 0 in own, n - 1 in own, v
