"""Partition the trunk's blocks into pipeline stages balanced by cost.

A stage is a contiguous range of blocks. With ``virtual`` stages per rank (interleaved and V-shaped schedules)
there are ``pp * virtual`` stages; which rank runs which stage is the schedule's business
(`lightning_par.parallel.pipeline.schedule.stage_ranks`). The embedding runs before the first stage's blocks and
the head after the last stage's, so their cost is added to the end stages: a balanced split then gives the end
stages fewer blocks (Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", arXiv 2104.04473, uneven first/last stages).
"""

from __future__ import annotations

import time
from collections.abc import Collection, Sequence
from typing import Any, Optional

import torch
from torch import nn


class PartitionError(ValueError):
    """A pipeline split that cannot work; the message names the fix."""


def param_costs(blocks: Sequence[nn.Module]) -> list[float]:
    """The default cost of each block: its parameter count (forward FLOPs per token are ~2x this)."""
    return [float(sum(p.numel() for p in b.parameters())) for b in blocks]


@torch.no_grad()
def measure_block_times(
    blocks: Sequence[nn.Module], example: torch.Tensor, *extra: Any, repeats: int = 3, **kwargs: Any
) -> list[float]:
    """Measured forward time of each block (seconds, the median of ``repeats`` runs), usable as ``pp_costs``.

    Every block is fed the same ``example`` hidden state (blocks keep its shape), so the costs reflect the block
    and not its position. Attention whose cost depends on a mask or sequence length must be measured with a
    representative ``example``.

    Args:
        blocks: the trunk's blocks.
        example: a hidden state of the shape the trunk sees, e.g. ``(microbatch, seq, hidden)``.
        extra, kwargs: further arguments every block takes (rotary tables, masks).
        repeats: timed runs per block after one warm-up run.
    """
    out = []
    for block in blocks:
        block(example, *extra, **kwargs)
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            block(example, *extra, **kwargs)
            times.append(time.perf_counter() - start)
        out.append(sorted(times)[len(times) // 2])
    return out


def _check_split(split: Sequence[int], n_blocks: int, n_stages: int) -> list[int]:
    sizes = list(split)
    if len(sizes) != n_stages or any(not isinstance(s, int) or s < 1 for s in sizes) or sum(sizes) != n_blocks:
        raise PartitionError(
            f"pp_split={sizes} must be {n_stages} positive block counts (one per stage) summing to the trunk's "
            f"{n_blocks} blocks, e.g. pp_split={even_split(n_blocks, n_stages)}"
        )
    return sizes


def even_split(n_blocks: int, n_stages: int) -> list[int]:
    """Block counts per stage as even as possible, earlier stages taking the remainder."""
    base, rem = divmod(n_blocks, n_stages)
    return [base + (1 if i < rem else 0) for i in range(n_stages)]


def partition(
    costs: Sequence[float],
    n_stages: int,
    *,
    first_extra: float = 0.0,
    last_extra: float = 0.0,
    split: Optional[Sequence[int]] = None,
    forbidden: Collection[int] = (),
) -> list[tuple[int, int]]:
    """Cut blocks ``0..len(costs)-1`` into ``n_stages`` contiguous ranges minimising the costliest stage.

    Exact: the minimal bottleneck is found by binary search over the candidate values (every contiguous sum),
    each checked by a greedy left-to-right fill, O(n^2 log n) for n blocks, nothing for real trunks (n < 200).
    Ties are broken by the first-fit greedy, which gives earlier stages the larger share.

    Args:
        costs: one non-negative cost per block, in execution order.
        n_stages: number of stages (``pp * virtual`` stages per rank).
        first_extra: cost of the code before the trunk (embeddings), charged to the first stage.
        last_extra: cost of the code after the trunk (final norm, head, loss), charged to the last stage.
        split: block counts per stage given by hand; overrides the costs (and is not checked against
            ``forbidden``: the caller says why a cut is wrong).
        forbidden: blocks no stage may start at (a cut there would change the values,
            `lightning_par.parallel.pipeline.cuts`); the balance is the best among the other cuts.

    Returns:
        ``(start, end)`` block ranges, one per stage, covering every block once.
    """
    n = len(costs)
    if n_stages < 1:
        raise PartitionError(f"n_stages={n_stages} must be >= 1")
    if n < n_stages:
        raise PartitionError(
            f"{n_stages} pipeline stages but the trunk has only {n} blocks (each stage needs >= 1 block); use "
            f"pp x virtual stages <= {n} (e.g. pp={max(1, n)} with a non-interleaved schedule 'gpipe' or '1f1b')"
        )
    if any(c < 0 for c in costs):
        raise PartitionError(f"block costs must be >= 0, got {list(costs)}")
    if split is not None:
        sizes = _check_split(split, n, n_stages)
    else:
        allowed = [c for c in range(1, n) if c not in set(forbidden)]
        if len(allowed) < n_stages - 1:
            raise PartitionError(
                f"{n_stages} pipeline stages need {n_stages - 1} cuts but only {len(allowed)} of the trunk's block "
                f"boundaries can be cut (before blocks {allowed}); use at most {len(allowed) + 1} stages"
            )
        sizes = _min_bottleneck(list(costs), n_stages, first_extra, last_extra, allowed)
    ranges, start = [], 0
    for size in sizes:
        ranges.append((start, start + size))
        start += size
    return ranges


def _stage_cost(costs: list[float], i: int, j: int, first: float, last: float, n: int) -> float:
    return sum(costs[i:j]) + (first if i == 0 else 0.0) + (last if j == n else 0.0)


def _fill(
    costs: list[float], n_stages: int, cap: float, first: float, last: float, allowed: list[int]
) -> Optional[list[int]]:
    """Greedy: each stage ends at the furthest allowed cut under ``cap`` that leaves a cut for each later stage."""
    n, sizes, i = len(costs), [], 0
    for s in range(n_stages):
        later = n_stages - s - 1  # stages after this one; they need `later - 1` cuts after this stage's end
        if later == 0:
            ends = [n]
        else:
            ends = [j for k, j in enumerate(allowed) if j > i and len(allowed) - k - 1 >= later - 1]
        fits = [j for j in ends if _stage_cost(costs, i, j, first, last, n) <= cap]
        if not fits:
            return None
        sizes.append(fits[-1] - i)
        i = fits[-1]
    return sizes


def _min_bottleneck(costs: list[float], n_stages: int, first: float, last: float, allowed: list[int]) -> list[int]:
    n = len(costs)
    candidates = sorted({_stage_cost(costs, i, j, first, last, n) for i in range(n) for j in range(i + 1, n + 1)})
    lo, hi = 0, len(candidates) - 1
    best = _fill(costs, n_stages, candidates[hi], first, last, allowed)
    while lo < hi:
        mid = (lo + hi) // 2
        sizes = _fill(costs, n_stages, candidates[mid], first, last, allowed)
        if sizes is None:
            lo = mid + 1
        else:
            best, hi = sizes, mid
    assert best is not None  # the largest candidate (everything in one range) always fits
    return best


def stage_costs(ranges: Sequence[tuple[int, int]], costs: Sequence[float], first: float, last: float) -> list[float]:
    """The cost of each stage of a partition (for printing and tests)."""
    n = len(costs)
    return [_stage_cost(list(costs), i, j, first, last, n) for i, j in ranges]
