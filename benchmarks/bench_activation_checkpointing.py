"""Activation memory and step time of each activation-checkpointing policy, as ratios to no checkpointing.

Launch (one process, one thread; the script re-executes itself with ``MALLOC_MMAP_THRESHOLD_=131072`` so that
freed tensors go back to the OS and the resident-set peak follows tensor memory, docs/testing.md):

    OMP_NUM_THREADS=1 python benchmarks/bench_activation_checkpointing.py [--quick]

Per model (GPT and Llama) and policy (none, full, selective every 2nd block, selective_op, offload):

- held after forward: bytes of the tensor storages created by the forward that are still alive when it returns
  (saved tensors, checkpoint inputs, op-level checkpointing's cache), counted exactly by a dispatch mode that
  sees every op, also inside checkpointed regions. Parameters and optimizer state are not counted.
- peak live: the maximum over op boundaries of the same count during forward + backward (recomputation and
  gradients included).
- RSS peak delta: VmHWM after a training step minus VmRSS before it (reset by writing 5 to
  /proc/self/clear_refs), median over the timed steps: what the process really allocated, optimizer step included.
- step time: median of timed forward + backward + AdamW steps. Each round runs every policy once (``--steps``
  steps), the order reversed every other round, so a linear drift cancels; reported with the per-round ratios to
  "none" (runs seconds apart) and the ratio of the fastest single steps (the figure least disturbed by load).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Optional

if os.environ.get("MALLOC_MMAP_THRESHOLD_") != "131072":
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "131072"
    os.execv(sys.executable, [sys.executable, *sys.argv])

import torch

torch.set_num_threads(1)

from lightning_par.blocks.trunk import find_trunk  # noqa: E402
from lightning_par.models import GPT, Llama  # noqa: E402
from lightning_par.parallel.activation_checkpointing import apply_activation_checkpointing  # noqa: E402
from lightning_par.utils import LiveStorageBytes  # noqa: E402

POLICIES: dict[str, Optional[str]] = {
    "none": None,
    "full": "full",
    "selective (every 2)": "selective",
    "selective_op": "selective_op",
    "offload": "offload",
}
MiB = 2**20


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


class Run:
    """One model under one policy, with its optimizer and a fixed batch."""

    def __init__(self, make: Callable[[], torch.nn.Module], mode: Optional[str], batch: int, seq: int) -> None:
        torch.manual_seed(0)
        self.model = make()
        apply_activation_checkpointing(find_trunk(self.model).blocks, mode)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randint(0, 256, (batch, seq), generator=torch.Generator().manual_seed(1))
        self.times: list[list[float]] = []
        self.rss: list[int] = []

    def loss(self) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(self.model(self.x).flatten(0, 1), self.x.flatten())

    def step(self) -> None:
        loss = self.loss()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def memory(self) -> tuple[int, int]:
        """(held after forward, peak live during forward + backward), in bytes."""
        with LiveStorageBytes() as live:
            loss = self.loss()
            held = live.now()
            loss.backward()
        self.model.zero_grad(set_to_none=True)
        return held, live.peak

    def timed(self, steps: int) -> None:
        times = []
        for _ in range(steps):
            _reset_peak_rss()
            before = _status("VmRSS")
            start = time.perf_counter()
            self.step()
            times.append(time.perf_counter() - start)
            self.rss.append(_status("VmHWM") - before)
        self.times.append(times)


def bench(name: str, make: Callable[[], torch.nn.Module], args: argparse.Namespace) -> None:
    runs = {label: Run(make, mode, args.batch, args.seq) for label, mode in POLICIES.items()}
    mem = {label: run.memory() for label, run in runs.items()}
    for run in runs.values():
        for _ in range(args.warmup):
            run.step()
    labels = list(runs)
    for r in range(args.rounds):
        for label in labels if r % 2 == 0 else labels[::-1]:
            runs[label].timed(args.steps)
    params = sum(p.numel() for p in runs["none"].model.parameters())
    print(f"\n### {name}: {params / 1e6:.2f} M parameters, {args.layers} blocks, d={args.embd}, seq {args.seq}, "
          f"batch {args.batch}\n")  # fmt: skip
    print("| policy | held after forward, MiB | peak live, MiB | RSS peak delta, MiB | step, ms | "
          "per-round step ratio: median [min, max] | fastest-step ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    base = runs["none"]
    base_med = statistics.median(statistics.median(t) for t in base.times)
    base_min = min(min(t) for t in base.times)
    for label, run in runs.items():
        held, peak = mem[label]
        rss = statistics.median(run.rss)
        med = statistics.median(statistics.median(t) for t in run.times)
        per_round = [statistics.median(a) / statistics.median(b) for a, b in zip(run.times, base.times)]
        print(
            f"| {label} | {held / MiB:.1f} ({held / mem['none'][0]:.2f}) | {peak / MiB:.1f} "
            f"({peak / mem['none'][1]:.2f}) | {rss / MiB:.1f} ({rss / statistics.median(base.rss):.2f}) | "
            f"{med * 1e3:.0f} ({med / base_med:.3f}) | {statistics.median(per_round):.3f} "
            f"[{min(per_round):.3f}, {max(per_round):.3f}] | {min(min(t) for t in run.times) / base_min:.3f} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per policy per round")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--models", default="gpt,llama")
    parser.add_argument("--quick", action="store_true", help="smoke run: a small model, 1 round of 1 step")
    args = parser.parse_args()
    if args.quick:
        args.layers, args.embd, args.seq, args.batch, args.rounds, args.steps = 2, 64, 64, 2, 1, 1
    models = {
        "GPT": lambda: GPT(n_layer=args.layers, n_embd=args.embd, n_head=args.heads, block_size=args.seq),
        "Llama": lambda: Llama(n_layers=args.layers, dim=args.embd, n_heads=args.heads, n_kv_heads=args.heads // 2,
                               ffn_hidden=(8 * args.embd) // 3, max_seq_len=args.seq),
    }  # fmt: skip
    load = os.getloadavg()[0]
    start = time.perf_counter()
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, load average {load:.2f}")
    for name in args.models.split(","):
        key = {"gpt": "GPT", "llama": "Llama"}[name]
        bench(key, models[key], args)
    print(f"\n{time.perf_counter() - start:.0f} s, load average {load:.2f} before / {os.getloadavg()[0]:.2f} after")


if __name__ == "__main__":
    main()
