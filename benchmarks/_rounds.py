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
    """Wall time of each optimizer step (one batch, no accumulation), warm-up steps skipped."""

    lightning_par_reads_weights = False  # ZeRO-1/2's all-gather after the step may run on through these hooks

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.times: list[float] = []
        self._t0 = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx >= self.warmup:
            self.times.append(time.perf_counter() - self._t0)


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
