"""The bubble a pipeline schedule has by construction: its action table replayed with free communication.

torch's schedules describe themselves as a table, ``{rank: [action or None, ...]}`` (``schedule.pipeline_order``),
whose actions are forward ``F``, full backward ``B``, input gradient ``I``, weight gradient ``W`` and DualPipeV's
overlapped ``F;B`` pairs, each for one stage and microbatch. Replaying that table, with every rank running its own
actions in order and each action starting once its inputs exist, gives the step time and idle fraction the
schedule would have if communication and host overhead were free. For GPipe and 1F1B that is the textbook
(p-1)/(m+p-1) (Huang et al., arXiv 1811.06965); for interleaved 1F1B (p-1)/(v m+p-1) (Narayanan et al., arXiv
2104.04473); for the zero-bubble family it is the figure the closed forms of Qi et al. (arXiv 2401.10241) only
bound, for the order torch actually runs. The benchmark compares measured bubbles against it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

_Key = tuple[str, int, int]  # (what is ready: "F" output, "I" input gradient, "W" weight gradient; stage; microbatch)


@dataclasses.dataclass(frozen=True)
class Timeline:
    """A replayed schedule.

    Args:
        makespan: time from the first action to the last, in the cost unit.
        busy: per rank, the summed cost of its actions.
    """

    makespan: float
    busy: dict[int, float]

    @property
    def bubble(self) -> float:
        """Idle fraction of the step, averaged over ranks."""
        return sum(1 - b / self.makespan for b in self.busy.values()) / len(self.busy)


class Action(NamedTuple):
    """One entry of a pipeline table, shaped like torch's ``_Action``."""

    stage_index: int
    computation_type: str
    microbatch_index: int | None = None
    sub_actions: tuple[Any, ...] | None = None


def one_f_one_b_order(pp: int, microbatches: int) -> dict[int, list[Action]]:
    """The table torch's ``Schedule1F1B`` runs: on stage r, ``min(m, pp - r)`` warm-up forwards, then alternating
    backward and forward, then the remaining backwards.

    ``Schedule1F1B.pipeline_order`` is only descriptive in torch 2.13 (the step loop does not read it) and numbers
    the last stage's forwards from 1, so it cannot be replayed; this is the order ``_step_microbatches`` executes.
    """
    order: dict[int, list[Action]] = {}
    for r in range(pp):
        warm = min(microbatches, pp - r)
        acts = [Action(r, "F", i) for i in range(warm)]
        for i in range(microbatches):
            acts.append(Action(r, "B", i))
            if warm + i < microbatches:
                acts.append(Action(r, "F", warm + i))
        order[r] = acts
    return order


def two_bw_order(pp: int, microbatches: int) -> tuple[dict[int, list[Action]], set[_Key]]:
    """One steady-state step of PipeDream-2BW (`lightning_par.parallel.pipeline.two_bw`) and what it starts with.

    Step t's microbatches are numbered ``t m .. t m + m - 1`` (here t = 1). Stage s runs 1F1B's steady state across
    the step boundary: forward ``t m + j`` then backward ``t m + j - (p - 1 - s)``, for j = 0 .. m - 1, so its
    first ``p - 1 - s`` backwards finish microbatches the previous step started. Returned with the table: the results
    that previous step left (forward outputs of every stage, and the one input gradient each stage received at its
    end), for `replay`'s ``given``. The step boundary is a barrier (the last stage's loss is broadcast to every rank).
    """
    m, t = microbatches, 1
    order: dict[int, list[Action]] = {}
    given: set[_Key] = set()
    for s in range(pp):
        lag = pp - 1 - s
        order[s] = [a for j in range(m) for a in (Action(s, "F", t * m + j), Action(s, "B", t * m + j - lag))]
        given.update(("F", s, t * m - i) for i in range(1, lag + 1))
        if s < pp - 1:  # received at the previous step's end: the next stage's last backward of that step
            given.add(("I", s + 1, t * m - lag))
    return order, given


def _kind(action: Any) -> str:
    return str(getattr(action.computation_type, "value", action.computation_type))


def _parts(action: Any) -> Sequence[Any]:
    return action.sub_actions if action.sub_actions else (action,)


def _needs(part: Any, last_stage: int) -> list[_Key]:
    kind, s, mb = _kind(part), part.stage_index, part.microbatch_index
    if kind == "F":
        return [("F", s - 1, mb)] if s > 0 else []
    if kind in ("B", "I"):
        return [("F", s, mb)] + ([("I", s + 1, mb)] if s < last_stage else [])
    if kind == "W":
        return [("I", s, mb)]
    return []


def compute_actions(order: Mapping[int, Sequence[Any]]) -> dict[int, list[Any]]:
    """Per rank, the table's compute actions (F, B, I, W and overlapped pairs), without gaps and communication."""
    return {
        r: [a for a in acts if a is not None and (a.sub_actions or _kind(a) in "FBIW")] for r, acts in order.items()
    }


def replay(
    order: Mapping[int, Sequence[Any]], f: float, b: float, w: float, given: Iterable[_Key] = ()
) -> Timeline:
    """Replay ``order`` (a torch ``pipeline_order``) with forward ``f``, input-gradient ``b`` and weight-gradient
    ``w`` per action; a full backward costs ``b + w``. Other actions (communication, gradient reduction,
    resharding) cost nothing. ``given``: results ready at time 0, made by an earlier step (``("F", stage, mb)``
    forward outputs, ``("I", stage, mb)`` input gradients): a schedule whose steps overlap (`two_bw_order`).

    Raises:
        ValueError: the table waits on an action no rank runs (a malformed or truncated table).
    """
    cost = {"F": f, "I": b, "W": w, "B": b + w}
    actions = compute_actions(order)
    last = max(p.stage_index for acts in actions.values() for a in acts for p in _parts(a))
    done: dict[_Key, float] = dict.fromkeys(given, 0.0)
    clock = dict.fromkeys(actions, 0.0)
    busy = dict.fromkeys(actions, 0.0)
    nxt = dict.fromkeys(actions, 0)
    remaining = sum(len(a) for a in actions.values())
    while remaining:
        progressed = False
        for r, acts in actions.items():
            while nxt[r] < len(acts):
                parts = _parts(acts[nxt[r]])
                needs = [k for p in parts for k in _needs(p, last)]
                if any(k not in done for k in needs):
                    break
                start = max([clock[r], *(done[k] for k in needs)])
                for p in parts:
                    kind, key = _kind(p), (p.stage_index, p.microbatch_index)
                    start += cost[kind]
                    busy[r] += cost[kind]
                    for ready in {"F": "F", "I": "I", "W": "W", "B": "IW"}[kind]:
                        done[(ready, *key)] = start
                clock[r] = start
                nxt[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(acts[nxt[r]]) for r, acts in actions.items() if nxt[r] < len(acts)}
            raise ValueError(f"pipeline table cannot progress: next actions {stuck} wait on actions no rank runs")
    return Timeline(makespan=max(clock.values()), busy=busy)
