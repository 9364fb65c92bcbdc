"""ZeRO-3 with the weights all-gathered in int8 (``zero_quantized_weights=True``): all-gather bytes per step against
the formula and the exact run, and the loss curve against the exact run.

Launch (2 ranks):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_zero3_int8.py [--quick]

Both configurations train the same GPT from the same seed on the same batches for ``--steps`` optimizer steps
(AdamW, ``bf16-mixed``: FSDP2 gathers bf16 weights when exact). Every collective after the first step is counted by
`lightning_par.parallel.comm_counter.CommCounter` (ring convention, bytes per rank); the formula for the int8 run is
the planner's (`lightning_par.planner.comm.comm_bytes`). The loss of every step is the mean over the ranks; the gap
is relative to the exact run. A hand-run benchmark: it asserts nothing. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import logging
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
from lightning_par.planner.comm import comm_bytes  # noqa: E402
from lightning_par.planner.layout import Layout  # noqa: E402
from lightning_par.planner.params import specs_from_module  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


class Record(L.Callback):
    """Counts the steps after the first and records every step's loss, averaged over the ranks."""

    def __init__(self, counter: CommCounter) -> None:
        self.counter, self.losses = counter, []  # type: ignore[var-annotated]

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self.counter.phase = "first" if trainer.global_step == 0 else "step"

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.counter.phase = "between"
        loss = outputs["loss"].detach().clone()
        dist.all_reduce(loss)
        self.losses.append(float(loss) / dist.get_world_size())


def _model(args: argparse.Namespace) -> GPT:
    return GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)


def run(layout: dict[str, Any], args: argparse.Namespace) -> tuple[dict[str, float], list[float]]:
    """One fit under ZeRO-3 and ``layout`` (more `ParallelStrategy` arguments): (MiB per step on this rank by
    collective kind, after the first step; the loss curve)."""
    L.seed_everything(0, verbose=False)
    world = int(os.environ["WORLD_SIZE"])
    counter = CommCounter()
    record = Record(counter)
    counter.install()
    try:
        strategy = lightning_par.ParallelStrategy(zero_stage=3, **layout)
        trainer = L.Trainer(
            accelerator="cpu", devices=world, strategy=strategy, precision="bf16-mixed", max_steps=args.steps,
            logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
            num_sanity_val_steps=0, limit_val_batches=0, callbacks=[record],
        )  # fmt: skip
        data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, num_samples=args.steps * args.batch * world)
        trainer.fit(_model(args), datamodule=data)
    finally:
        counter.uninstall()
    per_kind = {k: v / (args.steps - 1) / 2**20 for k, v in counter.per_kind("step").items()}
    return per_kind, record.losses


def arguments(doc: str) -> argparse.Namespace:
    """The command line shared with bench_fp8.py (model size, steps, ``--quick``), quiet loggers."""
    parser = argparse.ArgumentParser(description=doc.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 12 steps")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="samples per rank and step")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.quick:
        args.steps, args.layers, args.embd, args.seq = 12, 2, 64, 32
    return args


def loss_gap(got: list[float], base: list[float], steps: int, name: str) -> None:
    """Print the loss gap of ``got`` to ``base`` (largest, mean, the last 10 steps) and every tenth step."""
    gaps = [abs(a - b) / abs(b) for a, b in zip(got, base, strict=True)]
    tail = slice(max(0, steps - 10), steps)
    last = sum(got[tail]) / len(got[tail]) / (sum(base[tail]) / len(base[tail])) - 1
    print(f"\nloss gap to the {name} run: max {max(gaps):.4f}, mean {sum(gaps) / len(gaps):.4f}, "
          f"last 10 steps {last:+.4f}")  # fmt: skip
    for step in range(0, steps, max(1, steps // 10)):
        print(step, f"{base[step]:.4f}", f"{got[step]:.4f}")


def main() -> None:
    args = arguments(__doc__)
    exact_bytes, exact = run({}, args)
    int8_bytes, int8 = run({"zero_quantized_weights": True}, args)
    if dist.get_rank() == 0:
        n = dist.get_world_size()
        specs = specs_from_module(_model(args))
        layout = Layout(dp_shard=n, zero_stage=3, zero_quantized_weights=True, micro_batch_size=args.batch)
        formula = comm_bytes(specs, layout, args.batch * n, args.seq, args.embd, rank=0)["all_gather"] / 2**20
        size = f"GPT n_layer={args.layers} n_embd={args.embd} ({sum(s.numel for s in specs) / 1e6:.2f} M parameters)"
        print(f"\n{size}, {n} ranks, ZeRO-3, bf16-mixed, AdamW; {args.steps} steps; MiB per step after the first\n")
        print("| config | all-gather MiB / step | formula | measured / formula | / exact | reduce-scatter MiB / step |")
        print("|---|---|---|---|---|---|")
        ag, rs = exact_bytes.get("all_gather", 0.0), exact_bytes.get("reduce_scatter", 0.0)
        print(f"| exact (bf16 gather) | {ag:.3f} | | | 1.000 | {rs:.3f} |")
        qag, qrs = int8_bytes.get("all_gather", 0.0), int8_bytes.get("reduce_scatter", 0.0)
        print(f"| int8 gather | {qag:.3f} | {formula:.3f} | {qag / formula:.4f} | {qag / ag:.3f} | {qrs:.3f} |")
        loss_gap(int8, exact, args.steps, "exact")
    clean_exit()


if __name__ == "__main__":
    main()
