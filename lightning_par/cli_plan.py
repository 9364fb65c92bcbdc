"""``lightning-par estimate`` and ``lightning-par plan``: the planner on the command line.

``lightning-par estimate --model-config config.json --gpu H100 --tp 8 --pp 4 --dp 2 ...`` predicts one layout;
``lightning-par plan --model-config config.json --gpu H100 --nodes 4 --global-batch-size 512 --seq-len 4096`` ranks
every layout that fits and prints how to run the best. The model comes from a Hugging Face ``config.json``
(``--model-config``) or from a recipe's own model (``--config RECIPE``: built on the meta device, read by the same
introspection the strategies use). ``lightning-par plan --config RECIPE`` without ``--gpu`` prints the recipe's
tensor-parallel plan, as it always did.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from typing import Any, Optional

from lightning_par.axes import MODEL_AXES
from lightning_par.planner import ModelDesc, device, from_hf_config
from lightning_par.planner.devices import Device
from lightning_par.planner.estimate import Estimate, estimate
from lightning_par.planner.layout import PRECISIONS, RECOMPUTE, SCHEDULES, Layout
from lightning_par.planner.params import ParamSpec
from lightning_par.planner.search import candidates, format_ranking, rank_layouts


def _model_args(p: argparse.ArgumentParser) -> None:
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model-config", help="a Hugging Face config.json (or the folder holding it)")
    src.add_argument("--config", help="a recipe: its model is built on the meta device and read")
    p.add_argument("--gpu", required=True, help="a known GPU (e.g. A100, H100, H200, B200); an unknown one lists them")
    p.add_argument("--gpus-per-node", type=int, help="GPUs per node (default: the GPU's common node, 8)")
    p.add_argument("--global-batch-size", type=int, required=True)
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--precision", default="bf16-mixed", choices=PRECISIONS)
    p.add_argument(
        "--profile",
        default="torch",
        choices=("torch", "megatron"),
        help="kernels and state layout priced: this suite (torch) or Megatron-LM's, for published runs",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def estimate_parser() -> argparse.ArgumentParser:
    """The options of ``lightning-par estimate`` (exactly those of issue 17, plus --profile, --schedule,
    --powersgd-rank, --zero-quantized-weights and --fp8)."""
    p = argparse.ArgumentParser(prog="lightning-par estimate", description="Predict memory and step time of a layout.")
    _model_args(p)
    for name in (*MODEL_AXES, "vpp", "dp"):
        p.add_argument(f"--{name}", type=int, default=1)
    p.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3), help="ZeRO stage over the dp ranks")
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--recompute", default="none", choices=RECOMPUTE)
    p.add_argument("--offload-blocks", type=int, default=None, help="with --recompute offload: the first N blocks")
    p.add_argument("--sequence-parallel", action="store_true")
    p.add_argument("--schedule", default=None, choices=sorted(SCHEDULES),
                   help="pipeline schedule (default: 1f1b, interleaved_1f1b when --vpp > 1)")  # fmt: skip
    p.add_argument("--powersgd-rank", type=int, default=0,
                   help="price PowerSGD gradient compression at this rank (ZeRO 0-1; 0: exact)")  # fmt: skip
    p.add_argument("--zero-quantized-weights", action="store_true",
                   help="price ZeRO-3's weight all-gather in int8 with block scales (ZeRO++'s qwZ)")  # fmt: skip
    p.add_argument("--fp8", action="store_true",
                   help="price fp8 training of the blocks' projections (GEMMs, casts, ZeRO-3 gathers)")  # fmt: skip
    return p


def plan_parser() -> argparse.ArgumentParser:
    """The options of ``lightning-par plan`` with ``--gpu`` (the planner's ranking)."""
    p = argparse.ArgumentParser(prog="lightning-par plan", description="Rank every layout that fits by step time.")
    _model_args(p)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--top", type=int, default=10, help="layouts to print")
    return p


def _model(args: argparse.Namespace) -> tuple[ModelDesc, Optional[Sequence[ParamSpec]]]:
    if args.model_config:
        return from_hf_config(args.model_config), None
    from lightning_par.cli_recipe import _built, build_cli  # Lightning only for recipes
    from lightning_par.planner.introspect import desc_from_module
    from lightning_par.planner.params import specs_from_module

    model = _built(build_cli(["--config", args.config], run=False).model)
    return desc_from_module(model), specs_from_module(model)


def _device(args: argparse.Namespace) -> Device:
    dev = device(args.gpu)
    return dataclasses.replace(dev, gpus_per_node=args.gpus_per_node) if args.gpus_per_node else dev


def run_estimate(argv: Sequence[str]) -> str:
    """``lightning-par estimate``: the prediction as text, or JSON with ``--json``."""
    args = estimate_parser().parse_args(list(argv))
    desc, specs = _model(args)
    schedule = args.schedule or ("interleaved_1f1b" if args.vpp > 1 else "1f1b")
    dp = args.dp
    if dp % args.ep:
        raise SystemExit(f"--ep {args.ep} is carved out of the data-parallel ranks, so it must divide --dp {dp}")
    m = args.global_batch_size // (dp * args.micro_batch_size) if dp * args.micro_batch_size else 0
    layout = Layout(
        **{axis: getattr(args, axis) for axis in MODEL_AXES}, vpp=args.vpp, dp_shard=dp, zero_stage=args.zero,
        pp_schedule=schedule, microbatches=m if args.pp > 1 else None, micro_batch_size=args.micro_batch_size,
        recompute=args.recompute, offload_blocks=args.offload_blocks, sequence_parallel=args.sequence_parallel,
        precision=args.precision,
        powersgd_rank=args.powersgd_rank, zero_quantized_weights=args.zero_quantized_weights, fp8=args.fp8,
    )  # fmt: skip
    est = estimate(desc, layout, _device(args), args.global_batch_size, args.seq_len, args.profile, specs)
    return json.dumps(est.as_dict(), indent=2) if args.json else format_estimate(est)


def format_estimate(est: Estimate) -> str:
    """Human-readable lines of one estimate."""
    d = est.as_dict()
    mem = ", ".join(f"{k} {v:.2f}" for k, v in d["memory_gib"].items() if v or k != "double_buffer")  # 2bw only
    parts = ", ".join(f"{k} {v:.4g}" for k, v in d["step_time_parts_s"].items())
    return "\n".join([
        f"layout: {d['layout']}",
        f"step time: {d['step_time_s']:.4g} s ({parts})",
        f"throughput: {d['tflops_per_gpu']:.1f} TFLOP/s per GPU, MFU {d['mfu']:.1%}",
        f"memory per GPU (GiB): {mem}",
    ])  # fmt: skip


def strategy_yaml(layout: Layout, nodes: int, gpus_per_node: int, global_batch: int) -> str:
    """The recipe lines that run ``layout``: the ``trainer:`` section, and the per-rank batch size as a comment
    (where the data loader takes it differs between data modules)."""
    args = "\n".join(f"      {k}: {json.dumps(v)}" for k, v in layout.strategy_kwargs().items())
    m = layout.m(global_batch)
    per_rank = layout.micro_batch_size * (m if layout.pp > 1 else 1)
    accumulate = f"  accumulate_grad_batches: {m}\n" if layout.pp == 1 and m > 1 else ""
    return (f"# data: batch_size {per_rank} per data-parallel rank\ntrainer:\n  num_nodes: {nodes}\n"
            f"  devices: {gpus_per_node}\n  precision: {layout.precision}\n{accumulate}"
            f"  strategy:\n    class_path: lightning_par.ParallelStrategy\n    init_args:\n{args}")  # fmt: skip


def run_plan(argv: Sequence[str]) -> str:
    """``lightning-par plan --gpu ...``: the ranking, the reasons of the infeasible layouts, and the best's recipe."""
    args = plan_parser().parse_args(list(argv))
    desc, specs = _model(args)
    dev = _device(args)
    world = args.nodes * dev.gpus_per_node
    pool = candidates(desc, world, dev.gpus_per_node, global_batch=args.global_batch_size, precision=args.precision)
    ranking = rank_layouts(desc, dev, pool, args.seq_len, args.profile, specs)
    if args.json:
        out: dict[str, Any] = {
            "feasible": [e.as_dict() for e in ranking.feasible[: args.top]],
            "n_feasible": len(ranking.feasible), "infeasible": ranking.reasons(),
        }  # fmt: skip
        return json.dumps(out, indent=2)
    text = [f"{desc.total_params / 1e9:.3g}B parameters on {args.nodes} x {dev.gpus_per_node} {dev.name}, global batch "
            f"{args.global_batch_size} x {args.seq_len} tokens", format_ranking(ranking, args.top)]  # fmt: skip
    if ranking.feasible:
        best = ranking.feasible[0].layout
        launch = f"torchrun --nnodes {args.nodes} --nproc-per-node {dev.gpus_per_node} -m lightning_par.cli fit"
        recipe = args.config or "RECIPE.yaml"
        text += [f"\nrun the best: {launch} --config {recipe} --config best.yaml  (best.yaml:)",
                 strategy_yaml(best, args.nodes, dev.gpus_per_node, args.global_batch_size)]  # fmt: skip
    return "\n".join(text)
