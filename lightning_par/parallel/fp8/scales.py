"""The fp8 weights' scales under ZeRO-3, computed once per forward from the whole weights.

FSDP2 asks each fp8 weight for its all-gather input (torchao's ``fsdp_pre_all_gather``); without a scale given
beforehand, torchao takes the largest magnitude over the data-parallel mesh FSDP2 passes, which under ZeRO-3 over
tensor parallelism is this tp rank's slice only: each tp rank would cast its slice of a weight with another scale
than one process casts the whole weight with. torchao's ``precompute_float8_dynamic_scale_for_fsdp`` takes the
largest magnitudes of every fp8 weight as the DTensors they are (over every mesh dimension: one all-reduce for all
of them) and hands each its scale. Run before each forward of a ZeRO-3 root, they are always those of the weights
the forward uses (the optimizer, a checkpoint load or pretrained weights may have changed them since the last);
torchao skips weights that are not sharded DTensors, so under a pipeline, whose blocks stay gathered from the
step's first microbatch to its end, only that microbatch's forward computes them.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.utils.hooks import RemovableHandle


def precompute_scales(root: nn.Module) -> RemovableHandle:
    """Before each forward of ``root`` (a ZeRO-3 root holding fp8 layers), set every fp8 weight's scale from the
    whole weight's largest magnitude."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    def hook(module: nn.Module, args: Any) -> None:
        precompute_float8_dynamic_scale_for_fsdp(module)

    return root.register_forward_pre_hook(hook)
