"""What the multi-rank benchmarks share: the step-time line of alternated rounds, and printing on rank 0."""

from __future__ import annotations

import statistics

import torch.distributed as dist

from lightning_par.utils import clean_exit


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
