"""What one rank did during a pipeline training step: each stage action (F, B, I, W) and each wait on its peers.

torch's schedules run every action through the stage's ``forward_one_chunk`` / ``backward_one_chunk`` /
``backward_weight_one_chunk`` and wait on every point-to-point transfer through one function (`_compat`'s
``pipeline_p2p_wait``). `StepTrace` times both: the stage methods are wrapped on our own stage objects, the wait is
wrapped once per process and records only while a trace is active. The bubble of a step is then measured from the
schedule's own waits: time inside them over the step's time on this rank (the bubble benchmark's definition,
docs/benchmarks_history.md "Pipeline bubble", without the edges before the first and after the last action, which a rank
spends in the data-parallel collectives that follow).

Cost: two ``perf_counter`` calls per action and per wait. No Lightning here.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any, Optional

from lightning_par import _compat

KINDS = ("F", "B", "I", "W", "wait")


@dataclasses.dataclass(frozen=True)
class Span:
    """One interval of the step on this rank.

    Args:
        kind: ``"F"`` forward, ``"B"`` full backward, ``"I"`` input gradient, ``"W"`` weight gradient, ``"wait"``
            waiting on a transfer from or to a peer.
        start, end: seconds from the step's start.
        stage: the stage of an action (-1 for a wait).
        microbatch: the microbatch of an action (-1 for a wait).
    """

    kind: str
    start: float
    end: float
    stage: int = -1
    microbatch: int = -1


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One rank's pipeline training step.

    Args:
        spans: its actions and waits, in order.
        duration: seconds from the schedule's start to its end on this rank.
    """

    spans: tuple[Span, ...]
    duration: float

    @property
    def waiting(self) -> float:
        """Seconds spent waiting on peers."""
        return sum(s.end - s.start for s in self.spans if s.kind == "wait")

    @property
    def bubble(self) -> float:
        """The idle fraction of the step on this rank: waiting over the step's time."""
        return self.waiting / self.duration if self.duration > 0 else 0.0


_ACTIVE: list[StepTrace] = []  # the trace recording now (one step runs at a time in a process)


def _timed_wait(original: Callable[[list[Any]], None], work: list[Any]) -> None:
    if not _ACTIVE:
        original(work)
        return
    trace = _ACTIVE[-1]
    start = time.perf_counter()
    original(work)
    trace.add("wait", start, time.perf_counter())


@functools.cache
def _install_wait_hook() -> None:
    # Once per process: every schedule of every runner waits through this one function.
    _compat.set_pipeline_p2p_wait(functools.partial(_timed_wait, _compat.pipeline_p2p_wait()))


class StepTrace:
    """Records the actions and waits of this rank's pipeline training steps; the latest step is `last`."""

    def __init__(self) -> None:
        self.last: Optional[StepRecord] = None
        self._spans: list[Span] = []
        self._t0 = 0.0

    def watch(self, stage: Any) -> None:
        """Time a torch ``PipelineStage``'s actions (wraps its three action methods on the instance)."""
        _install_wait_hook()
        forward, backward, weight = stage.forward_one_chunk, stage.backward_one_chunk, stage.backward_weight_one_chunk
        index = stage.stage_index

        def timed_forward(chunk: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed("F", index, chunk, forward, chunk, *args, **kwargs)

        def timed_backward(chunk: int, *args: Any, **kwargs: Any) -> Any:
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            return self._timed("B" if full else "I", index, chunk, backward, chunk, *args, **kwargs)

        def timed_weight(chunk: int, *args: Any, **kwargs: Any) -> Any:
            return self._timed("W", index, chunk, weight, chunk, *args, **kwargs)

        stage.forward_one_chunk, stage.backward_one_chunk = timed_forward, timed_backward
        stage.backward_weight_one_chunk = timed_weight

    def _timed(self, kind: str, stage: int, chunk: int, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not _ACTIVE or _ACTIVE[-1] is not self:
            return fn(*args, **kwargs)  # evaluation steps and set-up probes are not traced
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.add(kind, start, time.perf_counter(), stage, chunk)

    def add(self, kind: str, start: float, end: float, stage: int = -1, microbatch: int = -1) -> None:
        """Record one span (absolute ``perf_counter`` times)."""
        self._spans.append(Span(kind, start - self._t0, end - self._t0, stage, microbatch))

    def __enter__(self) -> StepTrace:
        self._spans = []
        self._t0 = time.perf_counter()
        _ACTIVE.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        _ACTIVE.remove(self)
        if exc[0] is None:
            self.last = StepRecord(tuple(self._spans), time.perf_counter() - self._t0)
