"""What the multi-rank benchmarks share: the step timer, the step-time line of alternated rounds, and printing on
rank 0."""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning as L
import torch.distributed as dist

from lightning_par.utils import clean_exit


class StepTimer(L.Callback):
    """Wall time of each optimizer step (one batch, no accumulation), warm-up steps skipped.

    ``times``: from the batch's start hook to its end hook. ``cycles``: from one step's end hook to the next one's,
    so nothing a strategy leaves running after a step (ZeRO-1/2's deferred all-gather) escapes the window, and the
    loop's own time between batches is in it. ``cpu``: this process's CPU time (every thread: gloo's too) over the
    same cycles, which time spent waiting for a core on a shared machine does not inflate.
    """

    lightning_par_reads_weights = False  # ZeRO-1/2's all-gather after the step may run on through these hooks

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self.cycles: list[float] = []
        self.cpu: list[float] = []
        self._t0 = 0.0
        self._last: tuple[float, float] = (0.0, 0.0)

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        now = (time.perf_counter(), time.process_time())
        if batch_idx >= self.warmup:
            self.times.append(now[0] - self._t0)
            if self._last[0]:  # a cycle needs the previous step's end (none before the first step)
                self.cycles.append(now[0] - self._last[0])
                self.cpu.append(now[1] - self._last[1])
        self._last = now


def ratio_line(label: str, times: list[float], baseline: list[float], baseline_label: str) -> str:
    """Median ms of ``times`` and of ``baseline`` (one entry per round), and their per-round ratios with the median."""
    ratios = [a / b for a, b in zip(times, baseline)]
    return (
        f"step time median ms: {label} {statistics.median(times):.1f}, {baseline_label} "
        f"{statistics.median(baseline):.1f}; per round {[round(x, 3) for x in ratios]}, median "
        f"{statistics.median(ratios):.3f}"
    )


def finish(lines: list[str]) -> None:
    """Print the report on rank 0 and leave the process group cleanly (docs/benchmarks.md)."""
    if dist.get_rank() == 0:
        print("\n".join(lines), flush=True)
    clean_exit()
