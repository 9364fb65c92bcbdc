"""PowerSGD (``grad_compression="powersgd"``): bytes per step against the formula and the exact run, and the loss
curve against the exact run.

Launch (2 ranks, plain data parallelism):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_powersgd.py [--quick]

Each configuration trains the same GPT from the same seed on the same batches for ``--steps`` optimizer steps
(AdamW); PowerSGD all-reduces exactly for its first ``--start`` steps, then compresses. Every collective of the
compressed steps is counted by `lightning_par.parallel.comm_counter.CommCounter` (ring convention, bytes per rank;
the 4-byte logged loss apart), and compared with ``2 (n-1)/n x 4 bytes x`` `compressed_numel` (what the planner
prices). The loss of every step is the mean over the ranks; the gap to the exact run is reported as the largest
and the mean relative difference over the compressed steps, and the mean of the last ten. A hand-run benchmark:
it asserts nothing. Results: docs/benchmarks.md.
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

import lightning_par  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT  # noqa: E402
from lightning_par.parallel.comm_counter import CommCounter  # noqa: E402
from lightning_par.parallel.compression.powersgd import compressed_numel  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


class Record(L.Callback):
    """Tags the compressed steps for the counter and records every step's loss, averaged over the ranks."""

    def __init__(self, counter: CommCounter, start: int) -> None:
        self.counter, self.start, self.losses = counter, start, []  # type: ignore[var-annotated]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        # The optimizer step, not the batch index: the loader's epoch may end before the run does.
        self.counter.phase = "compressed" if trainer.global_step >= self.start else "exact"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.counter.phase = "between"
        loss = outputs["loss"].detach().clone()
        dist.all_reduce(loss)
        self.losses.append(float(loss) / dist.get_world_size())


def run(rank: Optional[int], args: argparse.Namespace) -> tuple[float, list[float], torch.nn.Module]:
    """One fit: (MiB per compressed step on this rank, the loss curve, the model)."""
    L.seed_everything(0, verbose=False)
    world = int(os.environ["WORLD_SIZE"])
    model = GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    compression: dict[str, Any] = {}
    if rank is not None:
        compression = {"grad_compression": "powersgd", "compression_rank": rank, "compression_start": args.start}
    counter = CommCounter()
    record = Record(counter, args.start)
    counter.install()
    try:
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=lightning_par.ParallelStrategy(zero_stage=0, **compression),
            max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0, callbacks=[record],
        )  # fmt: skip
        data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, num_samples=args.steps * args.batch * world)
        trainer.fit(model, datamodule=data)
    finally:
        counter.uninstall()
    big = sum(b for (ph, _, small), b in counter.bytes.items() if ph == "compressed" and not small)
    return big / (args.steps - args.start) / 2**20, record.losses, model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 12 steps")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--start", type=int, default=10, help="exact steps before compression (compression_start)")
    parser.add_argument("--ranks", default="1,4,16", help="PowerSGD ranks to run")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="samples per rank and step")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.WARNING)
    ranks = [int(r) for r in args.ranks.split(",")]
    if args.quick:
        args.steps, args.start, args.layers, args.embd, args.seq, ranks = 12, 4, 2, 64, 32, [1, 4]
    exact_mib, exact, model = run(None, args)
    rows = [(r, *run(r, args)[:2]) for r in ranks]
    if dist.get_rank() == 0:
        n = dist.get_world_size()
        shapes = [tuple(p.shape) for p in model.parameters() if p.requires_grad]
        elements = sum(p.numel() for p in model.parameters() if p.requires_grad)
        tail = slice(max(args.start, args.steps - 10), args.steps)
        size = f"GPT n_layer={args.layers} n_embd={args.embd} ({elements / 1e6:.2f} M parameters)"
        print(f"\n{size}, {n} ranks, ZeRO-0, AdamW; {args.steps} steps, the first {args.start} exact; MiB per "
              "compressed step\n")  # fmt: skip
        print("| config | MiB / step | formula | measured / formula | / exact | loss gap max | mean | last 10 |")
        print("|---|---|---|---|---|---|---|---|")
        ring = 2 * (n - 1) / n
        print(f"| exact | {exact_mib:.3f} | {ring * 4 * elements / 2**20:.3f} | | 1.000 | | | |")
        for r, mib, losses in rows:
            formula = ring * 4 * compressed_numel(shapes, r) / 2**20
            gaps = [abs(a - b) / abs(b) for a, b in zip(losses[args.start :], exact[args.start :], strict=True)]
            last = sum(losses[tail]) / len(losses[tail]) / (sum(exact[tail]) / len(exact[tail])) - 1
            print(f"| powersgd r={r} | {mib:.3f} | {formula:.3f} | {mib / formula:.4f} | {mib / exact_mib:.3f} | "
                  f"{max(gaps):.4f} | {sum(gaps) / len(gaps):.4f} | {last:+.4f} |")  # fmt: skip
        print("\nloss every 10 steps (exact, then each rank):")
        for step in range(0, args.steps, max(1, args.steps // 10)):
            print(step, f"{exact[step]:.4f}", *(f"{losses[step]:.4f}" for _, _, losses in rows))
    clean_exit()


if __name__ == "__main__":
    main()
