"""What the replica check (`ParallelStrategy(check_replicas_every=N)`) costs, as a share of a training step.

Launch (2 ranks, one thread each):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_replica_check.py [--quick]

Two layouts of the GPT of bench_zero_vs_lightning.py (4 layers, n_embd 256, seq 128, per-rank batch 8: 3.3 M
parameters): ``zero1`` (every parameter is whole on both ranks: the check's largest case, every tensor read and
compared) and ``zero3`` with the check's own worst case on 2 ranks (nothing replicated: it still reads every shard
and gathers the fingerprints). Each runs with the check after every step (``check_replicas_every=1``) and
without, alternated ABBA per round. Reported per layout: the median step time of both and their ratio (what a
check after every step costs), and the check's own median wall time over the median step without it (the share
of a step one check takes; with ``check_replicas_every=N`` the cost per step is that share / N). A hand-run
benchmark: results in docs/benchmarks.md ("Replica check").
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
from _rounds import StepTimer, finish  # noqa: E402

import lightning_par  # noqa: E402
from lightning_par.callbacks import ReplicaCheck  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT  # noqa: E402

CONFIGS = {
    "zero1": {"zero_stage": 1},
    "zero1_check": {"zero_stage": 1, "check_replicas_every": 1},
    "zero3": {"zero_stage": 3},
    "zero3_check": {"zero_stage": 3, "check_replicas_every": 1},
}


def run_once(name: str, args: argparse.Namespace) -> tuple[float, list[float], int]:
    """One fresh fit: rank 0's median step (end to end), the check's times, and the pieces it compared."""
    L.seed_everything(0, verbose=False)
    model = GPT(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    steps = args.warmup + args.steps
    world = dist.get_world_size()
    data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, num_samples=steps * args.batch * world)
    timer = StepTimer(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=lightning_par.ParallelStrategy(**CONFIGS[name]), max_steps=steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    check = next((c for c in trainer.callbacks if isinstance(c, ReplicaCheck)), None)  # type: ignore[attr-defined]
    seconds = check.seconds[args.warmup :] if check is not None else []
    return statistics.median(timer.cycles), seconds, check.compared if check is not None else 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 round, 2 timed steps")
    parser.add_argument("--rounds", type=int, default=4, help="even, so ABBA order balances")
    parser.add_argument("--warmup", type=int, default=2)
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
    dist.init_process_group("gloo")
    order = list(CONFIGS)
    steps: dict[str, list[float]] = {n: [] for n in order}
    checks: dict[str, list[float]] = {n: [] for n in order}
    compared: dict[str, int] = {}
    load, start = os.getloadavg()[0], time.perf_counter()
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            step, seconds, compared[name] = run_once(name, args)
            steps[name].append(step)
            checks[name] += seconds
    n_params = sum(p.numel() for p in GPT(256, args.seq, args.layers, 4, args.embd).parameters())
    lines = [
        f"GPT n_layer={args.layers} n_embd={args.embd} seq={args.seq} per-rank batch={args.batch}, "
        f"{n_params / 1e6:.2f} M params, {dist.get_world_size()} ranks; {args.rounds} rounds x {args.steps} steps; "
        f"{time.perf_counter() - start:.0f} s; 1-min load {load:.1f} before, {os.getloadavg()[0]:.1f} after",
        "| layout | ms/step | with the check every step | ratio | per-round ratios | one check, ms | share of "
        "a step | pieces compared |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for base in ("zero1", "zero3"):
        a, b = steps[f"{base}_check"], steps[base]
        rounds = [x / y for x, y in zip(a, b)]
        one = statistics.median(checks[f"{base}_check"])
        lines.append(
            f"| {base} | {statistics.median(b) * 1e3:.1f} | {statistics.median(a) * 1e3:.1f} | "
            f"{statistics.median(a) / statistics.median(b):.3f} | {[round(x, 3) for x in rounds]} | {one * 1e3:.2f} | "
            f"{one / statistics.median(b):.4f} | {compared[f'{base}_check']} |"
        )
    finish(lines)


if __name__ == "__main__":
    main()
