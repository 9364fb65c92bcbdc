"""``compile=True`` against eager, per strategy: compile time (first step) and step time.

Launch (2 ranks over gloo, one thread each):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_compile.py [--quick]

Per strategy (zero2, zero3, tp 2, pp 2) a fresh ``Trainer.fit`` of the GPT, eager and with each trunk block compiled
(`lightning_par.parallel.compile`), alternated ABBA over rounds in one process group. Reported on rank 0:

- first step, s: the first optimizer step, compile included; "compile" = compiled first step - eager first step.
  Inductor's and AOT autograd's on-disk caches are off (``TORCHINDUCTOR_FORCE_DISABLE_CACHES=1``) and dynamo is
  reset before each fit, so every compiled fit compiles from scratch (a later run of the same model on a warm cache
  compiles faster).
- step, ms: median over the timed steps after ``--warmup``; the ratio compiled / eager per round, then its median.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from typing import Any

os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # before torch reads its config

import lightning as L
import torch

torch.set_num_threads(1)

from _rounds import finish  # noqa: E402
from bench_zero_vs_lightning import StepTimer  # noqa: E402

import lightning_par  # noqa: E402, F401  (registers the names)
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT  # noqa: E402
from lightning_par.strategies import make_strategy  # noqa: E402

# Explicit degrees on 2 ranks; dp is the number of data-parallel ranks (the sampler splits over them only).
LAYOUTS: dict[str, tuple[dict[str, Any], int]] = {
    "zero2": ({"zero_stage": 2}, 2),
    "zero3": ({"zero_stage": 3}, 2),
    "tp": ({"tp": 2}, 1),
    "pipe": ({"pp": 2}, 1),
}


def fit(layout: str, compiled: bool, args: argparse.Namespace) -> tuple[float, float]:
    """One fresh fit; (first step s, median of the steps after warm-up s) on this rank."""
    torch.compiler.reset()  # every compiled fit compiles from scratch
    L.seed_everything(0, verbose=False)
    kwargs, dp = LAYOUTS[layout]
    steps = args.warmup + args.steps
    world = int(os.environ["WORLD_SIZE"])  # the process group starts inside fit
    global_batch = args.batch * world  # the same global batch under every layout
    data = ByteTextDataModule(seq_len=args.seq, batch_size=global_batch // dp, num_samples=steps * global_batch)
    timer = StepTimer(0)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=make_strategy(**kwargs, compile=compiled),
        max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    model = GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    trainer.fit(model, datamodule=data)
    return timer.times[0], statistics.median(timer.times[args.warmup :])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 round, 2 timed steps")
    parser.add_argument("--rounds", type=int, default=2, help="even, so ABBA order balances")
    parser.add_argument("--warmup", type=int, default=2, help="steps not timed (the first compiles)")
    parser.add_argument("--steps", type=int, default=8, help="timed steps per fit")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=128)
    parser.add_argument("--seq", type=int, default=64)
    parser.add_argument("--batch", type=int, default=8, help="samples per rank and step (global batch / 2)")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par", "torch._dynamo", "torch._inductor"):
        logging.getLogger(name).setLevel(logging.ERROR)  # keep the table readable
    if args.quick:
        args.rounds, args.warmup, args.steps, args.layers, args.embd, args.seq = 1, 1, 2, 2, 32, 32
    first: dict[tuple[str, bool], list[float]] = {}
    step: dict[tuple[str, bool], list[float]] = {}
    start = time.perf_counter()
    for layout in LAYOUTS:
        for r in range(args.rounds):
            for compiled in (False, True) if r % 2 == 0 else (True, False):
                f, s = fit(layout, compiled, args)
                first.setdefault((layout, compiled), []).append(f)
                step.setdefault((layout, compiled), []).append(s)
    lines = [
        f"GPT {args.layers} blocks, d={args.embd}, seq {args.seq}, {args.batch} samples per rank; {args.rounds} "
        f"rounds; {time.perf_counter() - start:.0f} s; load average {os.getloadavg()[0]:.1f}",
        "",
        "| strategy | first step eager, s | first step compiled, s | compile, s | step eager, ms | "
        "step compiled, ms | compiled / eager per round | median |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        fe, fc = statistics.median(first[layout, False]), statistics.median(first[layout, True])
        se, sc = step[layout, False], step[layout, True]
        ratios = [c / e for c, e in zip(sc, se)]
        lines.append(
            f"| {layout} | {fe:.2f} | {fc:.1f} | {fc - fe:.1f} | {statistics.median(se) * 1e3:.1f} | "
            f"{statistics.median(sc) * 1e3:.1f} | {[round(x, 3) for x in ratios]} | {statistics.median(ratios):.3f} |"
        )
    finish(lines)


if __name__ == "__main__":
    main()
