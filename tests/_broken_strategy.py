"""A deliberately broken layout for `lightning-par verify`'s test (tests/test_verify.py): ZeRO-0 data parallelism
whose gradient reduction leaves out one parameter, so each rank steps it with its own gradient."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch

from lightning_par import ParallelStrategy

DROPPED = "model.model.layers.0.mlp.down_proj.weight"  # HFCausalLM's Llama: the parameter left unreduced


class _KeepLocal(L.Callback):
    """Before the optimizer steps, put the parameter's own (unreduced) gradient back."""

    def __init__(self, param: torch.nn.Parameter) -> None:
        self.param = param
        self.local: Any = None
        param.register_hook(self._stash)

    def _stash(self, grad: torch.Tensor) -> None:
        self.local = grad.detach().clone()

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: Any, optimizer: Any) -> None:
        if self.local is not None and self.param.grad is not None:
            self.param.grad.copy_(self.local)


class DropOneReduction(ParallelStrategy):
    def __init__(self, param: str = DROPPED, **kwargs: Any) -> None:
        super().__init__(zero_stage=0, **kwargs)
        self._dropped = param

    def setup(self, trainer: L.Trainer) -> None:
        super().setup(trainer)
        assert self.lightning_module is not None
        trainer.callbacks.append(_KeepLocal(self.lightning_module.get_parameter(self._dropped)))
