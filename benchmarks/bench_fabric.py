"""Step time of a Fabric loop against the Trainer on the same lightning_par layout.

Launch (2 ranks on 2 CPU cores, one thread each):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_fabric.py [--quick]

Both sides train the same GPT on the same batches under the same layout (``zero2``, ``zero3``, ``tp``), and both
all-reduce the loss once per step (the Trainer's ``self.log(sync_dist=True)``, the loop's ``fabric.all_reduce``).
The Fabric step is timed from before the forward to after ``optimizer.zero_grad``; the Trainer's from
``on_train_batch_start`` to ``on_train_batch_end`` (which also covers its loop's hooks and logging: that is the
difference measured). Rounds alternate the order (ABBA). A hand-run benchmark: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time

import torch

torch.set_num_threads(1)  # before any op: one core per rank

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _rounds import finish  # noqa: E402
from bench_zero_vs_lightning import StepTimer  # noqa: E402

import lightning_par  # noqa: E402, F401  (registers the names for Trainer and Fabric)
from lightning_par.models import GPT  # noqa: E402

LAYOUTS = ("zero2", "zero3", "tp")


def _batches(args: argparse.Namespace, steps: int, dp: int, rank: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, 256, (steps, dp, args.batch, args.seq + 1), generator=g)
    return [(data[s, rank, :, :-1], data[s, rank, :, 1:]) for s in range(steps)]


def _trainer(layout: str, args: argparse.Namespace, world: int) -> float:
    L.seed_everything(0, verbose=False)
    timer = StepTimer(args.warmup)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=layout, max_steps=args.warmup + args.steps,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[timer], use_distributed_sampler=False)  # fmt: skip
    model = GPT(**args.model)

    def loader() -> torch.utils.data.DataLoader:
        dp = trainer.strategy.meshes.dp  # type: ignore[attr-defined]
        batches = _batches(args, args.warmup + args.steps, dp.size(), dp.get_local_rank())
        return torch.utils.data.DataLoader(batches, batch_size=None)

    model.train_dataloader = loader  # type: ignore[method-assign]
    trainer.fit(model)
    return statistics.median(timer.times)


def _fabric(layout: str, args: argparse.Namespace, world: int) -> float:
    L.seed_everything(0, verbose=False)
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=layout)
    fabric.launch()
    model = GPT(**args.model)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    sampler = fabric.strategy.distributed_sampler_kwargs
    times = []
    for i, (x, y) in enumerate(_batches(args, args.warmup + args.steps, sampler["num_replicas"], sampler["rank"])):
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        fabric.all_reduce(loss.detach())
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 round, 2 timed steps")
    parser.add_argument("--rounds", type=int, default=4, help="even, so ABBA order balances")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.quick:
        args.rounds, args.warmup, args.steps, args.layers, args.embd, args.seq = 1, 1, 2, 2, 64, 32
    args.model = dict(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    times: dict[tuple[str, str], list[float]] = {(lay, side): [] for lay in LAYOUTS for side in ("fabric", "trainer")}
    start = time.perf_counter()
    for r in range(args.rounds):
        for layout in LAYOUTS:
            sides = ("fabric", "trainer") if r % 2 == 0 else ("trainer", "fabric")
            for side in sides:
                run = _fabric if side == "fabric" else _trainer
                times[(layout, side)].append(run(layout, args, world))
    lines = [
        f"\nGPT n_layer={args.layers} n_embd={args.embd} seq={args.seq} per-rank batch={args.batch}; {args.rounds} "
        f"rounds x {args.steps} timed steps; took {time.perf_counter() - start:.0f} s; load {os.getloadavg()[0]:.1f}\n",
        "| layout | Fabric ms/step | Trainer ms/step | Fabric/Trainer (median of per-round ratios) [min, max] |",
        "|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        fab, tr = times[(layout, "fabric")], times[(layout, "trainer")]
        ratios = [a / b for a, b in zip(fab, tr)]
        lines.append(f"| {layout} | {statistics.median(fab) * 1e3:.1f} | {statistics.median(tr) * 1e3:.1f} | "
                     f"{statistics.median(ratios):.3f} [{min(ratios):.3f}, {max(ratios):.3f}] |")  # fmt: skip
    if dist.is_initialized():
        finish(lines)


if __name__ == "__main__":
    main()
