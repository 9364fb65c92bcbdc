"""Communication bytes per optimizer step of ZeRO stages 0-3, counted, against the ZeRO paper's formulas.

Launch:

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_comm_bytes.py [--quick]

Every collective is counted by `lightning_par.parallel.comm_counter.CommCounter` (the wrapped ``torch.distributed``
entry points, the two names `lightning_par.parallel.zero.replicated` bound at import, and DTensor's functional
collectives). Lightning's own ``ddp`` is not counted: its all-reduces are issued from C++ (the DDP reducer).

Convention, "bytes on the wire per rank" for ring algorithms over n ranks: an all-reduce of B bytes moves
2B(n-1)/n, a reduce-scatter of a B-byte input B(n-1)/n, an all-gather producing B bytes B(n-1)/n, a broadcast of
B bytes B(n-1)/n (averaged over ranks); `lightning_par.planner.comm` predicts these counts. The paper (Rajbhandari et
al., arXiv 1910.02054, section 7) gives per step DDP 2Psi, ZeRO-1/2 2Psi, ZeRO-3 3Psi, each times (n-1)/n, with Psi
the parameter bytes.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lightning_par  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT  # noqa: E402
from lightning_par.parallel.comm_counter import CommCounter  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


class PhaseTagger(L.Callback):
    """Tags collectives with the optimizer step they belong to; the first step (lazy init) is warm-up."""

    def __init__(self, counter: CommCounter) -> None:
        self.counter = counter

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.counter.phase = "warmup" if batch_idx == 0 else "step"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.counter.phase = "between"


def psi(model: torch.nn.Module, n: int, prefix: str = "") -> tuple[int, int]:
    """(Psi, Psi padded to ceil(d0/n) rows per rank) in bytes, over fp32 parameters whose name starts with prefix."""
    plain = padded = 0
    for name, p in model.named_parameters():
        if name.startswith(prefix):
            row = p.numel() // p.shape[0]
            plain += p.numel() * p.element_size()
            padded += math.ceil(p.shape[0] / n) * n * row * p.element_size()
    return plain, padded


def run(stage: int, precision: Any, args: argparse.Namespace) -> CommCounter:
    """One fit of ``args.steps`` steps (+1 warm-up) counted from construction to the end."""
    L.seed_everything(0, verbose=False)
    world = int(os.environ["WORLD_SIZE"])  # set by torchrun; the process group starts inside the first fit
    model = GPT(vocab_size=256, block_size=args.block_size, n_layer=args.layers, n_head=4, n_embd=args.embd)
    counter = CommCounter()
    counter.install()
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=lightning_par.ParallelStrategy(zero_stage=stage),
            precision=precision, max_steps=args.steps + 1, logger=False, enable_checkpointing=False,
            enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
            callbacks=[PhaseTagger(counter)],
        )  # fmt: skip
        data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, num_samples=(args.steps + 1) * 2 * world)
        trainer.fit(model, datamodule=data)
    finally:
        counter.uninstall()
    return counter


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 counted step")
    parser.add_argument("--steps", type=int, default=3, help="counted steps (after 1 warm-up step)")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    # 129 rows of position embedding: one parameter whose dim 0 does not divide by 2, so padding shows up.
    parser.add_argument("--block-size", type=int, default=129)
    parser.add_argument("--batch", type=int, default=2, help="per-rank batch (bytes do not depend on it)")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.WARNING)  # keep the tables readable
    if args.quick:
        args.steps, args.layers, args.embd, args.seq, args.block_size = 1, 2, 64, 32, 33
    runs = [(0, "32-true"), (1, "32-true"), (2, "32-true"), (3, "32-true"), (3, "bf16-mixed")]
    counters = [run(stage, precision, args) for stage, precision in runs]
    n = dist.get_world_size()
    if dist.get_rank() == 0:
        ref = GPT(vocab_size=256, block_size=args.block_size, n_layer=args.layers, n_head=4, n_embd=args.embd)
        p, p_pad = psi(ref, n)
        _, blocks_pad = psi(ref, n, "transformer.h.")
        f = (n - 1) / n
        print(f"\nGPT n_layer={args.layers} n_embd={args.embd} block_size={args.block_size}, n={n} ranks: "
              f"Psi = {p:,} B, padded to ceil(d0/n) rows {p_pad:,} B (blocks {blocks_pad:,} B)\n")  # fmt: skip
        paper = {0: 2 * p * f, 1: 2 * p * f, 2: 2 * p * f, 3: 3 * p * f}
        # What our layout should move: DDP's flat all-reduce is unpadded; shards are padded; FSDP2 re-gathers the
        # blocks for backward but not the root (reshard_after_forward=False); bf16-mixed gathers in bf16 and
        # reduce-scatters in fp32.
        layout = {
            (0, "32-true"): 2 * p * f,
            (1, "32-true"): 2 * p_pad * f,
            (2, "32-true"): 2 * p_pad * f,
            (3, "32-true"): (2 * p_pad + blocks_pad) * f,
            (3, "bf16-mixed"): ((p_pad + blocks_pad) / 2 + p_pad) * f,
        }
        kinds = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
        print("| stage | precision | " + " | ".join(kinds) + " | total | paper | measured/paper | our layout | "
              "measured/layout | scalar colls/step | setup (once) |")  # fmt: skip
        print("|---|---|" + "---|" * (len(kinds) + 7))
        for (stage, precision), c in zip(runs, counters):
            per = {k: c.bytes[("step", k, False)] / args.steps for k in kinds}
            total = sum(per.values())
            small = sum(v for (ph, _, s), v in c.calls.items() if ph == "step" and s) / args.steps
            small_b = sum(v for (ph, _, s), v in c.bytes.items() if ph == "step" and s) / args.steps
            setup = sum(v for (ph, _, _), v in c.bytes.items() if ph == "setup")  # initial broadcast etc.
            ncalls = {k: c.calls[("step", k, False)] / args.steps for k in kinds}
            cells = " | ".join(f"{per[k] / 2**20:.3f} MiB ({ncalls[k]:.0f})" for k in kinds)
            print(f"| zero{stage} | {precision} | {cells} | {total / 2**20:.3f} MiB | {paper[stage] / 2**20:.3f} MiB"
                  f" | {total / paper[stage]:.4f} | {layout[(stage, precision)] / 2**20:.3f} MiB"
                  f" | {total / layout[(stage, precision)]:.4f} | {small:.0f} ({small_b:.0f} B)"
                  f" | {setup / 2**20:.3f} MiB |")  # fmt: skip
        print("\nPer kind: MiB on the wire per rank per step (collective calls per step).")
        print("\nscalar collectives per step, by kind (calls):")
        for (stage, precision), c in zip(runs, counters):
            kinds_small = {k: v / args.steps for (ph, k, s), v in c.calls.items() if ph == "step" and s}
            print(f"  zero{stage} {precision}: {kinds_small}")
    clean_exit()


if __name__ == "__main__":
    main()
