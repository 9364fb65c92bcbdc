"""Tensor parallelism: communication per layer counted against Megatron's formula, and step time against a
hand-written plan under Lightning's ModelParallelStrategy.

Launch (2 ranks = tp 2, one thread each):

    OMP_NUM_THREADS=1 torchrun --standalone --nproc-per-node 2 benchmarks/bench_tensor_parallel.py [--quick]

1. Bytes. One forward + backward of the GPT (fused qkv) and the Llama (GQA) after `apply_tensor_parallel`, with
   every functional collective DTensor issues counted by a dispatch mode (the collectives run on local tensors,
   under DTensor). Megatron-LM (arXiv 1909.08053, section 3) needs per layer 2 all-reduces of b*s*h forward and 2
   backward; with sequence parallelism (arXiv 2205.05198, section 4.2.2) each becomes a reduce-scatter plus an
   all-gather, the same bytes. On a ring of n ranks an all-reduce of B bytes moves 2B(n-1)/n per rank, a
   reduce-scatter or all-gather B(n-1)/n. So theory per layer per step = 8 B (n-1)/n with B = b*s*h*4 bytes. The
   sequence split at the trunk's ends adds one all-gather each way (2 B (n-1)/n per step, not per layer), and the
   replicated norm weights on sequence shards add small gradient all-reduces; both are reported apart.
2. Time. ``strategy="tp"`` on our Llama against ``ModelParallelStrategy(tensor_parallel_size=2)`` with the
   Llama parallelized by hand in ``configure_model`` in the torchtitan way (the same choices as ours: sequence
   parallel, embedding and head replicated), alternated ABBA in one process group.
"""

from __future__ import annotations

import argparse
import copy
import logging
import os
import statistics
import time
from collections import defaultdict
from typing import Any

import torch

torch.set_num_threads(1)

import torch.distributed as dist  # noqa: E402
from bench_zero_vs_lightning import run_once  # noqa: E402
from lightning.pytorch.strategies import ModelParallelStrategy  # noqa: E402
from torch.distributed.device_mesh import init_device_mesh  # noqa: E402
from torch.distributed.tensor import DTensor, Replicate, Shard  # noqa: E402
from torch.distributed.tensor.parallel import (  # noqa: E402
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

import lightning_par  # noqa: E402, F401  (registers "tp")
from lightning_par import _compat  # noqa: E402
from lightning_par.models import GPT, Llama  # noqa: E402
from lightning_par.parallel.tensor import infer_tp_plan  # noqa: E402
from lightning_par.parallel.tensor.apply import apply_tensor_parallel  # noqa: E402
from lightning_par.utils import clean_exit  # noqa: E402

_RING = {"all_reduce": 2.0, "reduce_scatter_tensor": 1.0, "all_gather_into_tensor": 1.0}


class CommCounter(_compat.TorchDispatchMode):
    """Sums the wire bytes per rank of every functional collective (what DTensor redistribution calls)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.calls: list[tuple[str, float]] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = _compat.op_name(func)
        kind = name.split("::")[-1]
        if name.startswith(f"{_compat.C10D_FUNCTIONAL}::") and kind in _RING:  # not wait_tensor and friends
            t = args[0]
            payload = t.numel() * t.element_size() * (self.n if kind == "all_gather_into_tensor" else 1)
            self.calls.append((kind, _RING[kind] * payload * (self.n - 1) / self.n))
        return func(*args, **(kwargs or {}))


def count_bytes(make: Any, b: int, s: int, layers: int, n: int) -> dict[str, float]:
    """One forward + backward under tp=n; bytes split into activation traffic and the rest."""
    torch.manual_seed(0)
    model = make()
    h = model.hidden_size
    mesh = init_device_mesh("cpu", (n,), mesh_dim_names=("tp",))
    apply_tensor_parallel(model, mesh, infer_tp_plan(model), sequence_parallel=True)
    idx = torch.randint(0, 256, (b, s))
    counter = CommCounter(n)
    with counter:
        loss = torch.nn.functional.cross_entropy(model(idx).flatten(0, 1), idx.flatten())
        loss.backward()
        for p in model.parameters():  # the reduction the strategy does for replicated weights on sequence shards
            g = p.grad
            if isinstance(g, DTensor) and any(pl.is_partial() for pl in g.placements):
                p.grad = g.redistribute(g.device_mesh, [Replicate()])
    big = 4 * b * s * h  # B: one activation of the residual stream, fp32
    act = sum(x for _, x in counter.calls if x >= big * (n - 1) / n / 2)
    rest = sum(x for _, x in counter.calls if x < big * (n - 1) / n / 2)
    theory_layers = layers * 8 * big * (n - 1) / n
    ends = 2 * big * (n - 1) / n
    kinds: dict[str, int] = defaultdict(int)
    for k, _ in counter.calls:
        kinds[k] += 1
    return {"measured": act, "theory": theory_layers + ends, "per_layer": (act - ends) / layers,
            "per_layer_theory": theory_layers / layers, "rest": rest, "calls": dict(kinds)}  # fmt: skip


class HandTPLlama(Llama):
    """Our Llama with a hand-written tensor-parallel plan, the way Lightning documents TP (torchtitan's styles)."""

    def configure_model(self) -> None:
        assert self.device_mesh is not None
        tp = self.device_mesh["tensor_parallel"]
        for i, layer in enumerate(self.layers):
            plan: dict[str, Any] = {
                "attention_norm": SequenceParallel(use_local_output=True),
                "attention": PrepareModuleInput(
                    input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)
                ),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(use_local_output=True),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
                "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            }  # fmt: skip
            if i == 0:  # enter the sequence-parallel region: keep this rank's slice of the sequence
                plan[""] = PrepareModuleInput(
                    input_layouts=(Replicate(), None), desired_input_layouts=(Shard(1), None), use_local_output=True
                )
            parallelize_module(layer, tp, plan)
            if i == len(self.layers) - 1:  # leave it: gather the sequence for the replicated final norm and head
                parallelize_module(
                    layer, tp, PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate())
                )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: tiny model, 2 rounds, 2 timed steps")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="batch (every tp rank sees the same one)")
    args = parser.parse_args()
    for name in ("lightning.pytorch", "lightning.fabric", "lightning_par"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.quick:
        args.rounds, args.warmup, args.steps, args.layers, args.dim, args.seq = 2, 1, 2, 2, 64, 32
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = dist.get_rank()

    gpt = dict(vocab_size=256, block_size=args.seq, n_layer=args.layers, n_head=4, n_embd=args.dim)
    llama = dict(vocab_size=256, max_seq_len=args.seq, dim=args.dim, n_layers=args.layers, n_heads=4, n_kv_heads=2,
                 ffn_hidden=3 * args.dim)  # fmt: skip
    counts = {
        "GPT (fused qkv)": count_bytes(lambda: GPT(**gpt), args.batch, args.seq, args.layers, world),
        "Llama (GQA, SwiGLU)": count_bytes(lambda: Llama(**llama), args.batch, args.seq, args.layers, world),
    }

    configs = {
        "tp": lambda: ("tp", Llama(**llama)),
        "hand_plan": lambda: (ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=world),
                              HandTPLlama(**llama)),
    }  # fmt: skip
    order = list(configs)
    medians: dict[str, list[float]] = {k: [] for k in configs}
    run_args = copy.copy(args)
    run_args.batch = args.batch
    start = time.perf_counter()
    for r in range(args.rounds):
        for name in order if r % 2 == 0 else order[::-1]:
            medians[name].append(run_once(name, configs[name], run_args)[0])
    elapsed = time.perf_counter() - start
    if rank == 0:
        print(f"\ntp={world}, batch {args.batch} x seq {args.seq}, {args.layers} layers, width {args.dim}\n")
        print("| model | activation bytes/layer/step measured | theory 8BΔ | ratio | whole step measured / theory "
              "| other bytes (norm-weight grads) | collective calls |")  # fmt: skip
        print("|---|---|---|---|---|---|---|")
        for name, c in counts.items():
            print(f"| {name} | {c['per_layer']:.0f} | {c['per_layer_theory']:.0f} | "
                  f"{c['per_layer'] / c['per_layer_theory']:.4f} | {c['measured'] / c['theory']:.4f} | "
                  f"{c['rest']:.0f} | {c['calls']} |")  # fmt: skip
        a, b = statistics.median(medians["tp"]), statistics.median(medians["hand_plan"])
        rounds = [x / y for x, y in zip(medians["tp"], medians["hand_plan"])]
        print(f"\nstep time: tp {a * 1e3:.1f} ms, hand plan (ModelParallelStrategy) {b * 1e3:.1f} ms, "
              f"ratio {a / b:.3f}; "
              f"per-round ratios median {statistics.median(rounds):.3f} [{min(rounds):.3f}, {max(rounds):.3f}]; "
              f"{args.rounds} rounds in {elapsed:.0f} s")  # fmt: skip
    clean_exit()


if __name__ == "__main__":
    main()
