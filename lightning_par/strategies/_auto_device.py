"""The device `auto_parallel` plans for: a known GPU from the planner's table, or this CPU job, measured.

A CPU job has no datasheet: its GEMM rate, memory bandwidth and gloo bandwidth and latency are measured once at
start-up, on every rank at the same time (the ranks share the cores, so a rank's rate is what it gets while the
others compute too), and rank 0's figures are used by all. The measured rates already include every
inefficiency, so the efficiencies are 1 and there is no wave quantisation (``sms=0``).
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from lightning_par.planner.devices import DEVICES, GIB, Device

# Substrings of torch.cuda.get_device_name() -> the planner's table entry.
_CUDA_NAMES = (("H200", "H200-SXM-141GB"), ("H100", "H100-SXM5-80GB"), ("B200", "B200-SXM-180GB"),
               ("A100-SXM4-40GB", "A100-SXM4-40GB"), ("A100", "A100-SXM4-80GB"))  # fmt: skip


def _median_time(fn: Callable[[], object], reps: int = 5, min_s: float = 0.05, calls: int = 0) -> float:
    """Median seconds per call of ``fn`` over ``reps`` samples, each looping ``fn`` for at least ``min_s``: ranks
    that share cores are time-sliced, and a sample shorter than a few scheduler slices would catch one rank
    running alone (twice its real share). A collective passes a fixed ``calls`` instead, the same on every rank."""
    fn()  # warm-up: first-call allocation and thread start-up
    if not calls:
        start = time.perf_counter()
        fn()
        calls = max(1, int(min_s / max(time.perf_counter() - start, 1e-6)))
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def measure_cpu(world: int, ranks_per_node: int) -> Device:
    """This CPU job's rates, measured with every rank working at once (call on every rank; collectives inside)."""
    dist.barrier()
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    gemm = 2 * 512**3 / _median_time(lambda: torch.mm(a, b))
    src, dst = torch.empty(4 * 2**20), torch.empty(4 * 2**20)  # 16 MB each: past the caches
    stream = 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src))
    small, large = torch.zeros(1), torch.zeros(2**20)  # 4 MB
    latency = _median_time(lambda: dist.all_reduce(small), calls=20)
    ring = 2 * (world - 1) / world * large.numel() * 4
    link = ring / max(1e-9, _median_time(lambda: dist.all_reduce(large), calls=3) - latency) if world > 1 else 1e12
    mine = torch.tensor([gemm, stream, link, latency], dtype=torch.float64)
    dist.broadcast(mine, src=0)  # every rank plans with rank 0's figures, so every rank picks the same layout
    gemm, stream, link, latency = mine.tolist()
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / ranks_per_node
    # Communication hides behind compute only on cores no rank computes on.
    spare = max(0.0, min(1.0, ((os.cpu_count() or 1) - ranks_per_node) / ranks_per_node))
    return Device(
        "cpu (measured)", dict.fromkeys(("fp32", "tf32", "bf16", "fp16"), gemm), memory / GIB, stream, link, link,
        gpus_per_node=ranks_per_node, sms=0, gemm_efficiency=1.0, memory_efficiency=1.0, link_efficiency=1.0,
        collective_latency_s=latency, comm_overlap=spare, reduce_scatter_all_reduces=dist.get_backend() == "gloo",
    )  # fmt: skip


def this_device(device: torch.device, world: int, ranks_per_node: int, gpu: str | None) -> Device:
    """The planner's `Device` for this job: ``gpu`` when given, the table entry of this CUDA device, or the CPU
    measured.

    Raises:
        ValueError: a CUDA device the table does not know, naming the fix.
    """
    if gpu is not None:
        from lightning_par.planner import device as lookup

        return lookup(gpu)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, entry in _CUDA_NAMES:
            if key in name:
                return DEVICES[entry]
        raise ValueError(
            f"auto_parallel does not know the GPU {name!r}; pass one the planner knows "
            f"(AutoParallelStrategy(gpu=...), one of {', '.join(DEVICES)}) or describe it with plan.devices.Device"
        )
    return measure_cpu(world, ranks_per_node)
