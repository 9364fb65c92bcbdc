"""`Trainer(precision=...)` mapped onto the sharded world.

| flag         | parameters (masters) | compute                 | gradients reduced in | scaler                 |
|--------------|----------------------|-------------------------|----------------------|------------------------|
| `32-true`    | fp32                 | fp32                    | fp32                 | -                      |
| `bf16-mixed` | fp32                 | bf16 autocast           | fp32                 | -                      |
| `16-mixed`   | fp32                 | fp16 autocast           | fp32                 | `ShardedGradScaler`    |
| `bf16-true`  | bf16                 | bf16                    | bf16                 | -                      |

Under ZeRO-3 the mixed modes also gather parameters in the low-precision dtype (FSDP2 `MixedPrecisionPolicy`),
which halves all-gather traffic; the fp32 shards stay the master weights. Lightning turns `16-mixed` into
`bf16-mixed` on CPU; our strategies keep real fp16 there (slow but correct), through `strategies/_precision_choice.py`.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.plugins.precision import MixedPrecision
from typing_extensions import override

from lightning_par import _compat
from lightning_par.parallel.grad_norm import clip_grad_norm
from lightning_par.precision.flags import PrecisionFlags, check_flag
from lightning_par.utils import dtensors


class ShardedGradScaler(_compat.GradScalerUnscaleHook):
    """A grad scaler whose inf/nan check sees every rank's gradient shards.

    Each rank only holds some gradients (ZeRO-2/3 shards), so an overflow on one rank must skip the step on all:
    the per-rank ``found_inf`` is all-reduced with MAX before ``step`` reads it.
    """

    @override
    def unscale_grads(
        self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor, allow_fp16: bool
    ) -> dict[torch.device, torch.Tensor]:
        by_key: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = dtensors.local(p.grad)
                if not allow_fp16 and g.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients; keep fp32 master weights (16-mixed)")
                by_key.setdefault((g.device, g.dtype), []).append(g)
        total = torch.zeros_like(found_inf)
        for (device, _), grads in by_key.items():
            found = torch.zeros_like(total, device=device)
            _compat.amp_unscale_and_check_(grads, found, inv_scale.to(device))
            total += found.to(total.device)
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(total, op=dist.ReduceOp.MAX)
        return {total.device: total}


class ParallelPrecision(PrecisionFlags, MixedPrecision):
    """Precision plugin of `lightning_par.ParallelStrategy` for all four supported flags.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``.
        device: ``"cpu"`` or ``"cuda"`` (the autocast device type).
        scaler: a grad scaler for ``16-mixed``; default `ShardedGradScaler`.
    """

    def __init__(self, precision: str, device: str = "cpu", scaler: Optional[torch.amp.GradScaler] = None) -> None:
        check_flag(precision)
        if precision == "16-mixed" and scaler is None:
            scaler = ShardedGradScaler(device)
        self.precision = precision  # type: ignore[assignment]
        self.device = device
        self.scaler = scaler
        # Groups over which ranks hold disjoint parameters beyond their shards (pipeline stages): gradient
        # clipping sums the squared norm over them too. Set by the strategy.
        self.norm_groups: tuple[Any, ...] = ()

    @override
    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:  # type: ignore[override]
        clip_grad_norm(self.main_params(optimizer), clip_val, sum_groups=self.norm_groups)
