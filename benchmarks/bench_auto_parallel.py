"""Does ``auto_parallel`` pick the layout that is fastest when measured? Predicted against measured time per sample.

Launch (4 ranks on this machine's CPU cores, one thread each):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 4 benchmarks/bench_auto_parallel.py [--quick]

For two Hugging Face models built from configs (a Llama and a GPT-2), ``Trainer(strategy="auto_parallel")`` plans
once (its ranking uses this CPU job's measured rates, `lightning_par.strategies._auto_device`); then the planner's
top four layouts and the usual families (DDP-like ``zero0``, ``zero3``, ``tp=2`` x dp 2, ``pp=2`` x dp 2) are each
trained with `lightning_par.ParallelStrategy` in alternated rounds (the order reverses every round), and their
median step times are divided by the samples each step trains (the per-rank batch is the data loader's, so the
global batch is that times the data-parallel degree). A hand-run benchmark: it asserts nothing about time.
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
from typing import Any

import torch

torch.set_num_threads(1)

import lightning as L  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from _rounds import StepTimer  # noqa: E402

import lightning_par  # noqa: E402
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.planner.layout import Layout  # noqa: E402
from lightning_par.strategies.auto import AutoParallelStrategy  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402


class HFCausalLM(L.LightningModule):
    """A Hugging Face causal LM built from a config (no download), trained on byte tokens with AdamW."""

    def __init__(self, kind: str, hidden: int, layers: int, seq: int) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

        if kind == "llama":
            self.model = LlamaForCausalLM(LlamaConfig(
                vocab_size=256, hidden_size=hidden, intermediate_size=hidden * 8 // 3, num_hidden_layers=layers,
                num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=seq))  # fmt: skip
        else:
            self.model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_embd=hidden, n_layer=layers, n_head=8,
                                                    n_positions=seq))  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(input_ids=x).logits.flatten(0, 1).float(), y.flatten())

    def configure_optimizers(self) -> Any:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def fit(strategy: Any, args: argparse.Namespace, kind: str, steps: int, timer: L.Callback | None = None) -> Any:
    L.seed_everything(0, verbose=False)
    world = dist.get_world_size()
    data = ByteTextDataModule(seq_len=args.seq, batch_size=args.batch, num_samples=steps * args.batch * world)
    trainer = L.Trainer(accelerator="cpu", devices=world, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, limit_val_batches=0, callbacks=[timer] if timer else [])  # fmt: skip
    trainer.fit(HFCausalLM(kind, args.hidden, args.layers, args.seq), datamodule=data)
    return trainer.strategy


def families(world: int) -> list[Layout]:
    half = world // 2
    return [Layout(dp_shard=world, precision="32-true"), Layout(dp_shard=world, zero_stage=3, precision="32-true"),
            Layout(tp=2, dp_shard=half, sequence_parallel=True, precision="32-true"),
            Layout(pp=2, dp_shard=half, precision="32-true")]  # fmt: skip


def bench(kind: str, args: argparse.Namespace) -> list[str]:
    auto = fit(AutoParallelStrategy(), args, kind, steps=1)
    assert isinstance(auto, AutoParallelStrategy) and auto.ranking is not None
    predicted = {e.layout: e for e in auto.ranking.feasible}
    pool: list[Layout] = []
    for layout in [e.layout for e in auto.ranking.feasible[:4]] + families(dist.get_world_size()):
        match = next((p for p in predicted if _same(p, layout)), None)
        if match is not None and match not in pool:
            pool.append(match)
    times: dict[Layout, list[float]] = {layout: [] for layout in pool}
    for r in range(args.rounds):
        for layout in pool if r % 2 == 0 else pool[::-1]:
            timer = StepTimer(args.warmup)
            kwargs = layout.strategy_kwargs()
            if layout.pp > 1:
                kwargs["microbatches"] = args.batch // layout.micro_batch_size
            fit(lightning_par.ParallelStrategy(**kwargs), args, kind, args.warmup + args.steps, timer)
            times[layout].append(statistics.median(timer.times))
    per_sample = {lay: statistics.median(t) / (args.batch * lay.dp) for lay, t in times.items()}
    measured_best = min(per_sample, key=per_sample.__getitem__)
    lines = [f"\n{kind}: hidden {args.hidden}, {args.layers} layers, seq {args.seq}, per-rank batch {args.batch}; "
             f"auto_parallel chose {auto.chosen.describe() if auto.chosen else None}",
             "| layout | predicted ms/step | predicted us/sample | measured ms/step | measured us/sample | "
             "rounds' range (ms/step) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for lay in sorted(pool, key=per_sample.__getitem__):
        step = predicted[lay].time.total
        lines.append(f"| {lay.describe()} | {step * 1e3:.1f} | {step / (args.batch * lay.dp) * 1e6:.0f} "
                     f"| {statistics.median(times[lay]) * 1e3:.1f} | {per_sample[lay] * 1e6:.0f} "
                     f"| {min(times[lay]) * 1e3:.0f}-{max(times[lay]) * 1e3:.0f} |")  # fmt: skip
    chosen = next((lay for lay in pool if auto.chosen is not None and _same(lay, auto.chosen)), None)
    gap = per_sample[chosen] / per_sample[measured_best] - 1 if chosen is not None else float("nan")
    verdict = "IS" if chosen == measured_best else "is NOT"
    lines.append(f"measured fastest: {measured_best.describe()}; auto_parallel's pick {verdict} it "
                 f"(pick measured {gap:+.1%} per sample)")  # fmt: skip
    return lines


def _same(a: Layout, b: Layout) -> bool:
    keys = ("tp", "pp", "dp_replicate", "dp_shard", "zero_stage", "ep", "cp", "recompute", "vpp", "pp_schedule")
    return all(getattr(a, k) == getattr(b, k) for k in keys) and (
        a.pp == 1 or a.micro_batch_size == b.micro_batch_size or b.microbatches is None
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: 1 round, 2 timed steps")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="per-rank batch")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.quick:
        args.rounds, args.warmup, args.steps = 1, 1, 2
    dist.init_process_group("gloo")
    load = os.getloadavg()[0]
    lines = [line for kind in ("llama", "gpt2") for line in bench(kind, args)]
    if dist.get_rank() == 0:
        print(f"1-min load average before: {load:.1f}, after: {os.getloadavg()[0]:.1f}")
        print("\n".join(lines), flush=True)
    clean_exit()


if __name__ == "__main__":
    main()
