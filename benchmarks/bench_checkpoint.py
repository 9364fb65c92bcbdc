"""Sharded checkpoint cost for zero1/zero2/zero3: save time, load time, bytes per rank, and how long an asynchronous
save blocks training against a synchronous one.

Launch (2 ranks on 2 CPU cores, one thread each):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_checkpoint.py [--quick]

For each strategy, one Trainer with ``async_save=False`` and one with ``async_save=True`` train the same GPT; a
callback calls ``trainer.save_checkpoint`` after every ``--every``-th step (after warm-up) and times the call on
rank 0 (a synchronous call ends with a barrier, so it is the time every rank is held; an asynchronous one also
holds the next optimizer step until its background copy is taken, which is added). Medians leave out each fit's
first save (it allocates the staging buffers and warms DCP), reported apart. The last save of an async run is
followed at once by ``wait_for_checkpoint()``: that save's call + wait is the whole time to a committed folder.
Steps are classed by whether a background write was in flight when they started. After each fit, the last
checkpoint is loaded ``--loads`` times into the trained model (``strategy.load_checkpoint``: index checks + DCP
read + resharding into the live model and optimizer). Rounds alternate sync/async order (ABBA). A hand-run
benchmark, not a test: it asserts nothing. Results: docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

torch.set_num_threads(1)  # before any op: one core per rank

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402

import lightning_par  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402

STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


class SaveTimer(L.Callback):
    """Saves after chosen steps and times each call; times every step, noting whether a write was in flight."""

    def __init__(self, folder: Path, tag: str, save_steps: list[int], warmup: int) -> None:
        self.folder, self.tag, self.save_steps, self.warmup = folder, tag, save_steps, warmup
        self.blocks: list[float] = []  # seconds inside trainer.save_checkpoint, plus the staging fence after it
        self.fences: list[float] = []  # of which the wait for the background staging copy at the next optimizer step
        self._waited = 0.0
        self.to_commit = 0.0  # last save: call + wait_for_checkpoint
        self.steps_idle: list[float] = []
        self.steps_writing: list[float] = []
        self.last_path: Path | None = None
        self._t0, self._writing = 0.0, False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._writing = trainer.strategy.checkpoint_in_flight is not None  # type: ignore[attr-defined]
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        saver = trainer.strategy._checkpoints.saver  # type: ignore[attr-defined]
        waited = saver.staging_wait_s if saver is not None else 0.0
        if self.fences and waited > self._waited:  # this step's optimizer waited for the last save's staging
            self.fences[-1] += waited - self._waited
            self.blocks[-1] += waited - self._waited
        self._waited = waited
        if batch_idx >= self.warmup:
            (self.steps_writing if self._writing else self.steps_idle).append(time.perf_counter() - self._t0)
        step = trainer.global_step
        if step not in self.save_steps:
            return
        path = self.folder / f"{self.tag}_step{step}.ckpt"
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        self.blocks.append(time.perf_counter() - start)
        self.fences.append(0.0)
        self.last_path = path
        if step == self.save_steps[-1]:
            trainer.strategy.wait_for_checkpoint()  # type: ignore[attr-defined]
            self.to_commit = time.perf_counter() - start
            self._waited = saver.staging_wait_s if saver is not None else 0.0  # not a step's wait: the end's


def _bytes_per_rank(path: Path, world: int) -> tuple[list[int], int]:
    data = [(path / f"__{r}_0.distcp").stat().st_size for r in range(world)]
    shared = sum(p.stat().st_size for p in path.iterdir() if not p.name.endswith(".distcp"))
    return data, shared


def run_once(stage: int, use_async: bool, folder: Path, args: argparse.Namespace) -> dict[str, Any]:
    L.seed_everything(0, verbose=False)
    world = dist.get_world_size()
    model = GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    strategy = lightning_par.ParallelStrategy(zero_stage=stage, async_save=use_async)
    save_steps = [args.warmup + args.every * (i + 1) for i in range(args.saves)]
    steps = save_steps[-1] + 1
    data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, num_samples=steps * args.batch * world)
    timer = SaveTimer(folder, f"zero{stage}_{'async' if use_async else 'sync'}", save_steps, args.warmup)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer])  # fmt: skip
    trainer.fit(model, datamodule=data)
    assert timer.last_path is not None
    loads = []
    for _ in range(args.loads):
        dist.barrier()
        start = time.perf_counter()
        trainer.strategy.load_checkpoint(timer.last_path)
        dist.barrier()
        loads.append(time.perf_counter() - start)
    data_bytes, shared = _bytes_per_rank(timer.last_path, world)
    return {
        "blocks": timer.blocks,
        "fences": timer.fences,
        "to_commit": timer.to_commit,
        "steps_idle": timer.steps_idle,
        "steps_writing": timer.steps_writing,
        "loads": loads,
        "data_bytes": data_bytes,
        "shared_bytes": shared,
    }


def _ms(xs: list[float], digits: int = 0) -> str:
    return f"{statistics.median(xs) * 1e3:.{digits}f}" if xs else "-"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 round, 2 saves")
    parser.add_argument("--rounds", type=int, default=2, help="even, so ABBA order balances")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--saves", type=int, default=4, help="saves per run (the first is reported apart)")
    parser.add_argument("--every", type=int, default=3, help="steps between saves")
    parser.add_argument("--loads", type=int, default=3, help="timed loads per run")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    parser.add_argument("--dir", type=str, default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.quick:
        args.rounds, args.warmup, args.saves, args.every, args.loads = 1, 1, 2, 2, 1
        args.layers, args.embd, args.seq = 2, 64, 32
    dist.init_process_group("gloo")  # Lightning reuses it
    rank = dist.get_rank()
    box = [args.dir or (tempfile.mkdtemp(prefix="bench_ckpt_") if rank == 0 else None)]
    dist.broadcast_object_list(box)
    folder = Path(box[0])
    runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
    load_before, start = os.getloadavg()[0], time.perf_counter()
    for r in range(args.rounds):
        for name, stage in STAGES.items():
            modes = [False, True] if r % 2 == 0 else [True, False]
            for use_async in modes:
                key = (name, "async" if use_async else "sync")
                runs.setdefault(key, []).append(run_once(stage, use_async, folder, args))
    elapsed = time.perf_counter() - start

    if rank == 0:
        n_params = sum(p.numel() for p in GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4,
                                               n_embd=args.embd).parameters())  # fmt: skip
        print(f"\nGPT n_layer={args.layers} n_embd={args.embd} seq={args.seq} per-rank batch={args.batch}, "
              f"{n_params / 1e6:.2f} M params, AdamW; {args.rounds} rounds x {args.saves} saves every {args.every} "
              f"steps; {elapsed:.0f} s; 1-min load average {load_before:.1f} before, {os.getloadavg()[0]:.1f} after; "
              f"writing to {folder}\n")  # fmt: skip
        print(
            "| strategy | sync save ms | async save blocks ms (of which fence) | async / sync "
            "| async call to commit ms | load ms "
            "| data MiB per rank (rank 0, rank 1) + index and meta KiB | step ms idle | step ms while writing "
            "| first save ms, sync / async |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for name in STAGES:
            sync, asyn = runs[(name, "sync")], runs[(name, "async")]
            # Steady state: every save but each fit's first, which also allocates buffers and warms DCP's caches
            # (shown apart, in the last column).
            sync_blocks = [b for run in sync for b in run["blocks"][1:]]
            async_blocks = [b for run in asyn for b in run["blocks"][1:]]
            fences = [b for run in asyn for b in run["fences"][1:]]
            first_sync = [run["blocks"][0] for run in sync]
            first_async = [run["blocks"][0] for run in asyn]
            ratio = statistics.median(async_blocks) / statistics.median(sync_blocks)
            loads = [x for run in sync + asyn for x in run["loads"]]
            data = " / ".join(f"{b / 2**20:.2f}" for b in sync[0]["data_bytes"])
            idle = [s for run in sync + asyn for s in run["steps_idle"]]
            writing = [s for run in asyn for s in run["steps_writing"]]
            print(f"| {name} | {_ms(sync_blocks)} | {_ms(async_blocks)} ({_ms(fences, 1)}) | {ratio:.3f} "
                  f"| {_ms([run['to_commit'] for run in asyn])} | {_ms(loads)} | {data} + "
                  f"{sync[0]['shared_bytes'] / 1024:.0f} | {_ms(idle)} | {_ms(writing)} "
                  f"| {_ms(first_sync)} / {_ms(first_async)} |")  # fmt: skip
        if not args.dir:
            shutil.rmtree(folder, ignore_errors=True)
    clean_exit()


if __name__ == "__main__":
    main()
