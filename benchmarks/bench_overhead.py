"""Per-step overhead on a tiny model: step time of one strategy of every family minus Lightning's ``ddp``, in ms.

Launch (2 ranks on 2 CPU cores, one thread each so the ranks do not fight over cores):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_overhead.py --quick   # ~40 s
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_overhead.py           # ~2 min
    # one family and its baseline only, e.g. while profiling (~10 s):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_overhead.py --only moe,ddp_moe
    # where rank 0's Python time goes in one config (cProfile over the timed steps; ~15 s):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_overhead.py --profile zero2
    # collectives per step of every config (one untimed run each, `CommCounter`; ~45 s):
    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_overhead.py --collectives

The model is so small (GPT, 2 layers, n_embd 64, seq 32, per-rank batch 4: ~0.1 M parameters) that compute is a
small part of a step: what is left is Python (Lightning's loop, our hooks, the optimizer) and the latency of the
collectives. The issue's bar (issue 19): every family's step at most 1 ms over ``ddp``'s. Families: our ZeRO
engine at stage 0-3, tensor parallelism (``tp``, and ``sp`` with sequence parallelism), the pipeline (``pipe``:
pp = 2, 4 microbatches), context parallelism (``cp``), expert parallelism (``moe``, against ``ddp`` on the same
MoE-GPT; ``zero0_moe`` is the same model with replicated experts), DeepSpeed's engine (``deepspeed_zero1``) and a
Fabric loop (``fabric_zero1`` against Fabric's ``ddp``, same loop). Layouts that are not data parallel (tp, pipe,
cp) hold different work per rank than ``ddp``: they move activations, not gradients, so they pay a collective's
latency per layer and region on top of any Python overhead (``--collectives`` counts them).

Every config runs once per round in one process group with a fresh Trainer (or Fabric); the order reverses every
other round (ABBA) so drift hits both sides alike. Reported per config: median over rounds of the per-run median
step time, the per-round difference to its baseline with its range, and the difference of the fastest steps. Times
are at 1-min load < 2 on the 2-core machine (`uptime`); above that, other tenants dominate. A hand-run benchmark: it
asserts nothing. Results: docs/benchmarks_history.md, "Per-step overhead on a tiny model".
"""

from __future__ import annotations

import argparse
import cProfile
import io
import logging
import os
import pstats
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

torch.set_num_threads(1)  # before any op: one core per rank

import lightning as L  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _rounds import StepTimer, finish  # noqa: E402

import lightning_par  # noqa: E402  (registers the names for the Trainer and Fabric)
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT, MoEGPT  # noqa: E402
from lightning_par.parallel.comm_counter import CommCounter  # noqa: E402

Factory = Callable[[], Any]
Probe = cProfile.Profile | CommCounter | None  # what is switched on over the timed steps only


class _Config:
    """One timed setup: how it runs (Trainer or Fabric), its strategy and model, and the config it is compared to."""

    def __init__(self, kind: str, strategy: Factory, model: str, baseline: str | None) -> None:
        self.kind, self.strategy, self.model, self.baseline = kind, strategy, model, baseline


def _configs() -> dict[str, _Config]:
    ps = lightning_par.ParallelStrategy
    return {
        # Ordered so each config runs close in time to its baseline; ABBA does the rest.
        "ddp": _Config("trainer", lambda: "ddp", "gpt", None),
        "zero0": _Config("trainer", lambda: ps(zero_stage=0), "gpt", "ddp"),
        "zero1": _Config("trainer", lambda: "zero1", "gpt", "ddp"),
        "zero2": _Config("trainer", lambda: "zero2", "gpt", "ddp"),
        "zero3": _Config("trainer", lambda: "zero3", "gpt", "ddp"),
        "tp": _Config("trainer", lambda: ps(tp=2, sequence_parallel=False), "gpt", "ddp"),
        "sp": _Config("trainer", lambda: ps(tp=2, sequence_parallel=True), "gpt", "ddp"),
        "cp": _Config("trainer", lambda: "cp", "gpt", "ddp"),
        "pipe": _Config("trainer", lambda: "pipe", "gpt", "ddp"),
        "deepspeed_zero1": _Config("trainer", lambda: "deepspeed_zero1", "gpt", "ddp"),
        "ddp_moe": _Config("trainer", lambda: "ddp", "moe", None),
        "moe": _Config("trainer", lambda: "moe", "moe", "ddp_moe"),
        "zero0_moe": _Config("trainer", lambda: ps(zero_stage=0), "moe", "ddp_moe"),
        "fabric_ddp": _Config("fabric", lambda: "ddp", "gpt", None),
        "fabric_zero1": _Config("fabric", lambda: "zero1", "gpt", "fabric_ddp"),
    }


def _model(kind: str, args: argparse.Namespace) -> L.LightningModule:
    common = dict(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    if kind == "moe":
        return MoEGPT(**common, n_experts=4, top_k=2)
    return GPT(**common)


def _trainer_run(cfg: _Config, args: argparse.Namespace, world: int, profile: Probe) -> list[float]:
    steps = args.warmup + args.steps
    timer = StepTimer(args.warmup)
    callbacks: list[L.Callback] = [timer]
    if profile is not None:
        callbacks.append(_Profiled(profile, args.warmup))
    data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, num_samples=steps * args.batch * world)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=cfg.strategy(), max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=callbacks)  # fmt: skip
    trainer.fit(_model(cfg.model, args), datamodule=data)
    return timer.times


def _fabric_run(cfg: _Config, args: argparse.Namespace, world: int, profile: Probe) -> list[float]:
    # The loop of bench_fabric.py: forward, backward, step, zero_grad and one all-reduce of the loss per step.
    fabric = L.Fabric(accelerator="cpu", devices=world, strategy=cfg.strategy())
    fabric.launch()
    model = _model(cfg.model, args)
    model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=3e-4))
    g = torch.Generator().manual_seed(fabric.global_rank)
    times = []
    for i in range(args.warmup + args.steps):
        batch = torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
        if i >= args.warmup:
            _on(profile)
        t0 = time.perf_counter()
        loss = F.cross_entropy(model(batch[:, :-1]).flatten(0, 1), batch[:, 1:].flatten())
        fabric.backward(loss)
        opt.step()
        opt.zero_grad()
        fabric.all_reduce(loss.detach())
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
        _off(profile)
    return times


class _Profiled(L.Callback):
    """A cProfile (or a `CommCounter`, phase ``"step"``) on over the timed steps only, not over set-up."""

    def __init__(self, profile: cProfile.Profile | CommCounter, warmup: int) -> None:
        self.profile, self.warmup = profile, warmup

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, batch_idx: int) -> None:
        if batch_idx >= self.warmup:
            _on(self.profile)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        _off(self.profile)


def _on(probe: Probe) -> None:
    if isinstance(probe, CommCounter):
        probe.phase = "step"
    elif probe is not None:
        probe.enable()


def _off(probe: Probe) -> None:
    if isinstance(probe, CommCounter):
        probe.phase = "other"
    elif probe is not None:
        probe.disable()


def _run(name: str, cfg: _Config, args: argparse.Namespace, world: int, profile: Probe = None) -> list[float]:
    """One fresh run; this rank's timed step times in seconds."""
    L.seed_everything(0, verbose=False)
    run = _fabric_run if cfg.kind == "fabric" else _trainer_run
    times = run(cfg, args, world, profile)
    if len(times) != args.steps:
        raise RuntimeError(f"{name}: timed {len(times)} steps, expected {args.steps}; raise num_samples")
    return times


def _profile(name: str, cfg: _Config, args: argparse.Namespace, world: int) -> list[str]:
    _run(name, cfg, args, world)  # warm the process (imports, first-call caches) outside the profile
    profile = cProfile.Profile()
    _run(name, cfg, args, world, profile)
    out = io.StringIO()
    stats = pstats.Stats(profile, stream=out)
    stats.sort_stats("tottime").print_stats(40)
    stats.sort_stats("cumulative").print_stats(60)
    return [f"cProfile of {name}, rank 0, {args.steps} timed steps (divide by it for per step):", out.getvalue()]


def _collectives(configs: dict[str, _Config], args: argparse.Namespace, world: int) -> list[str]:
    """Collective calls per timed step of each config, by kind (one untimed run each); ``ddp``'s gradient
    all-reduces are issued by its C++ reducer, which no Python wrapper sees (one bucket here: 1 per step)."""
    lines = ["| config | collectives per step (scalars < 1 KiB in brackets) |", "|---|---|"]
    for name, cfg in configs.items():
        counter = CommCounter()
        counter.install()
        try:
            _run(name, cfg, args, world, counter)
        finally:
            counter.uninstall()
        kinds: dict[str, list[int]] = {}
        for (phase, kind, small), n in counter.calls.items():
            if phase == "step":
                kinds.setdefault(kind, [0, 0])[small] += n
        per = ", ".join(
            f"{k} {big / args.steps:g} [{small / args.steps:g}]" for k, (big, small) in sorted(kinds.items())
        )
        lines.append(f"| {name} | {per} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 2 rounds, 6 timed steps")
    parser.add_argument("--rounds", type=int, default=6, help="even, so ABBA order balances")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per run")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--embd", type=int, default=64)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch (pipe: 4 microbatches of 1)")
    parser.add_argument("--only", default="", help="comma-separated config names (default: all)")
    parser.add_argument("--profile", default="", help="profile this config on rank 0 instead of timing")
    parser.add_argument("--collectives", action="store_true", help="count collectives per step instead of timing")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.ERROR)  # keep the table readable
    if args.quick:
        args.rounds, args.warmup, args.steps = 2, 2, 6
    world = int(os.environ.get("WORLD_SIZE", "1"))
    configs = _configs()
    if args.profile:
        lines = _profile(args.profile, configs[args.profile], args, world)
        return finish(lines)
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only.split(",")}
    if args.collectives:
        return finish(_collectives(configs, args, world))
    order = list(configs)
    medians: dict[str, list[float]] = {name: [] for name in configs}
    fastest = dict.fromkeys(configs, float("inf"))
    load_before = os.getloadavg()[0]  # other tenants show up here; above ~2 on this 2-core machine, rerun
    start = time.perf_counter()
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            times = _run(name, configs[name], args, world)
            medians[name].append(statistics.median(times))
            fastest[name] = min(fastest[name], *times)
    lines = [
        f"\nGPT / MoE-GPT (4 experts, top-2) n_layer={args.layers} n_embd={args.embd} seq={args.seq} per-rank "
        f"batch={args.batch}; {args.rounds} rounds x {args.steps} timed steps (+{args.warmup} warm-up); took "
        f"{time.perf_counter() - start:.0f} s; 1-min load {load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n",
        # Two views: the per-round difference of median steps (ABBA pairs runs close in time), and the difference
        # of the fastest steps over all rounds (least disturbed by other tenants, which only ever add time).
        "| config | ms/step | baseline | ms/step | minus baseline, ms: median of rounds [min, max] | fastest step "
        "minus baseline's, ms |",
        "|---|---|---|---|---|---|",
    ]
    for name, cfg in configs.items():
        a = statistics.median(medians[name]) * 1e3
        if cfg.baseline is None or cfg.baseline not in medians:
            lines.append(f"| {name} | {a:.2f} | | | | (fastest {fastest[name] * 1e3:.2f}) |")
            continue
        diffs = [(x - y) * 1e3 for x, y in zip(medians[name], medians[cfg.baseline])]
        b = statistics.median(medians[cfg.baseline]) * 1e3
        low = (fastest[name] - fastest[cfg.baseline]) * 1e3
        lines.append(f"| {name} | {a:.2f} | {cfg.baseline} | {b:.2f} | {statistics.median(diffs):+.2f} "
                     f"[{min(diffs):+.2f}, {max(diffs):+.2f}] | {low:+.2f} |")  # fmt: skip
    finish(lines)


if __name__ == "__main__":
    main()
