"""Bytes on the wire per optimizer step of local SGD / DiLoCo (``sync_every``) against plain data parallelism.

Launch (2 ranks: 2 replicas; 4 ranks: 2 replicas x 2 ZeRO-1 shards each):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_local_sgd.py [--quick]
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_local_sgd.py --zero-stage 1

Every collective of the counted steps is counted by `lightning_par.parallel.comm_counter.CommCounter` (ring
convention, bytes per rank; scalars under 1 KiB, the logged loss, reported apart). The baseline is the same
strategy without ``sync_every``: gradients all-reduced (ZeRO-0) or reduce-scattered and all-gathered (ZeRO 1-2) over
every data-parallel rank each step. A hand-run benchmark: it asserts nothing. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import logging
import os
from typing import Any, Optional

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from bench_comm_bytes import PhaseTagger  # noqa: E402

import lightning_par  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT  # noqa: E402
from lightning_par.parallel.comm_counter import CommCounter  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


def run(stage: int, every: Optional[int], args: argparse.Namespace) -> tuple[float, float]:
    """One fit of ``args.steps`` counted steps (+1 warm-up): (MiB per step, scalar MiB per step) on this rank."""
    L.seed_everything(0, verbose=False)
    world = int(os.environ["WORLD_SIZE"])
    model = GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    local: dict[str, Any] = {"dp_replicate": 2, "sync_every": every} if every else {}
    counter = CommCounter()
    counter.install()
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=lightning_par.ParallelStrategy(zero_stage=stage, **local),
            max_steps=args.steps + 1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[PhaseTagger(counter)],
        )  # fmt: skip
        data = ByteTextDataModule(seq_len=args.seq, batch_size=2, num_samples=(args.steps + 1) * 2 * world)
        trainer.fit(model, datamodule=data)
    finally:
        counter.uninstall()
    big = sum(b for (ph, kind, small), b in counter.bytes.items() if ph == "step" and not small)
    small = sum(b for (ph, kind, small), b in counter.bytes.items() if ph == "step" and small)
    return big / args.steps / 2**20, small / args.steps / 2**20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, H in {1, 2}")
    parser.add_argument("--steps", type=int, default=16, help="counted steps (a multiple of every H)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--zero-stage", type=int, default=0, help="ZeRO stage inside each replica (0-2)")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.WARNING)
    everies = [1, 4, 16]
    if args.quick:
        args.steps, args.layers, args.embd, args.seq, everies = 2, 2, 64, 32, [1, 2]
    base, base_small = run(args.zero_stage, None, args)
    rows = [(every, *run(args.zero_stage, every, args)) for every in everies]
    if dist.get_rank() == 0:
        world = dist.get_world_size()
        print(f"\nGPT n_layer={args.layers} n_embd={args.embd}, {world} ranks = 2 replicas x {world // 2} "
              f"(zero_stage={args.zero_stage} inside), {args.steps} counted steps; MiB per step, rank\n")  # fmt: skip
        print("| config | MiB / step | scalars MiB / step | / baseline | 1/H |")
        print("|---|---|---|---|---|")
        print(f"| no sync_every (baseline) | {base:.3f} | {base_small:.5f} | 1.000 | |")
        for every, mib, small in rows:
            print(f"| sync_every={every} | {mib:.3f} | {small:.5f} | {mib / base:.3f} | {1 / every:.3f} |")
    clean_exit()


if __name__ == "__main__":
    main()
