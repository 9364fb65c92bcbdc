"""A thread per rank that ends a stuck job with a report naming the cause, and names a lost rank.

Hangs: a collective that one rank never joins, a pipeline transfer never sent, a rank stalled in its data loader
all leave the other ranks waiting until the backend's timeout (and on NCCL, its watchdog), with no word of who
waits for whom. Here each rank times its training steps; when one runs past its limit (a fixed number of seconds,
or a multiple of the median step), that rank reads where its main thread is blocked
(`lightning_par.guards.blocked`: the collective, its group and sequence number, the pipeline action) and posts it in
the job's store. Every other rank sees the post at its next beat and posts its own, whatever it is doing; once all
live ranks posted (or a grace period passed), the lowest rank that posted prints the summary, naming the ranks
that did not reach the collective the others wait in, each rank prints its own line, and every rank exits with
`HUNG_EXIT` instead of waiting for the backend.

Lost ranks: each rank's thread beats in the store every ``beat_s`` and watches its two successors' beats. A rank
whose beats stop without the end mark every rank writes when it leaves (normally or with an error) is lost: killed,
out of memory, or on a failed machine. A rank blocked in a step when a loss is known exits with `LOST_EXIT` and a
message naming the lost rank; a rank whose collective failed because of it (gloo reports a closed connection, not
whose) gets that name added to its error (`explain`).

The store is the default process group's (torchrun's agent holds it, or rank 0 under Lightning's launcher); its
traffic is a few small keys per rank and beat. No Lightning here.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any, Optional

from lightning_par.guards.blocked import Blocked, recorded, where_blocked

HUNG_EXIT = 124  # the exit status of a job the watchdog ended as stuck (`timeout`'s)
LOST_EXIT = 125  # ... and of a rank ended because another rank was lost
_RUNS = [0]  # watchdogs made in this process: every rank makes them in the same order, so the count keys a run


class Watchdog:
    """Heartbeats, lost-rank detection and hang reports for one rank of one run.

    Args:
        store: the job's key-value store (``torch.distributed.Store``).
        rank, world: this rank and the number of ranks.
        groups: process group -> name (`lightning_par.guards.blocked.group_names`).
        hang_after_s: a step running longer than this is a hang; ``None``: ``hang_factor`` x the median of the steps
            so far (at least ``hang_floor_s``), and ``first_steps_s`` until 3 steps are timed.
        lost_after_s: a rank silent this long, without its end mark, is lost.
        beat_s: the period of beats and checks.
        exit: how a rank ends itself (``os._exit``: the main thread is blocked in C++ and cannot be interrupted).
    """

    def __init__(
        self,
        store: Any,
        rank: int,
        world: int,
        groups: Mapping[Any, str],
        *,
        hang_after_s: Optional[float] = None,
        hang_factor: float = 10.0,
        hang_floor_s: float = 60.0,
        first_steps_s: float = 540.0,
        lost_after_s: float = 5.0,
        beat_s: float = 0.5,
        exit: Callable[[int], Any] = os._exit,
    ) -> None:
        _RUNS[0] += 1
        self.prefix = f"lightning_par/watchdog/{_RUNS[0]}/"
        self.store, self.rank, self.world, self.groups = store, rank, world, groups
        self.hang_after_s, self.hang_factor, self.hang_floor_s = hang_after_s, hang_factor, hang_floor_s
        self.first_steps_s, self.lost_after_s, self.beat_s, self.exit = first_steps_s, lost_after_s, beat_s, exit
        self.main = threading.main_thread()
        self.step: Optional[int] = None
        self.started = 0.0
        self.times: list[float] = []
        self.lost: list[int] = []
        self.reported_at: Optional[float] = None
        self._beat = 0
        self._seen: dict[int, tuple[str, float]] = {}  # watched rank -> (its last beat, when it changed)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="lightning_par-watchdog", daemon=True)

    # ---- called by the training loop ------------------------------------------------------------------------------
    def start(self) -> None:
        self._set(f"beat/{self.rank}", "0")
        self._thread.start()

    def step_started(self, step: int) -> None:
        self.step, self.started = step, time.monotonic()

    def step_ended(self) -> None:
        if self.step is not None:
            self.times.append(time.monotonic() - self.started)
        self.step = None

    def stop(self, error: Optional[BaseException] = None) -> None:
        """Leave: the end mark (so that silence is not read as loss), then the thread stops."""
        kind = "failed on a broken connection" if _connection_error(error) else "failed"
        reason = "done" if error is None else f"{kind}: {_first_line(error)}"
        self._set(f"end/{self.rank}", reason)
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(timeout=4 * self.beat_s)  # not left inside a store call when the interpreter exits

    def explain(self, error: BaseException) -> Optional[str]:
        """Why this rank's ``error`` happened, if another rank caused it: the rank that failed first (with its own
        error) or a rank that was lost; ``None`` when nothing points elsewhere. Marks this rank as ended. Waits up to
        ``lost_after_s`` for a silent rank to count as lost when the error is a broken connection."""
        if self.reported_at is not None or int(self.store.add(self.prefix + "hung", 0)):
            self._await_exit()  # a hang report is under way: a rank that ended first broke this one's collective
        ended = {r: self._get(f"end/{r}", "") for r in range(self.world) if r != self.rank}
        failed = {r: m.split(": ", 1)[1] for r, m in ended.items() if m.startswith("failed")}
        self.stop(error)
        # A rank that failed of its own accord is the cause; one that failed on a broken connection is a witness.
        root = [r for r, m in ended.items() if m.startswith("failed: ")]
        if root:
            return f"rank {root[0]} failed before this one ({failed[root[0]]}); this rank's error follows from it"
        if not _connection_error(error):
            return None
        first = self._beats()
        deadline = time.monotonic() + self.lost_after_s + 2 * self.beat_s
        silent = [r for r in range(self.world) if r != self.rank]
        while time.monotonic() < deadline and silent:
            time.sleep(self.beat_s)
            now = self._beats()
            silent = [r for r in silent if now.get(r) == first.get(r) and not self._get(f"end/{r}", "")]
        if not silent:
            return f"rank(s) {sorted(failed)} failed before this one, on a broken connection too" if failed else None
        return (
            f"rank(s) {silent} stopped without an error of their own (no heartbeat for {self.lost_after_s:.0f} s and "
            "no end mark: killed, out of memory, or their machine failed); this rank's error follows from it"
        )

    def _await_exit(self) -> None:
        """Let the thread finish the hang report and end the process (it posts this rank's report on its next beat
        and exits once all ranks posted); past twice its grace, go on with the error."""
        deadline = time.monotonic() + 2 * self._grace() + 4 * self.beat_s
        while time.monotonic() < deadline and self._thread.is_alive():
            time.sleep(self.beat_s)

    def _grace(self) -> float:
        return max(4 * self.beat_s + 2.0, self.lost_after_s)

    # ---- the thread --------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.wait(self.beat_s):
            try:
                self._tick()
            except Exception as err:  # the store's host is gone: its rank (or the agent) died
                if self.step is not None and not self._stop.is_set():
                    self._say(f"lost the job's store ({_first_line(err)}): the process that holds it (rank 0, or "
                              f"torchrun's agent) is gone; ending this rank")  # fmt: skip
                    self.exit(LOST_EXIT)
                return

    def _tick(self) -> None:
        now = time.monotonic()
        self._beat += 1
        self._set(f"beat/{self.rank}", str(self._beat))
        for other in sorted({(self.rank + 1) % self.world, (self.rank + 2) % self.world} - {self.rank}):
            beat = self._get(f"beat/{other}", "")
            last, since = self._seen.get(other, ("", now))
            if beat != last:
                self._seen[other] = (beat, now)
            elif now - since > self.lost_after_s and not self._get(f"end/{other}", "") and other not in self.lost:
                self.store.append(self.prefix + "lost", f"{other},")
        lost = [int(r) for r in self._get("lost", "").split(",") if r]
        if lost and self.step is not None and self.reported_at is None:
            self._say(f"rank(s) {sorted(set(lost))} stopped without an error of their own (no heartbeat for "
                      f"{self.lost_after_s:.0f} s: killed, out of memory, or their machine failed) while this rank "
                      f"is in step {self.step}: {self._where().line()}; ending this rank")  # fmt: skip
            self.exit(LOST_EXIT)
        self.lost = sorted(set(lost))
        limit = self._limit()
        if self.reported_at is None and (
            (self.step is not None and now - self.started > limit) or int(self.store.add(self.prefix + "hung", 0))
        ):
            self._report(now - self.started if self.step is not None else 0.0, limit)
        if self.reported_at is not None:
            self._finish(now)

    def _limit(self) -> float:
        if self.hang_after_s is not None:
            return self.hang_after_s
        if len(self.times) < 3:
            return self.first_steps_s
        return max(self.hang_factor * statistics.median(self.times), self.hang_floor_s)

    def _where(self) -> Blocked:
        blocked = where_blocked(self.main, self.rank, self.groups)
        blocked.recorder = recorded(self.groups)
        blocked.step = self.step
        blocked.seconds = time.monotonic() - self.started if self.step is not None else 0.0
        return blocked

    def _report(self, elapsed: float, limit: float) -> None:
        blocked = self._where()
        self._set(f"report/{self.rank}", json.dumps({**vars(blocked), "limit": limit, "over": elapsed > limit}))
        self.store.add(self.prefix + "hung", 1)
        self.reported_at = time.monotonic()

    def _finish(self, now: float) -> None:
        """Once every live rank posted (or the grace passed): the summary on the lowest poster, a line on each."""
        expected = [r for r in range(self.world) if r not in self.lost and not self._get(f"end/{r}", "")]
        reports = {r: json.loads(v) for r in range(self.world) if (v := self._get(f"report/{r}", ""))}
        if not set(expected) <= set(reports) and now - (self.reported_at or now) < self._grace():
            return
        if self.rank == min(reports):
            self._say(summary(reports, self.world, self.lost))
        else:
            self._say(f"stuck: {Blocked(**_fields(reports[self.rank])).line()}; rank {min(reports)} prints the summary")
        # Leave together: a rank that exits first breaks the connections the others still wait on, and their main
        # threads would raise before their own exit.
        self.store.add(self.prefix + "leaving", 1)
        deadline = time.monotonic() + self._grace()
        while int(self.store.add(self.prefix + "leaving", 0)) < len(reports) and time.monotonic() < deadline:
            time.sleep(0.05)
        self.exit(HUNG_EXIT)

    # ---- store helpers ---------------------------------------------------------------------------------------------
    def _set(self, key: str, value: str) -> None:
        self.store.set(self.prefix + key, value)

    def _get(self, key: str, default: str) -> str:
        full = self.prefix + key
        return self.store.get(full).decode() if self.store.check([full]) else default

    def _beats(self) -> dict[int, str]:
        return {r: self._get(f"beat/{r}", "") for r in range(self.world)}

    def _say(self, text: str) -> None:
        print(f"lightning_par watchdog, rank {self.rank}: {text}", file=sys.stderr, flush=True)


def summary(reports: Mapping[int, Mapping[str, Any]], world: int, lost: list[int]) -> str:
    """The job-wide report: every rank's line, then who did not reach the collective the others wait in."""
    blocked = {r: Blocked(**_fields(v)) for r, v in sorted(reports.items())}
    over = [r for r, v in reports.items() if v.get("over")]
    first = min(over, key=lambda r: -blocked[r].seconds) if over else min(blocked)
    lines = [f"the job is stuck: rank {first}'s step {blocked[first].step} ran past its limit of "
             f"{reports[first]['limit']:.0f} s. Where each rank is:"]  # fmt: skip
    lines += [f"  {b.line()}" for b in blocked.values()]
    by_group: dict[tuple[int, ...], dict[int, int]] = {}  # a group's ranks -> {rank in a collective on it: seq}
    for r, b in blocked.items():
        if b.ranks and b.seq is not None:
            by_group.setdefault(tuple(b.ranks), {})[r] = b.seq
    for ranks, seqs in sorted(by_group.items()):
        top = max(seqs.values())  # the collective issued last: ranks with less did not reach it
        waiting = [r for r, seq in seqs.items() if seq == top]
        behind = [r for r in ranks if seqs.get(r, -1) < top]
        if not behind:
            continue
        why = "; ".join(f"rank {r}: " + (f"{blocked[r].op or 'running'} at {blocked[r].where}" if r in blocked
                                          else "lost" if r in lost else "no report") for r in behind)  # fmt: skip
        lines.append(f"Ranks {behind} did not reach collective #{top} on {blocked[waiting[0]].group} "
                     f"({blocked[waiting[0]].op}) that ranks {waiting} wait in. {why}.")  # fmt: skip
    for r, b in blocked.items():
        if "waiting on" in b.action:
            lines.append(f"Rank {r} waits on a pipeline transfer: {b.action}.")
    if lost:
        lines.append(f"Lost ranks (no heartbeat, no end mark): {lost}.")
    lines.append(f"Ending all {world} ranks (exit status {HUNG_EXIT}) instead of waiting for the backend's timeout.")
    return "\n".join(lines)


def _fields(report: Mapping[str, Any]) -> dict[str, Any]:
    names = Blocked.__dataclass_fields__
    return {k: v for k, v in report.items() if k in names}


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"[:300]


def _connection_error(error: Optional[BaseException]) -> bool:
    """Whether ``error``, or an error it was raised from, is a collective that failed because a peer went away (gloo
    and NCCL phrasings; a pipeline stage wraps its forward's error in its own)."""
    seen = 0
    while error is not None and seen < 8:
        if isinstance(error, RuntimeError) and _connection_text(str(error)):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _connection_text(text: str) -> bool:
    low = text.lower()
    return any(w in low for w in ("connection", "closed by peer", "reset by peer", "broken pipe", "timed out", "nccl"))
