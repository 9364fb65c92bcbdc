"""ZeRO-3's all-gather of a unit whose parameters are all fp8, as bytes.

FSDP2 all-gathers a unit's flat buffer in its inputs' dtype when they share one, else as bytes. With fp8 training
a unit whose every parameter is an fp8 weight (a block whose norms hold no weight, no biases: OLMo, nanochat) hands
it a float8 buffer, which gloo cannot all-gather ("Invalid scalar type"). Sent as its bytes (a ``uint8`` view of the
same memory), it moves the same bytes on any backend; buffers of other dtypes go as FSDP2 sends them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from lightning_par.parallel.collectives import UnitAllGather

FLOAT8 = frozenset(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
                   if hasattr(torch, n))  # fmt: skip


class BytesAllGather(UnitAllGather):
    """FSDP2's all-gather of a unit (`FSDPModule.set_custom_all_gather`), a float8 buffer sent as bytes."""

    def __call__(
        self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False
    ) -> Optional[dist.Work]:
        if input_tensor.dtype in FLOAT8:
            output_tensor, input_tensor = output_tensor.view(torch.uint8), input_tensor.view(torch.uint8)
        return self.gather()(output_tensor, input_tensor, group=group, async_op=async_op)
