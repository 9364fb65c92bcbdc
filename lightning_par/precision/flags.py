"""What a precision flag means for parameters, compute and inputs: shared by the Trainer's and Fabric's plugins.

`lightning_par.precision.parallel.ParallelPrecision` (Trainer) and `lightning_par.precision.fabric.FabricPrecision`
(Fabric) both mix this in, so one flag is the same numerics under either loop: autocast only in the mixed modes,
inputs cast only under ``bf16-true`` (Fabric's own mixed plugin casts float inputs to the low dtype, which the
Trainer never does), parameters stored in bf16 only under ``bf16-true``.
"""

from __future__ import annotations

from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

SUPPORTED = ("32-true", "bf16-mixed", "16-mixed", "bf16-true")


def check_flag(precision: str) -> None:
    """Raise a ValueError naming the choices unless ``precision`` is one of `SUPPORTED`."""
    if precision not in SUPPORTED:
        raise ValueError(
            f"precision={precision!r} is not supported by lightning_par strategies; choose one of {SUPPORTED}"
        )


class PrecisionFlags:
    """Dtype rules of a flag in `SUPPORTED`; the plugin that mixes this in sets ``precision`` and ``device``."""

    precision: Any
    device: str

    @property
    def mixed(self) -> bool:
        """Whether compute runs in autocast over fp32 master weights."""
        return self.precision in ("bf16-mixed", "16-mixed")

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype matmuls run in."""
        return {"32-true": torch.float32, "bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}.get(
            self.precision, torch.bfloat16
        )

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype parameters (and their master copies) are stored in."""
        return torch.bfloat16 if self.precision == "bf16-true" else torch.float32

    def convert_module(self, module: nn.Module) -> nn.Module:
        return module.to(dtype=self.param_dtype) if self.precision == "bf16-true" else module

    @contextmanager
    def _default_dtype(self) -> Generator[None, None, None]:
        if self.precision != "bf16-true":
            yield
            return
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)

    @contextmanager
    def tensor_init_context(self) -> Generator[None, None, None]:
        with self._default_dtype():
            yield

    @contextmanager
    def module_init_context(self) -> Generator[None, None, None]:
        with self._default_dtype():
            yield

    @contextmanager
    def forward_context(self) -> Generator[None, None, None]:
        # No autocast weight cache, as Lightning's own plugin: ZeRO-3 re-gathers the weights each forward anyway.
        ctx: Any = nullcontext()
        if self.mixed:
            ctx = torch.autocast(self.device, dtype=self.compute_dtype, cache_enabled=False)
        with ctx:
            yield

    def convert_input(self, data: Any) -> Any:
        if self.precision != "bf16-true":
            return data
        from lightning.fabric.utilities.apply_func import apply_to_collection

        def _cast(t: torch.Tensor) -> torch.Tensor:
            return t.to(torch.bfloat16) if torch.is_floating_point(t) else t

        return apply_to_collection(data, torch.Tensor, _cast)

    def convert_output(self, data: Any) -> Any:
        return data  # as the Trainer: the loss keeps the dtype the model computed it in
