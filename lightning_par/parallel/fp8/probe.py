"""What fp8 cannot convert without changing or breaking the model's code, found by one probe forward.

torchao's `Float8Linear` changes two things the code around a layer can see. Its output comes out of a custom
autograd function as a view, which autograd forbids changing in place (Falcon adds the attention's output into the
MLP's: ``mlp_output += attention_output``). And under ZeRO-3 its weight is gathered already cast to fp8, so code
that reads the weight itself rather than calling the layer (Mamba's ``self.dt_proj.weight @ x``) would get an fp8
tensor. One forward of the model (`lightning_par.blocks._probe.probe_call`, in eval mode and without gradients, on
the meta device for a meta-built model) watches every candidate layer: a torch call that takes its weight while
the layer is not running, or that writes its output in place, keeps it in the training precision, named at start-up.
A model the probe cannot run is converted as the rule says, without these two checks.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_par import _compat
from lightning_par.blocks._probe import watched_probe, writes_in_place

WEIGHT_OUTSIDE = "its weight is read outside its forward (the fp8 gather would hand that code an fp8 tensor)"
OUTPUT_IN_PLACE = "its output is changed in place (autograd forbids it on fp8's output)"


class _Watch(TorchFunctionMode):
    def __init__(self, weights: dict[int, str], running: set[str], outputs: dict[int, tuple[Any, str]],
                 found: dict[str, str]) -> None:  # fmt: skip
        super().__init__()
        self.weights, self.running, self.outputs, self.found = weights, running, outputs, found

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        if writes_in_place(name) and args and isinstance(args[0], torch.Tensor) and id(args[0]) in self.outputs:
            self.found.setdefault(self.outputs[id(args[0])][1], OUTPUT_IN_PLACE)
        for leaf in _compat.tree_leaves((args, kwargs or {})):
            layer = self.weights.get(id(leaf)) if isinstance(leaf, torch.Tensor) else None
            if layer is not None and layer not in self.running and name not in ("__get__", "size", "dim"):
                self.found.setdefault(layer, WEIGHT_OUTSIDE)
        return func(*args, **(kwargs or {}))


def unconvertible(model: nn.Module, names: list[str]) -> dict[str, str]:
    """Layer name -> why fp8 must leave it alone, among ``names`` (``nn.Linear``s of ``model``), from one probe
    forward; empty when the probe cannot run the model."""
    layers = {n: model.get_submodule(n) for n in names}
    weights = {id(m.weight): n for n, m in layers.items()}
    running: set[str] = set()
    outputs: dict[int, tuple[Any, str]] = {}  # id -> (the output, kept alive so ids stay unique; its layer)
    found: dict[str, str] = {}

    def enter(name: str) -> Any:
        return lambda mod, args: running.add(name)

    def leave(name: str) -> Any:
        def hook(mod: nn.Module, args: Any, out: Any) -> None:
            running.discard(name)
            if isinstance(out, torch.Tensor):
                outputs[id(out)] = (out, name)

        return hook

    handles = [h for n, m in layers.items()
               for h in (m.register_forward_pre_hook(enter(n)), m.register_forward_hook(leave(n)))]  # fmt: skip
    return found if watched_probe(model, _Watch(weights, running, outputs, found), handles) else {}
