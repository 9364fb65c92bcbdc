"""ZeRO-3's weight all-gather in int8 with block scales, in the spirit of ZeRO++'s quantized weights (qwZ; Wang et
al., "ZeRO++: Extremely Efficient Collective Communication for Giant Model Training", arXiv 2306.10209, section 3.1).

FSDP2 lets a unit's all-gather be replaced (`FSDPModule.set_custom_all_gather`): it hands over this rank's flat
all-gather input (its shards of the unit's parameters, padded, one after another, in the compute dtype) and the
output buffer for every rank's. `QuantizedAllGather` cuts the input into blocks of ``block`` elements (the last one
zero-padded), scales each by its largest magnitude to [-127, 127], rounds to int8, all-gathers the codes and the
fp32 scales, and writes every rank's dequantized values into the output, this rank's own included, so that every
rank computes with the same weights. Bytes on the wire per element: 1 + 4 / ``block`` instead of 4 (fp32) or 2
(bf16). The shards, the gradients (reduce-scattered as before, with respect to the dequantized weights: the
straight-through estimator) and the optimizer stay in full precision; only what the forward and backward compute
with is quantized, by at most half a step of its block's scale.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_par.parallel.collectives import UnitAllGather

BLOCK = 256  # elements per scale: 1.6 % of the int8 bytes in fp32 scales


def quantized_bytes(numel: int, block: int = BLOCK) -> int:
    """Bytes one rank sends for an all-gather input of ``numel`` elements: a byte per element, padded to whole
    blocks, and a 4-byte scale per block."""
    blocks = -(-numel // block)
    return blocks * (block + 4)


def quantize(flat: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """``flat``'s int8 codes, ``(blocks, block)``, and fp32 scales, ``(blocks, 1)``: each block of ``block``
    elements (the last zero-padded) divided by its largest magnitude over 127, rounded half to even."""
    x = torch.nn.functional.pad(flat.float(), (0, -flat.numel() % block)).view(-1, block)
    scale = x.abs().amax(dim=1, keepdim=True) / 127
    codes = torch.round(x / torch.where(scale > 0, scale, torch.ones_like(scale)))  # an all-zero block stays zero
    return codes.clamp_(-127, 127).to(torch.int8), scale


def dequantize(codes: torch.Tensor, scale: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values of `quantize`'s ``codes`` and ``scale``, the first ``numel`` of them."""
    return (codes.float() * scale).view(-1)[:numel]


class QuantizedAllGather(UnitAllGather):
    """FSDP2's all-gather of a unit's parameters, sent as int8 codes with a scale per block (module docstring).

    Args:
        block: elements per scale.
    """

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Optional[dist.Work]:
        world = group.size()
        gather = self.gather()
        if not input_tensor.is_floating_point():  # parameters of several dtypes travel as bytes: sent as they are
            return gather(output_tensor, input_tensor, group=group, async_op=async_op)
        codes, scale = quantize(input_tensor, self.block)
        all_codes = torch.empty((world * codes.shape[0], self.block), dtype=torch.int8, device=codes.device)
        all_scales = torch.empty((world * scale.shape[0], 1), dtype=scale.dtype, device=scale.device)
        gather(all_codes, codes, group=group)
        gather(all_scales, scale, group=group)
        numel = input_tensor.numel()
        values = (all_codes.float() * all_scales).view(world, -1)[:, :numel]
        output_tensor.view(world, numel).copy_(values)
        return None  # complete (FSDP2 waits on a work object only when there is one)
