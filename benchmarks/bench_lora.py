"""LoRA against full fine-tuning of the same model: per-rank memory and step time under `zero3` and `tp`.

Launch (2 ranks, one thread each):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_lora.py [--quick]

The model is a Hugging Face Llama built from a config (`lightning_par.models.HFCausalLM`; hidden 256, 4 layers, 8
heads, 4 key/value heads, MLP 688, vocabulary 256: 3.0 M parameters), trained with AdamW either whole (``full``)
or through peft's LoRA (``lora``: r 16 on all seven attention and MLP projections, the base frozen), under `zero3`
and under `tp`. Every configuration runs once per round with a fresh Trainer, ABBA order. Reported per layout: the
median step time of both and their ratio, and this rank's bytes of parameters, gradients and optimizer state
(`ParallelismMonitor`'s ``mem/*``, rank 0), with, under `zero3`, the gradient and optimizer bytes the adapters
alone should hold (half of each trainable tensor per rank: 4 and 8 bytes a trainable parameter for fp32 gradients
and AdamW's two states). A hand-run benchmark: results in docs/benchmarks.md ("LoRA against full fine-tuning").
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import tempfile
import time
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
from _rounds import StepTimer, finish  # noqa: E402

import lightning_par  # noqa: E402, F401  (registers the strategy names)
from lightning_par.callbacks import ParallelismMonitor  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import HFCausalLM  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
LAYOUTS = ("zero3", "tp")


def _config(folder: str, quick: bool) -> str:
    from transformers import LlamaConfig

    small = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=176) if quick else {}
    config = LlamaConfig(**{"vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
                            "num_key_value_heads": 4, "intermediate_size": 688, "max_position_embeddings": 256,
                            **small})  # fmt: skip
    if dist.get_rank() == 0:
        config.save_pretrained(folder)
    dist.barrier()
    return folder


def run_once(name: str, folder: str, args: argparse.Namespace) -> tuple[float, dict[str, float], int]:
    """One fit: rank 0's median step (end to end), its memory metrics, and the trainable parameter count."""
    layout, kind = name.split("_")
    L.seed_everything(0, verbose=False)
    lora = {"r": 16, "lora_alpha": 32, "lora_dropout": 0.0, "target_modules": PROJECTIONS} if kind == "lora" else None
    model = HFCausalLM(config=folder, lr=1e-3, lora=lora)
    steps = args.warmup + args.steps
    world = dist.get_world_size()
    dp = world if layout == "zero3" else 1
    data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, num_samples=steps * args.batch * dp)
    timer, monitor = StepTimer(args.warmup), ParallelismMonitor(log_every_n_steps=1)
    trainer = L.Trainer(
        accelerator="cpu", devices=world, strategy=layout, max_steps=steps, logger=False, enable_checkpointing=False,
        log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=0,
        callbacks=[timer, monitor],
    )  # fmt: skip
    trainer.fit(model, datamodule=data)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)  # a DTensor counts its whole tensor
    mem = {k: float(v) for k, v in (monitor.last_metrics or {}).items() if k.startswith("mem/")}
    return statistics.median(timer.cycles), mem, trainable


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 1 round, 2 timed steps")
    parser.add_argument("--rounds", type=int, default=4, help="even, so ABBA order balances")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.quick:
        args.rounds, args.warmup, args.steps, args.seq = 1, 1, 2, 32
    dist.init_process_group("gloo")
    folder = _config(tempfile.mkdtemp(prefix="bench_lora_") if dist.get_rank() == 0 else "", args.quick)
    shared: list[Any] = [folder]
    dist.broadcast_object_list(shared)
    folder = shared[0]
    order = [f"{layout}_{kind}" for layout in LAYOUTS for kind in ("full", "lora")]
    times: dict[str, list[float]] = {n: [] for n in order}
    mem: dict[str, dict[str, float]] = {}
    trainable: dict[str, int] = {}
    load, start = os.getloadavg()[0], time.perf_counter()
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            step, mem[name], trainable[name] = run_once(name, folder, args)
            times[name].append(step)
    lines = [
        f"Llama from a config ({'quick' if args.quick else 'hidden 256, 4 layers'}), seq {args.seq}, per-rank batch "
        f"{args.batch}, AdamW, {dist.get_world_size()} ranks; {args.rounds} rounds x {args.steps} steps; "
        f"{time.perf_counter() - start:.0f} s; 1-min load {load:.1f} before, {os.getloadavg()[0]:.1f} after",
        "| layout | ms/step full | ms/step LoRA | LoRA / full | params KiB full / LoRA | grads KiB full / LoRA | "
        "optimizer KiB full / LoRA | trainable parameters full / LoRA |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for layout in LAYOUTS:
        f, lo = f"{layout}_full", f"{layout}_lora"
        a, b = statistics.median(times[f]), statistics.median(times[lo])
        kib = {k: (mem[f].get(f"mem/{k}_bytes", 0) / 1024, mem[lo].get(f"mem/{k}_bytes", 0) / 1024)
               for k in ("params", "grads", "optim_state")}  # fmt: skip
        pairs = " | ".join(f"{kib[k][0]:.0f} / {kib[k][1]:.0f}" for k in ("params", "grads", "optim_state"))
        lines.append(f"| {layout} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.3f} | {pairs} | {trainable[f]} / "
                     f"{trainable[lo]} |")  # fmt: skip
    n = trainable["zero3_lora"]
    lines.append(f"zero3 LoRA, formula (adapters only, half per rank): grads {4 * n / 2 / 1024:.0f} KiB, optimizer "
                 f"{8 * n / 2 / 1024:.0f} KiB")  # fmt: skip
    finish(lines)


if __name__ == "__main__":
    main()
