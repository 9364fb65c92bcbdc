"""`Fabric(precision=...)` under `lightning_par.strategies.fabric.FabricParallelStrategy`: the same four flags, the
same numerics as the Trainer's `ParallelPrecision` (`flags.py`), Fabric's hook signatures.

Fabric picks a stock plugin from the flag before it hands it to the strategy; the strategy turns it into this one
(`from_fabric`). Fabric turns ``16-mixed`` on CPU into ``bf16-mixed`` (with its warning) before the strategy sees
it; on CUDA ``16-mixed`` gets `ShardedGradScaler`, whose overflow check spans every rank's gradient shards.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from lightning.fabric.plugins.precision import HalfPrecision, MixedPrecision, Precision
from torch.optim import Optimizer
from typing_extensions import override

from lightning_par.parallel.grad_norm import clip_grad_norm
from lightning_par.precision.flags import SUPPORTED, PrecisionFlags, check_flag
from lightning_par.precision.parallel import ShardedGradScaler


class FabricPrecision(PrecisionFlags, MixedPrecision):
    """Fabric precision plugin of the lightning_par strategies for the flags in `SUPPORTED`.

    Args:
        precision: one of ``"32-true"``, ``"bf16-mixed"``, ``"16-mixed"``, ``"bf16-true"``.
        device: ``"cpu"`` or ``"cuda"`` (the autocast device type).
    """

    def __init__(self, precision: str, device: str = "cpu") -> None:
        check_flag(precision)
        # Not MixedPrecision.__init__: it accepts the two mixed flags only; the scaler and autocast rules are ours.
        self.precision = precision  # type: ignore[assignment]
        self.device = device
        self.scaler: Optional[torch.amp.GradScaler] = ShardedGradScaler(device) if precision == "16-mixed" else None
        self._desired_input_dtype = self.compute_dtype

    @classmethod
    def from_fabric(cls, plugin: Precision, device: str) -> FabricPrecision:
        """This plugin for the flag behind one of Fabric's stock plugins.

        Raises:
            ValueError: a flag outside `SUPPORTED` (``16-true``, ``64-true``, Transformer Engine, ...), naming them.
        """
        if isinstance(plugin, cls):
            return plugin
        if type(plugin) is Precision:
            return cls("32-true", device)
        flag = getattr(plugin, "precision", None)
        if isinstance(plugin, (MixedPrecision, HalfPrecision)) and flag in SUPPORTED:
            return cls(str(flag), device)
        raise ValueError(
            f"Fabric's precision plugin {type(plugin).__name__}({flag!r}) is not supported by lightning_par "
            f"strategies; pass Fabric(precision=...) one of {SUPPORTED}"
        )

    def clip_norm(self, optimizer: Optimizer, max_norm: float, sum_groups: tuple[Any, ...]) -> torch.Tensor:
        """Unscale (``16-mixed``), then clip the optimizer's gradients to a global L2 norm of ``max_norm``.

        Args:
            optimizer: its parameters are what this rank steps (shards under ZeRO).
            max_norm: the largest allowed global norm.
            sum_groups: groups over which ranks hold disjoint parameters beyond their shards (pipeline stages).

        Returns:
            the global norm before clipping.
        """
        self.unscale_gradients(optimizer)
        return clip_grad_norm(self.main_params(optimizer), max_norm, sum_groups=sum_groups)

    @override
    def unscale_gradients(self, optimizer: Optimizer) -> None:
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)
