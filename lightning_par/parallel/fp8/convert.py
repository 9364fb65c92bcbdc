"""fp8 training of the trunk's linear layers, on torchao's float8 recipe (tensor-wise dynamic scaling).

torchao's `Float8Linear` casts a layer's input, weight and output gradient to fp8 at each call, each with one
scale from its own largest magnitude (e4m3 forward, e5m2 for the gradient), and multiplies in fp8 (``emulate``:
the same casts, multiplied in the input's precision, on a device without fp8 matrix multiplication). Under ZeRO-3
the weights are all-gathered already cast (torchao's ``enable_fsdp_float8_all_gather``): one byte per element on
the wire, the scale from the largest magnitude of the whole weight (an all-reduce of each shard's). Under tensor
parallelism torch's column / row styles hand the layer DTensors, whose largest magnitude is the whole tensor's.

Which layers: the ``nn.Linear``s inside the trunk's blocks whose two dimensions are multiples of 16 (what fp8
matrix multiplication needs). Kept in the training precision, and listed at start-up: the layers outside the
trunk (embedding, head: the head's logits are the most precision-sensitive), MoE layers (router and experts),
layers wrapped by low-rank adapters (a fine-tune trains the adapters, which stay small), weights that are a tensor
subclass already (a 4-bit base), layers tensor parallelism splits with its own code (fused projections cut by
parts, key/value heads shared by ranks), which would skip the fp8 forward, and layers whose weight the model's code
reads outside their forward or whose output it changes in place (one probe forward: `probe`).

What is exact and what is not: one scale per tensor means a layer's scale depends on the tensor it sees. Data
parallelism (and a pipeline's microbatches) gives each rank (microbatch) its own activation and gradient scales,
as one process accumulating gradients over the same sub-batches would; tensor parallelism and ZeRO-3's weight
scales span the whole tensor, as in one process. docs/strategies.md, "fp8 training".
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter
from typing import Any, Optional, Union

import torch
from torch import nn

from lightning_par.blocks.trunk import Trunk
from lightning_par.parallel.fp8.probe import unconvertible
from lightning_par.parallel.tensor.adapters import find_adapters
from lightning_par.parallel.tensor.kv_heads import kv_replicas
from lightning_par.parallel.tensor.plan_affine import affine
from lightning_par.parallel.tensor.plan_types import TPPlan

ALIGN = 16  # fp8 matrix multiplication (cuBLAS's, torch._scaled_mm) needs both dimensions to be multiples of 16
FP8_CAPABILITY = (8, 9)  # Ada and Hopper and later: the first CUDA devices with fp8 tensor cores


class Fp8Error(ValueError):
    """fp8 training cannot run as configured (device, library, combination); the message names the fix."""


@dataclasses.dataclass(frozen=True)
class Fp8Layers:
    """Which linear layers train in fp8 and which stay in the training precision, with the reason.

    Args:
        converted: qualified names of the layers converted to fp8.
        kept: qualified name -> why it stays in the training precision.
    """

    converted: tuple[str, ...]
    kept: dict[str, str]

    def notes(self) -> list[str]:
        """Start-up lines: the fp8 layers and the kept ones, with block indices folded into ``*``."""
        lines = [f"fp8: {len(self.converted)} linear layer(s) in fp8: {folded(self.converted)}"]
        reasons = Counter(self.kept.values())
        for why in sorted(reasons):
            names = [n for n, w in self.kept.items() if w == why]
            lines.append(f"fp8: kept in the training precision ({why}): {folded(names)}")
        return lines


def select_fp8(module: nn.Module, trunk: Optional[Trunk], moe: list[str], plans: list[TPPlan],
               tp: int) -> Fp8Layers:  # fmt: skip
    """The linear layers of ``module`` that train in fp8 (see the module docstring for the rule).

    Args:
        module: the whole model, before any layout is applied.
        trunk: its repeated blocks (``None``: no layer is converted).
        moe: qualified names of its MoE layers (`lightning_par.parallel.experts.finder.find_moe_layers`).
        plans: the tensor-parallel plans (empty without tp).
        tp: the tensor-parallel degree.
    """
    blocks = tuple(dict.fromkeys(trunk.names)) if trunk is not None else ()
    bases = set(find_adapters(module))
    wrapped = {name.rpartition(".")[0] for name in bases}
    own = _own_split(plans, tp)
    converted: list[str] = []
    kept: dict[str, str] = {}
    for name, mod in module.named_modules():
        if not isinstance(mod, nn.Linear):
            if affine(mod) is not None and any(name.startswith(f"{b}.") for b in blocks) and name not in bases:
                kept[name] = "not an nn.Linear (GPT-2's Conv1D: torchao converts nn.Linear)"
            continue
        if name not in bases and any(name.startswith(f"{w}.") for w in wrapped):
            continue  # an adapter's own layers (lora_A, lora_B): they belong to the adapter, and stay as they are
        inside = any(name.startswith(f"{b}.") for b in blocks)
        why = _why_kept(name, mod, inside, moe, wrapped, own)
        if why is None:
            converted.append(name)
        else:
            kept[name] = why
    # What the code around a layer does with it that fp8 would break: one probe forward (fp8/probe.py).
    kept.update(unconvertible(module, converted))
    return Fp8Layers(tuple(n for n in converted if n not in kept), kept)


def convert_fp8(module: nn.Module, layers: Fp8Layers, *, emulate: bool, zero3: bool) -> None:
    """Swap each of ``layers.converted`` for torchao's `Float8Linear` (in place, the same parameters); under ZeRO-3
    its weight is all-gathered in fp8."""
    Float8LinearConfig, convert_to_float8_training = _torchao()
    config = Float8LinearConfig(emulate=emulate, enable_fsdp_float8_all_gather=zero3)
    chosen = set(layers.converted)
    convert_to_float8_training(module, config=config, module_filter_fn=lambda _mod, fqn: fqn in chosen)


def check_fp8_device(mode: Union[bool, str], device: torch.device) -> None:
    """Refuse hardware fp8 (``fp8=True``) where no fp8 matrix multiplication exists, naming ``fp8="emulate"``."""
    if mode == "emulate":
        return
    if device.type != "cuda":
        raise Fp8Error(
            f"fp8=True multiplies in fp8, which {device.type.upper()} cannot: train on a CUDA device of compute "
            "capability >= 8.9 (H100, L4, ...), or use fp8='emulate' (torchao's emulation: the same fp8 casts, "
            "multiplied in the training precision; for checking numerics, slower than no fp8)"
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        raise Fp8Error(
            f"fp8=True needs fp8 tensor cores (compute capability >= 8.9: H100, L4, ...); "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}: use fp8='emulate' to check "
            "numerics, or drop fp8"
        )


def _why_kept(name: str, mod: nn.Linear, inside: bool, moe: list[str], wrapped: set[str],
              own: list[re.Pattern[str]]) -> Optional[str]:  # fmt: skip
    if not inside:
        return "outside the trunk's blocks"
    if any(name == m or name.startswith(f"{m}.") for m in moe):
        return "MoE router or experts"
    if any(name == w or name.startswith(f"{w}.") for w in wrapped):
        return "wrapped by a low-rank adapter"
    if type(mod.weight) not in (torch.Tensor, nn.Parameter) or mod.weight.dtype not in (torch.float32, torch.bfloat16):
        return "weight already quantized or not fp32 / bf16"
    if mod.in_features % ALIGN or mod.out_features % ALIGN:
        return f"a dimension not a multiple of {ALIGN}"
    if any(p.fullmatch(name) for p in own):
        return "split by tensor parallelism's own code (fused parts or shared key/value heads)"
    return None


def _own_split(plans: list[TPPlan], tp: int) -> list[re.Pattern[str]]:
    """Name patterns of the projections tensor parallelism splits with its own code (`parallel/tensor/affine.py`)
    instead of torch's styles: a fused projection of several parts, and the projections holding key/value heads
    shared by several ranks."""
    patterns: list[str] = []
    for plan in (g for p in plans for g in p.group_plans()):
        patterns += [k for k, parts in plan.fused_split.items() if len(parts) > 1]
        for head in plan.heads.values():
            if kv_replicas(head, tp) > 1:
                patterns += list(head.projections[:-1])
    return [re.compile(re.escape(p).replace(r"\*", r"[^.]+")) for p in patterns]


def folded(names: Union[list[str], tuple[str, ...]]) -> str:
    """Names with block indices folded (``model.layers.*.mlp.up_proj``), each pattern once, in first-seen order."""
    if not names:
        return "none"
    folded = dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", n) for n in names)
    return ", ".join(folded)


def _torchao() -> tuple[Any, Any]:
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as err:  # torchao is an optional dependency: only fp8 needs it
        raise Fp8Error(
            "fp8 training builds on torchao's float8 recipe, which is not installed: pip install "
            "'lightning-par[fp8]' (or torchao), or drop fp8"
        ) from err
    return Float8LinearConfig, convert_to_float8_training
