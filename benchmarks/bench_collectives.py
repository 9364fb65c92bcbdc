"""ZeRO-1/2's collectives on gloo, alone: lightning_par's reduce-scatter and all-gather against torch's and the
alternatives, on one bucket of the size of the step-time benchmark's model.

Launch (2 ranks on 2 CPU cores, one thread each):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_collectives.py [--quick]

Each variant runs ``--calls`` times per round after 2 warm-up calls, rounds alternate the order (ABBA); reported:
median ms per call over rounds with the range, and the ratio to torch's own collective. Variants:

- reduce-scatter of ``world x n`` floats: torch's ``reduce_scatter_tensor`` (on gloo an all-reduce of the whole
  buffer, then a copy), an all-to-all of the parts plus a local sum (what lightning_par used before), and
  `collectives.reduce_scatter_single` (direct sends and one add per part); an ``all_reduce`` of the same buffer
  for scale (what DDP sends);
- all-gather into ``world x n``: torch's ``all_gather_into_tensor`` and `collectives.all_gather_single` with
  ``skip_own`` (ZeRO's call: the own rows are already in place).

A hand-run benchmark: it asserts nothing. Results: docs/benchmarks_history.md ("Direct sends on gloo").
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch

torch.set_num_threads(1)  # before any op: one core per rank

import torch.distributed as dist  # noqa: E402
from _rounds import finish  # noqa: E402

from lightning_par import _compat  # noqa: E402
from lightning_par.parallel import collectives  # noqa: E402


def _variants(n: int) -> dict[str, Callable[[], None]]:
    world, rank = dist.get_world_size(), dist.get_rank()
    bucket = torch.randn(world * n, generator=torch.Generator().manual_seed(rank))
    part = torch.empty(n)
    rows = torch.empty(world * n)
    mine = torch.randn(n)

    def all_to_all_sum() -> None:  # the reduce-scatter lightning_par ran on gloo before the direct sends
        got = torch.empty_like(bucket)
        dist.all_to_all_single(got, bucket)
        torch.sum(got.view(world, -1), dim=0, out=part)

    return {
        "rs: torch reduce_scatter_tensor": lambda: _compat.reduce_scatter_single(part, bucket),
        "rs: all-to-all + sum (before)": all_to_all_sum,
        "rs: lightning_par direct": lambda: collectives.reduce_scatter_single(part, bucket),
        "all_reduce (DDP's) of the bucket": lambda: dist.all_reduce(bucket.clone()),
        "ag: torch all_gather_into_tensor": lambda: _compat.all_gather_single(rows, mine),
        "ag: lightning_par direct, skip_own": lambda: collectives.all_gather_single(rows, mine, skip_own=True),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, 3 calls, a small bucket")
    parser.add_argument("--rounds", type=int, default=6, help="even, so ABBA order balances")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--mib", type=float, default=12.68, help="bucket size (default: the 3.32 M-parameter GPT)")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.calls, args.mib = 2, 3, 1.0
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    n = int(args.mib * 2**20 / 4) // world
    variants = _variants(n)
    order = list(variants)
    times: dict[str, list[float]] = {name: [] for name in order}
    load = os.getloadavg()[0]
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            fn = variants[name]
            for _ in range(2):
                fn()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(args.calls):
                fn()
            times[name].append((time.perf_counter() - t0) / args.calls)
    base = {"rs": statistics.median(times[order[0]]), "all_reduce": statistics.median(times[order[0]]),
            "ag": statistics.median(times[order[4]])}  # fmt: skip
    lines = [
        f"\n{world} ranks, gloo, bucket {world * n * 4 / 2**20:.2f} MiB fp32; {args.rounds} rounds x {args.calls} "
        f"calls; 1-min load {load:.1f} before, {os.getloadavg()[0]:.1f} after\n",
        "| variant | ms per call: median [min, max] over rounds | / torch's own |",
        "|---|---|---|",
    ]
    for name in order:
        med = statistics.median(times[name])
        ref = base[name.split(":")[0].split(" ")[0]]
        lines.append(f"| {name} | {med * 1e3:.2f} [{min(times[name]) * 1e3:.2f}, {max(times[name]) * 1e3:.2f}] "
                     f"| {med / ref:.3f} |")  # fmt: skip
    finish(lines)


if __name__ == "__main__":
    main()
