"""gpu_check.py sections (2) step time and MFU against hand-written FSDP2 and Lightning's `ModelParallelStrategy`,
(4) asynchronous against synchronous save, and (5) parameter/optimizer and activation offload.

All on one device (world 1): the figures measure what this suite adds per step on top of the same computation
(Python, hooks, bookkeeping), not communication. Step times are medians of the timed steps of a run; each round
runs every variant once, the order reversed every other round, and ratios are taken within a round.
"""

from __future__ import annotations

import gc
import socket
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _gpu_fits import LLAMA_1B, LLAMA_SMOKE, fit, full_params, loader, tokens
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.attention import SDPBackend, sdpa_kernel

import lightning_par
from lightning_par.callbacks.monitor import peak_flops_for
from lightning_par.checkpoint import load_full_state
from lightning_par.models import Llama


def ensure_process_group(accelerator: str) -> None:
    """A world-1 default group for the hand-written loop (Lightning's fits reuse it, as it reuses theirs)."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if accelerator == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def flops_per_token(config: dict[str, int], n_params: int) -> float:
    """6 N + 12 L H T (PaLM, arXiv 2204.02311, appendix B); N without the input embedding (a lookup, no matmul)."""
    n_matmul = n_params - config["vocab_size"] * config["dim"]
    return 6.0 * n_matmul + 12.0 * config["n_layers"] * config["dim"] * config["max_seq_len"]


class _FSDP2Llama(Llama):
    """The same Llama for Lightning's `ModelParallelStrategy`: FSDP2 per block and at the root, as torchtitan does."""

    def configure_model(self) -> None:
        mesh = self.device_mesh["data_parallel"]
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in self.layers:
            fully_shard(block, mesh=mesh, mp_policy=policy)
        fully_shard(self, mesh=mesh, mp_policy=policy)


def hand_fsdp2(config: dict[str, int], data: Any, batch: int, steps: int, accelerator: str) -> list[float]:
    """Step times of a plain torch loop: FSDP2 per block + root, bf16 parameters in compute, fp32 reduce, autocast."""
    ensure_process_group(accelerator)
    L.seed_everything(0, verbose=False)
    device = torch.device(accelerator)
    with torch.device(device):
        model = Llama(**config)
    mesh = init_device_mesh(accelerator, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    optimizer = model.configure_optimizers()["optimizer"]
    times: list[float] = []
    _sync(device)
    last = time.perf_counter()
    for x, y in loader(data, batch, plain=True):  # timed from one step's end to the next, the fetch included
        if len(times) == steps:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(accelerator, dtype=torch.bfloat16):
            logits = model(x)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        float(loss)
        _sync(device)
        now = time.perf_counter()
        times.append(now - last)
        last = now
    return times


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _variants(config: dict[str, int], accelerator: str) -> dict[str, Callable[..., list[float]]]:
    def ours(name: str) -> Callable[..., list[float]]:
        def run(data: Any, batch: int, steps: int) -> list[float]:
            rec = fit(lambda: Llama(**config), name, data, batch=batch, steps=steps, accelerator=accelerator,
                      precision="bf16-mixed")[0]  # fmt: skip
            return rec.step_s

        return run

    def lightning_mps(data: Any, batch: int, steps: int) -> list[float]:
        strategy = L.pytorch.strategies.ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=1)
        rec = fit(lambda: _FSDP2Llama(**config), strategy, data, batch=batch, steps=steps, accelerator=accelerator,
                  precision="bf16-mixed")[0]  # fmt: skip
        return rec.step_s

    # zero1 / zero2 against Lightning's ddp (issue 19's pair): at world 1 no collective moves data, so the ratio is
    # what the engine adds per step (its hooks, copies and optimizer on masters) on a GPU.
    return {
        "zero3": ours("zero3"), "tp": ours("tp"), "pipe": ours("pipe"), "lightning_model_parallel": lightning_mps,
        "hand_fsdp2": lambda data, batch, steps: hand_fsdp2(config, data, batch, steps, accelerator),
        "zero1": ours("zero1"), "zero2": ours("zero2"), "ddp": ours("ddp"),
    }  # fmt: skip


def _released(run: Callable[..., list[float]]) -> Callable[..., list[float]]:
    # Each run's model, optimizer and trainer are garbage once it returns; the next 1 B model needs their memory.
    def wrapped(*args: Any) -> list[float]:
        try:
            return run(*args)
        finally:
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    return wrapped


def throughput(accelerator: str, smoke: bool, rounds: int) -> dict[str, Any]:
    """Section (2): step time and MFU of a ~1 B Llama (bf16-mixed, sequence 2048) per layout and baseline.

    Attention is held to SDPA's flash kernel (`sdpa_kernel`): a layout that made it fall back to another kernel
    would fail here rather than be timed slower.
    """
    config = LLAMA_SMOKE if smoke else LLAMA_1B
    batch, warmup, timed = (2, 1, 2) if smoke else (4, 3, 8)
    data = tokens(batch * (warmup + timed), config["max_seq_len"], config["vocab_size"])
    variants = {k: _released(v) for k, v in _variants(config, accelerator).items()}
    per_round: dict[str, list[float]] = {k: [] for k in variants}
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        for r in range(rounds):
            for name in variants if r % 2 == 0 else reversed(list(variants)):
                per_round[name].append(statistics.median(variants[name](data, batch, warmup + timed)[warmup:]))
    with torch.device("meta"):
        n_params = sum(p.numel() for p in Llama(**config).parameters())
    tokens_per_step = batch * config["max_seq_len"]
    peak = peak_flops_for(torch.cuda.get_device_name(), "bf16-mixed") if accelerator == "cuda" else None
    rows = []
    for name, times in per_round.items():
        step = statistics.median(times)
        achieved = flops_per_token(config, n_params) * tokens_per_step / step
        row: dict[str, Any] = {"variant": name, "step_s": step, "tflops": achieved / 1e12,
                               "mfu": achieved / peak if peak else None}  # fmt: skip
        for base in ("hand_fsdp2", "lightning_model_parallel", "ddp"):
            ratios = [a / b for a, b in zip(times, per_round[base])]
            row[f"ratio_vs_{base}"] = statistics.median(ratios)
            row[f"ratio_vs_{base}_range"] = [min(ratios), max(ratios)]
        rows.append(row)
    return {"params": n_params, "tokens_per_step": tokens_per_step, "batch": batch, "seq": config["max_seq_len"],
            "rounds": rounds, "timed_steps": timed, "peak_flops": peak, "rows": rows}  # fmt: skip


def _peak_memory(device: torch.device) -> Optional[int]:
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None


def offload(accelerator: str, smoke: bool) -> list[dict[str, Any]]:
    """Section (5): step time and peak device memory of zero3 with parameter/optimizer or activation offload (every
    block, the first half), and with full recomputation instead."""
    config = LLAMA_SMOKE if smoke else {**LLAMA_1B, "n_layers": 8}
    batch, warmup, timed = (2, 1, 2) if smoke else (2, 1, 3)
    data = tokens(batch * (warmup + timed), config["max_seq_len"], config["vocab_size"])
    device = torch.device(accelerator)
    rows = []
    half = {"activation_checkpointing": "offload", "offload_blocks": config["n_layers"] // 2}
    for name, kwargs in (("zero3", {}), ("zero3_offload", {"offload": True}),
                         ("zero3 + activation offload", {"activation_checkpointing": "offload"}),
                         ("zero3 + activation offload, first half", half),
                         ("zero3 + full recomputation", {"activation_checkpointing": "full"})):  # fmt: skip
        held = 0  # what earlier fits in this process still hold: the peak counts from there
        if device.type == "cuda":
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            held = torch.cuda.memory_allocated(device)
        strategy = lightning_par.ParallelStrategy(zero_stage=3, **kwargs)
        rec = fit(lambda: Llama(**config), strategy, data, batch=batch, steps=warmup + timed, accelerator=accelerator,
                  precision="bf16-mixed")[0]  # fmt: skip
        step = statistics.median(rec.step_s[warmup:])
        peak = _peak_memory(device)
        rows.append({"variant": name, "step_s": step, "peak_bytes": None if peak is None else peak - held,
                     "held_before": held})  # fmt: skip
        del strategy, rec  # a kept strategy holds what it built (for a later trainer.test): the next fit's baseline
    for row in rows:
        row["step_ratio"] = row["step_s"] / rows[0]["step_s"]
        row["memory_ratio"] = row["peak_bytes"] / rows[0]["peak_bytes"] if rows[0]["peak_bytes"] else None
    return rows


class _SaveTimer(L.Callback):
    """Saves after the chosen steps; times the call, plus the staging fence the next optimizer step waits on."""

    def __init__(self, folder: Path, steps: list[int]) -> None:
        self.folder, self.steps = folder, steps
        self.blocked: list[float] = []
        self.expected: dict[str, torch.Tensor] = {}  # the weights at the last save, taken before it (untimed)
        self._fence = False

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
        if trainer.global_step in self.steps:
            if trainer.global_step == self.steps[-1]:
                self.expected = full_params(pl_module)
            # Untimed: the previous save's write finishes first, as it does in a run that saves every few hundred
            # steps. Saves two steps apart would time the wait for that write (one save in flight at a time).
            if self.blocked and hasattr(trainer.strategy, "wait_for_checkpoint"):
                trainer.strategy.wait_for_checkpoint()
            _sync(pl_module.device)
            t0 = time.perf_counter()
            trainer.save_checkpoint(self.folder / f"step={trainer.global_step}.ckpt")
            self.blocked.append(time.perf_counter() - t0)
            self._fence = True

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        if self._fence:  # what the optimizer's pre-hook would wait for, timed here (then it finds nothing to wait)
            t0 = time.perf_counter()
            trainer.strategy.wait_for_staging()
            self.blocked[-1] += time.perf_counter() - t0
            self._fence = False


def async_save(accelerator: str, smoke: bool) -> dict[str, Any]:
    """Section (4): time a save holds training, asynchronous vs synchronous (zero2, ~200 M parameters on a GPU)."""
    config = LLAMA_SMOKE if smoke else dict(LLAMA_1B, dim=1024, n_layers=12, ffn_hidden=2816, max_seq_len=1024)
    batch, steps, saves = 2, 6, [2, 4]
    data = tokens(batch * steps, config["max_seq_len"], config["vocab_size"])
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for mode in ("sync", "async"):
            folder = Path(tmp) / mode
            timer = _SaveTimer(folder, saves)
            strategy = lightning_par.ParallelStrategy(zero_stage=2, async_save=mode == "async")
            fit(lambda: Llama(**config), strategy, data, batch=batch, steps=steps,
                                accelerator=accelerator, precision="bf16-mixed", callbacks=[timer])  # fmt: skip
            out[mode] = timer.blocked
            # The asynchronous checkpoint holds the weights of its save's moment, not of the steps that followed.
            saved = load_full_state(folder / f"step={saves[-1]}.ckpt")["state_dict"]
            out[f"{mode}_holds_save_time_values"] = all(torch.equal(saved[k], v) for k, v in timer.expected.items())
    out["ratio"] = statistics.median(out["async"]) / statistics.median(out["sync"])
    return out
