"""Step time and per-rank memory of the DeepSpeed backend against the native one and Lightning's own DeepSpeed.

Launch (2 ranks on 2 CPU cores, one thread each):

    OMP_NUM_THREADS=1 MALLOC_MMAP_THRESHOLD_=131072 torchrun --standalone --nproc-per-node 2 \
        benchmarks/bench_deepspeed.py [--quick]

Per ZeRO stage s in 1, 2, 3, three runs on the same model, data and AdamW:
- ``deepspeed_zero{s}`` (lightning_par, DeepSpeed backend),
- ``zero{s}`` (lightning_par, native backend: our ZeRO 1-2 engine, FSDP2 for 3),
- ``deepspeed_stage_{s}`` (Lightning's own ``DeepSpeedStrategy``).

Lightning refuses ``DeepSpeedStrategy`` on a CPU accelerator ("only supported on CUDA GPUs"). This script
subclasses it to skip that check and two CUDA assumptions (device index ``None`` on CPU); that is acceptable here
because it is a hand-run measurement of what the same DeepSpeed engine costs under Lightning's glue, shipped
nowhere and imported by nothing; the subclass changes no training code path, only device bookkeeping.

Every config runs once per round with a fresh Trainer; the order reverses every other round (ABBA). Memory per
rank: the peak resident set during ``fit`` above the resident set just before it (VmHWM reset through
``/proc/self/clear_refs``; ``MALLOC_MMAP_THRESHOLD_`` makes freed tensors go back to the OS, docs/testing.md).
Last, on rank 0 alone: one optimizer step of DeepSpeedCPUAdam against torch AdamW (for-loop and foreach) over the
model's parameters. Asserts nothing about time; results in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

torch.set_num_threads(1)
os.environ.setdefault("DS_ACCELERATOR", "cpu")

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _rounds import StepTimer  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy  # noqa: E402

import lightning_par  # noqa: E402, F401  (registers the names)
from lightning_par import _compat  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


class CPUDeepSpeedStrategy(DeepSpeedStrategy):
    """Lightning's DeepSpeedStrategy with its CUDA-only checks bypassed (benchmark only; see the module docstring)."""

    def setup_environment(self) -> None:
        DDPStrategy.setup_environment(self)  # the parent raises for any accelerator but CUDA

    def setup_distributed(self) -> None:
        from lightning.fabric.utilities.seed import reset_seed

        reset_seed()
        self.set_world_ranks()
        _compat.init_deepspeed_distributed(self)  # the parent first checks CUDA device indices, which are None on CPU

    def _setup_model_and_optimizer(self, *args: Any, **kwargs: Any) -> Any:
        import argparse as ap

        import deepspeed

        original = deepspeed.initialize

        def initialize(*a: Any, **kw: Any) -> Any:
            # Lightning passes device_rank=root_device.index (None on CPU); DeepSpeed compares it with 0.
            if kw.get("args") is not None and getattr(kw["args"], "device_rank", 0) is None:
                kw["args"] = ap.Namespace(device_rank=self.local_rank)
            return original(*a, **kw)

        deepspeed.initialize = initialize
        try:
            return super()._setup_model_and_optimizer(*args, **kwargs)
        finally:
            deepspeed.initialize = original


class CPUAdamGPT(GPT):
    """The GPT with DeepSpeedCPUAdam in configure_optimizers: what Lightning's DeepSpeed needs under offload (it
    refuses a torch optimizer there); lightning_par swaps it in itself. Same groups, hyper-parameters, schedule."""

    def configure_optimizers(self) -> Any:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        config = super().configure_optimizers()
        torch_opt, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
        groups = [{k: v for k, v in g.items() if k in ("params", "weight_decay")} for g in torch_opt.param_groups]
        opt = DeepSpeedCPUAdam(groups, lr=self.lr, betas=self.betas, adamw_mode=True)
        lambdas = scheduler.lr_lambdas
        config["optimizer"] = opt
        config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(opt, lambdas[0])
        return config


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field):
                return int(line.split()[1])
    return 0


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS (Linux)


def _configs() -> dict[str, Callable[[], Any]]:
    out: dict[str, Callable[[], Any]] = {}
    for s in ("1", "2", "3", "3_offload"):
        out[f"deepspeed_zero{s}"] = lambda s=s: f"deepspeed_zero{s}"
        out[f"zero{s}"] = lambda s=s: f"zero{s}"
        offload = s.endswith("offload")
        out[f"lightning_deepspeed_stage_{s}"] = lambda s=s, offload=offload: CPUDeepSpeedStrategy(
            stage=int(s[0]), offload_optimizer=offload, offload_parameters=offload, process_group_backend="gloo"
        )
    return out


def _native(name: str) -> str:
    return "zero" + name.split("zero")[-1] if "zero" in name else "zero" + name.split("stage_")[-1]


def run_once(
    name: str, factory: Callable[[], Any], model_kwargs: dict[str, Any], args: argparse.Namespace
) -> tuple[float, int]:
    """One fresh fit; this rank's median step time (s) and peak RSS above the start (bytes)."""
    L.seed_everything(0, verbose=False)
    world = int(os.environ.get("WORLD_SIZE", "1"))  # the process group starts inside the first fit
    steps = args.warmup + args.steps
    data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, num_samples=steps * args.batch * world)
    timer = StepTimer(args.warmup)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=factory(), max_steps=steps, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    offloaded_lightning = name.startswith("lightning") and name.endswith("offload")
    model = (CPUAdamGPT if offloaded_lightning else GPT)(**model_kwargs)
    before = _rss_kib("VmRSS")
    _reset_peak()
    trainer.fit(model, datamodule=data)
    peak = (_rss_kib("VmHWM") - before) * 1024
    return statistics.median(timer.times), peak


def optimizer_step_times(n_params: int, repeats: int) -> dict[str, float]:
    """Median seconds of one optimizer step over ``n_params`` fp32 elements in 16 tensors, per implementation."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    def params() -> list[torch.nn.Parameter]:
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(n_params // 16, generator=g)) for _ in range(16)]
        for p in ps:
            p.grad = torch.randn(p.shape, generator=g)
        return ps

    makers: dict[str, Callable[[], torch.optim.Optimizer]] = {
        "torch AdamW (for-loop)": lambda: torch.optim.AdamW(params(), lr=1e-3, foreach=False),
        "torch AdamW (foreach)": lambda: torch.optim.AdamW(params(), lr=1e-3, foreach=True),
        "DeepSpeedCPUAdam": lambda: DeepSpeedCPUAdam(params(), lr=1e-3, adamw_mode=True),
    }
    opts = {name: make() for name, make in makers.items()}
    times: dict[str, list[float]] = {name: [] for name in opts}
    for opt in opts.values():
        opt.step()  # state creation, outside the timing
    for r in range(repeats):
        for name in list(opts) if r % 2 == 0 else list(opts)[::-1]:
            t0 = time.perf_counter()
            opts[name].step()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 round, 2 timed steps")
    parser.add_argument("--rounds", type=int, default=4, help="even, so ABBA order balances")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--embd", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    parser.add_argument("--only", default="", help="comma-separated config names (default: all)")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.quick:
        args.rounds, args.warmup, args.steps, args.layers, args.embd, args.seq = 1, 1, 2, 2, 64, 32
    model_kwargs = dict(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.embd)
    configs = _configs()
    if args.only:
        configs = {k: v for k, v in configs.items() if k in args.only.split(",")}
    order = list(configs)
    medians: dict[str, list[float]] = {n: [] for n in configs}
    peaks: dict[str, list[int]] = {n: [] for n in configs}
    load_before, start = os.getloadavg()[0], time.perf_counter()
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            med, peak = run_once(name, configs[name], model_kwargs, args)
            medians[name].append(med)
            peaks[name].append(peak)
    elapsed = time.perf_counter() - start
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    all_peaks: list[Any] = [peaks]
    if dist.is_initialized():
        all_peaks = [None] * world
        dist.all_gather_object(all_peaks, peaks)
    n_params = sum(p.numel() for p in GPT(**model_kwargs).parameters())
    if rank == 0:
        print(
            f"\nGPT n_layer={args.layers} n_embd={args.embd} seq={args.seq} per-rank batch={args.batch}, "
            f"{n_params / 1e6:.2f} M params, {world} ranks; {args.rounds} rounds x {args.steps} timed steps; "
            f"took {elapsed:.0f} s; 1-min load {load_before:.1f} before, {os.getloadavg()[0]:.1f} after\n"
        )
        # Memory: the median over rounds, so the one run that first imports and JIT-loads DeepSpeed does not count.
        print("| config | ms/step (median of rounds) | / native | peak RSS above start, MiB, rank 0, rank 1 |")
        print("|---|---|---|---|")
        for name in order:
            ms = statistics.median(medians[name]) * 1e3
            native_runs = medians.get(_native(name))
            native = statistics.median(native_runs) * 1e3 if native_runs else float("nan")
            mib = [statistics.median(p[name]) / 2**20 for p in all_peaks]
            print(f"| {name} | {ms:.1f} | {ms / native:.2f} | {', '.join(f'{m:.0f}' for m in mib)} |")
        times = optimizer_step_times(n_params, repeats=3 if args.quick else 15)
        base = times["torch AdamW (for-loop)"]
        print(f"\nOne optimizer step over {n_params / 1e6:.2f} M fp32 params, 1 thread:\n")
        print("| optimizer | ms/step | / torch AdamW (for-loop) |\n|---|---|---|")
        for name, t in times.items():
            print(f"| {name} | {t * 1e3:.2f} | {t / base:.2f} |")
    if dist.is_initialized():
        dist.barrier()
    clean_exit()


if __name__ == "__main__":
    main()
