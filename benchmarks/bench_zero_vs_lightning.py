"""Step time of lightning_par's ZeRO strategies against Lightning's nearest built-in strategies.

Launch (2 ranks on 2 CPU cores, one thread each so the ranks do not fight over cores):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_zero_vs_lightning.py [--quick]

Pairs (ours vs theirs):
- ``zero1`` vs ``ddp``: ZeRO-1 moves DDP's bytes (reduce-scatter + all-gather = one all-reduce) and adds a sharded
  optimizer, so DDP is the bar.
- ``zero2`` vs ``ddp``: Lightning's ``deepspeed_stage_2`` refuses a CPU accelerator (docs/benchmarks_history.md).
- ``zero3`` vs ``ModelParallelStrategy`` + the standard FSDP2 recipe (`FSDP2GPT.configure_model`).
- ``zero0`` vs ``ddp``, a diagnostic: our engine without sharding, to tell engine cost from ZeRO's.

Every config runs once per round, in one process group, with a fresh Trainer; the order reverses every other round
(ABBA) so drift (thermal, page cache, other tenants) hits both sides of a pair alike. A hand-run benchmark, not a
test: it asserts nothing about time. Results and their interpretation: docs/benchmarks_history.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any, cast

import torch

torch.set_num_threads(1)  # before any op: one core per rank

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _rounds import StepTimer  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch import nn  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402

import lightning_par  # noqa: E402  (registers "zero1", "zero2", "zero3")
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


class FSDP2GPT(GPT):
    """The GPT sharded the way Lightning documents FSDP2 under `ModelParallelStrategy`: each block, then the root."""

    def configure_model(self) -> None:
        assert self.device_mesh is not None, "ModelParallelStrategy sets device_mesh before configure_model"
        mesh = self.device_mesh["data_parallel"]
        for block in cast(nn.ModuleList, self.transformer["h"]):
            fully_shard(block, mesh=mesh)
        fully_shard(self, mesh=mesh)  # the root owns embeddings, ln_f and lm_head


def _configs(model_kwargs: dict[str, Any], world: int) -> dict[str, Callable[[], tuple[Any, L.LightningModule]]]:
    """Name -> factory of (strategy, model); a fresh pair per run, so no state leaks between runs."""
    return {
        # Ordered so each pair runs close in time: ddp sits between zero1 and zero2, the FSDP2 pair is adjacent.
        "zero1": lambda: ("zero1", GPT(**model_kwargs)),
        "ddp": lambda: ("ddp", GPT(**model_kwargs)),
        "zero2": lambda: ("zero2", GPT(**model_kwargs)),
        # Diagnostic: our engine at stage 0 (plain all-reduce, no sharding) separates engine cost from ZeRO's.
        "zero0": lambda: (lightning_par.ParallelStrategy(zero_stage=0), GPT(**model_kwargs)),
        "lightning_fsdp2": lambda: (ModelParallelStrategy(data_parallel_size=world, tensor_parallel_size=1),
                                    FSDP2GPT(**model_kwargs)),
        "zero3": lambda: ("zero3", GPT(**model_kwargs)),
    }  # fmt: skip


PAIRS = [("zero1", "ddp"), ("zero2", "ddp"), ("zero3", "lightning_fsdp2"), ("zero0", "ddp")]


class ReadsWeights(L.Callback):
    """A user callback with a batch-end hook (it could read weights): ZeRO-1/2 then finish the parameter all-gather
    before it, as before the overlap existed. The ``*_sync_gather`` diagnostics add it to measure the overlap."""

    def on_train_batch_end(self, *args: Any) -> None:
        pass


DEFERRED: dict[str, list[dict[str, Any]]] = {}  # per config: the deferred all-gather's counters, one per run


def run_once(
    name: str, factory: Callable[[], tuple[Any, L.LightningModule]], args: argparse.Namespace
) -> tuple[float, float, float]:
    """One fresh Trainer.fit; returns rank 0's (median, fastest) step time in seconds, step end to step end, and the
    median CPU time per step summed over the ranks."""
    L.seed_everything(0, verbose=False)
    strategy, model = factory()
    steps = args.warmup + args.steps
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))
    data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, num_samples=steps * args.batch * world)
    timer = StepTimer(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        limit_val_batches=0,
        callbacks=[timer, *([ReadsWeights()] if name.endswith("_sync_gather") else [])],
    )
    trainer.fit(model, datamodule=data)
    prefetch = getattr(getattr(getattr(trainer.strategy, "parallel_run", None), "zero", None), "prefetch", None)
    if prefetch is not None:
        DEFERRED.setdefault(name, []).append(dict(prefetch.stats))
    if len(timer.times) != args.steps:
        raise RuntimeError(f"{name}: timed {len(timer.times)} steps, expected {args.steps}; raise num_samples")
    cpu = torch.tensor(statistics.median(timer.cpu), dtype=torch.float64)
    if dist.is_initialized():
        dist.all_reduce(cpu)  # every rank's work, gloo's threads included
    return statistics.median(timer.cycles), min(timer.cycles), float(cpu)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 round, 2 timed steps")
    parser.add_argument("--rounds", type=int, default=6, help="even, so ABBA order balances")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12, help="timed steps per run")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    parser.add_argument("--only", default="", help="comma-separated config names (default: all); pairs need both")
    parser.add_argument("--overlap-diagnostic", action="store_true",
                        help="also zero1/zero2 with the all-gather finished before a batch-end hook")  # fmt: skip
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.WARNING)  # keep the tables readable
    if args.quick:
        args.rounds, args.warmup, args.steps, args.layers, args.embd, args.seq = 1, 1, 2, 2, 64, 32
    model_kwargs = dict(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    configs = _configs(model_kwargs, int(os.environ.get("WORLD_SIZE", "1")))
    pairs = list(PAIRS)
    if args.overlap_diagnostic:  # the same strategies with the all-gather finished before a batch-end hook
        for stage in ("zero1", "zero2"):
            configs[f"{stage}_sync_gather"] = configs[stage]
            pairs.append((stage, f"{stage}_sync_gather"))
    if args.only:
        keep = args.only.split(",")
        configs = {name: configs[name] for name in keep}
        pairs = [(a, b) for a, b in pairs if a in configs and b in configs]
    order = list(configs)
    medians: dict[str, list[float]] = {name: [] for name in configs}
    cpus: dict[str, list[float]] = {name: [] for name in configs}
    fastest: dict[str, float] = {name: float("inf") for name in configs}
    load_before = os.getloadavg()[0]  # other tenants on the machine show up here; drift hits both sides alike
    start = time.perf_counter()
    for r in range(args.rounds):
        # ABBA: reversing every other round cancels a linear drift for every pair, not only the adjacent ones.
        for name in order if r % 2 == 0 else order[::-1]:
            med, low, cpu = run_once(name, configs[name], args)
            medians[name].append(med)
            cpus[name].append(cpu)
            fastest[name] = min(fastest[name], low)
    elapsed = time.perf_counter() - start

    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank == 0:
        n_params = sum(p.numel() for p in GPT(**model_kwargs).parameters())
        print(f"\nGPT n_layer={args.layers} n_embd={args.embd} seq={args.seq} per-rank batch={args.batch}, "
              f"{n_params / 1e6:.2f} M params; {args.rounds} rounds x {args.steps} timed steps "
              f"(+{args.warmup} warm-up); benchmark took {elapsed:.0f} s; 1-min load average {load_before:.1f} "
              f"before, {os.getloadavg()[0]:.1f} after\n")  # fmt: skip
        # Three views of one comparison: ratio of the medians (the headline), the median of the per-round ratios
        # (pairs runs close in time, so slow drift cancels) and the ratio of the fastest steps (least disturbed by
        # other tenants, which only ever add time).
        print("| ours | ms/step | Lightning | ms/step | ours/theirs | per-round ratio: median [min, max] "
              "| fastest-step ratio | CPU ms/step, all ranks: ours / theirs | CPU ratio |")  # fmt: skip
        print("|---|---|---|---|---|---|---|---|---|")
        for ours, theirs in pairs:
            a, b = statistics.median(medians[ours]), statistics.median(medians[theirs])
            rounds = [x / y for x, y in zip(medians[ours], medians[theirs])]
            mid = statistics.median(rounds)
            ca, cb = statistics.median(cpus[ours]), statistics.median(cpus[theirs])
            print(f"| {ours} | {a * 1e3:.1f} | {theirs} | {b * 1e3:.1f} | {a / b:.3f} | {mid:.3f} "
                  f"[{min(rounds):.3f}, {max(rounds):.3f}] | {fastest[ours] / fastest[theirs]:.3f} "
                  f"| {ca * 1e3:.0f} / {cb * 1e3:.0f} | {ca / cb:.3f} |")  # fmt: skip
        for name, runs in DEFERRED.items():  # evidence that the overlap ran (or, for *_sync_gather, was waited early)
            print(f"{name}: all-gather deferred {runs[-1]['deferred']} times in the last run; blocks waited for "
                  f"their weights in the forward {runs[-1]['waited_in_forward']} times, whole gathers waited "
                  f"outside it {runs[-1]['waited_outside']} times")  # fmt: skip
    clean_exit()


if __name__ == "__main__":
    main()
