"""The suite's own deadline: before CI's hard limit kills the job with no report, name the test that was running,
list the live processes and fail.

`.ci/run` sets ``LP_SUITE_DEADLINE`` (a unix time: 85 minutes after it started, 5 before CI's limit); conftest
starts a `Watchdog` thread with what is left of it. At the deadline it prints the running test, how long it ran and
``ps`` of every process under the test process, kills them all (forked ranks and sessions included) and ends pytest
with exit code 3.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Optional

EXIT_CODE = 3


def descendants(pid: int) -> list[int]:
    """Every process whose chain of parents reaches ``pid`` (read from /proc; children of children included)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                parent[int(entry.name)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        p = frontier.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        out += kids
        frontier += kids
    return out


class Watchdog:
    """A daemon thread that ends the test session at a deadline (module docstring)."""

    def __init__(self) -> None:
        self.test: Optional[str] = None
        self.since = time.monotonic()

    def running(self, nodeid: str) -> None:
        """The test that starts now."""
        self.test, self.since = nodeid, time.monotonic()

    def start(self, limit_s: float) -> None:
        """Fire after ``limit_s`` seconds."""
        deadline = time.monotonic() + limit_s
        threading.Thread(target=self._wait, args=(deadline, limit_s), daemon=True, name="suite-watchdog").start()

    def _wait(self, deadline: float, limit_s: float) -> None:
        while time.monotonic() < deadline:
            time.sleep(5.0)
        self.fire(limit_s)

    def fire(self, limit_s: float) -> None:
        """Report, kill every process under this one, and end the session."""
        out = sys.__stderr__ or sys.stderr
        ran = time.monotonic() - self.since
        out.write(f"\n\nWATCHDOG: the test session ran past its limit of {limit_s:.0f} s (LP_SUITE_DEADLINE).\n"
                  f"running test: {self.test} (for {ran:.0f} s)\nlive processes:\n")  # fmt: skip
        with contextlib.suppress(Exception):
            ps = subprocess.run(["ps", "-eo", "pid,ppid,pgid,etimes,pcpu,rss,args", "--forest"], capture_output=True,
                                text=True, timeout=20)  # fmt: skip
            out.write(ps.stdout)
        out.flush()
        for pid in descendants(os.getpid()):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        os._exit(EXIT_CODE)
