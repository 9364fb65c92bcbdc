"""fp8 training in the planner (`Layout.fp8`): which weights are fp8, and what their GEMMs and casts cost.

- Which weights: `mark_fp8`. From a live model, the strategies' own rule (`lightning_par.parallel.fp8.select_fp8`);
  from a `ModelDesc` (a config, no module), the trunk's 2-D weights that are no router, expert or norm, with both
  dimensions multiples of 16: the projections of a decoder whose projections are ``nn.Linear`` (GPT-2's
  ``Conv1D`` are not converted by the strategies: price such a model from the module).
- Time: the block's projection GEMMs (q/k/v, output, MLP; not the attention core, routers or experts, which stay in
  the training precision) run at the device's fp8 rate with one-byte operands (`Device.peak_flops["fp8"]`); each
  cast streams its tensor twice in the compute dtype (the largest magnitude, then the cast) and writes one byte
  per element: the input and weight in the forward, the output gradient in the backward, and the backward's
  transposed fp8 operands once more (torchao's tensor-wise recipe, eager; compiled, the casts fuse and cost less).
- Traffic: ZeRO-3 gathers the fp8 weights at one byte per element; their scales, one fp32 per fp8 weight, are
  all-reduced over the data-parallel ranks once per forward (`lightning_par.parallel.fp8.scales`).
- Memory: no persistent state changes (fp32 masters, gradients and optimizer as without fp8); torchao saves the
  same activations as ``nn.Linear`` (its input and weight).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Optional

from torch import nn

from lightning_par.planner.compute import Gemm
from lightning_par.planner.devices import Device
from lightning_par.planner.layout import Layout, LayoutError, compute_bytes
from lightning_par.planner.model import ModelDesc
from lightning_par.planner.params import ParamSpec

FP8_GEMMS = ("qkv", "out", "mlp_in", "mlp_out")  # `compute.block_gemms`' names of the projections fp8 converts
ALIGN = 16


def mark_fp8(specs: Sequence[ParamSpec], module: Optional[nn.Module] = None, tp: int = 1) -> list[ParamSpec]:
    """``specs`` with `ParamSpec.fp8` set on the weights fp8 training converts at tensor-parallel degree ``tp``
    (from ``module`` when given: the strategies' rule; else the rule on the specs, see the module docstring)."""
    if module is not None:
        from lightning_par.blocks.trunk import find_trunk
        from lightning_par.parallel.experts.finder import find_moe_layers
        from lightning_par.parallel.fp8 import select_fp8
        from lightning_par.parallel.tensor.plan import infer_tp_plan

        trunk = find_trunk(module)
        plans = [infer_tp_plan(module)] if tp > 1 else []
        layers = select_fp8(module, trunk, [layer.name for layer in find_moe_layers(module)], plans, tp)
        weights = {f"{name}.weight" for name in layers.converted}
    else:
        weights = {s.name for s in specs if s.block is not None and len(s.shape) == 2 and not s.role
                   and s.expert_axis is None and s.expert is None and not s.shape[0] % ALIGN
                   and not s.shape[1] % ALIGN}  # fmt: skip
    return [dataclasses.replace(s, fp8=s.name in weights) for s in specs]


def check_device(dev: Device) -> None:
    """Refuse pricing fp8 on a device without fp8 matrix multiplication, naming the fix."""
    if "fp8" not in dev.peak_flops:
        raise LayoutError(f"fp8=True: {dev.name} has no fp8 tensor cores (Ada, Hopper and later do); drop fp8")


def cast_seconds(gemms: Sequence[Gemm], layout: Layout, dev: Device) -> tuple[float, float]:
    """(forward, backward) seconds of the fp8 casts of one block's converted GEMMs for one micro-batch."""
    el = compute_bytes(layout.precision)
    forward = backward = 0.0
    for g in (g for g in gemms if g.name in FP8_GEMMS):
        operands = (g.m * g.k + g.k * g.n) * g.count
        forward += (2 * el + 1) * operands
        backward += (2 * el + 1) * g.m * g.n * g.count + 2 * operands
    rate = dev.hbm_bytes_per_s * dev.memory_efficiency
    return forward / rate, backward / rate


def fp8_share(desc: ModelDesc) -> float:
    """The fraction of the model's parameters in fp8 weights: each block's projections (the MLP's only when dense:
    experts stay in the training precision)."""
    attention = (2 * desc.heads + 2 * desc.kv_heads) * desc.head_dim * desc.hidden  # q, k, v and the output
    mlp = 0 if desc.experts else (3 if desc.gated_mlp else 2) * desc.hidden * desc.ffn
    return desc.layers * (attention + mlp) / desc.total_params
