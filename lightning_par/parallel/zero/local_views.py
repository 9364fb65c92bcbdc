"""ZeRO-0 under tensor parallelism: element-wise optimizers step plain views of the tensor-parallel shards.

Without this, an optimizer at ``zero_stage=0`` holds the tensor-parallel DTensors themselves next to the plain
parameters the plan leaves whole (embeddings, head, final norm). Two costs follow. torch's multi-tensor (``foreach``)
kernels refuse a list that mixes DTensors and plain tensors ("got mixed torch.Tensor and DTensor", measured on torch
2.13), so on CPU the single-tensor loop dispatches each of its ~10 ops per parameter through DTensor, and on CUDA,
where torch picks ``foreach`` by default, such a group cannot step at all. An optimizer whose update of an element
depends on that element alone (`optimizers.is_elementwise`) gives the same update on the local shard as on the
DTensor, so here it steps a plain view of each DTensor's local shard instead: every tensor in its groups is plain.

After the gradient reduction the reduced gradient of such a parameter is on its view (the optimizer's parameter),
and the DTensor's own ``.grad`` is ``None``, as the model's are under ZeRO-1/2: gradient clipping, the grad scaler
and `ParallelismMonitor` read the optimizer's parameters. Leaving it set would be wrong under any loop whose
``zero_grad`` does not reach this code (Fabric calls torch's own on the optimizer's class): the next backward would
accumulate into it in place. In checkpoints a view's optimizer state is the DTensor of its parameter, as when the
optimizer held the DTensor: the files do not change.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.parallel.grad_norm import copy_marks, mark_sharded
from lightning_par.parallel.optimizers import is_elementwise
from lightning_par.parallel.zero.buckets import local_data, local_grad, set_grad, tp_groups
from lightning_par.utils import dtensors


class LocalViews:
    """The plain views that element-wise optimizers step in place of tensor-parallel DTensor parameters."""

    def __init__(self) -> None:
        self.views: dict[nn.Parameter, nn.Parameter] = {}
        self._by_name: dict[str, nn.Parameter] = {}

    def adopt(self, optimizer: torch.optim.Optimizer, names: dict[nn.Parameter, str]) -> int:
        """Point an element-wise ``optimizer``'s DTensor parameters (those among ``names``) at plain views of their
        local shards, in place (LR schedulers keep the optimizer). Returns how many were replaced (none for an
        optimizer that is not element-wise: it keeps stepping the DTensors)."""
        if not is_elementwise(optimizer):
            return 0
        if optimizer.state:
            raise RuntimeError("adopt the optimizer before its first step (its state would be DTensors)")
        adopted = 0
        for group in optimizer.param_groups:
            params = []
            for p in group["params"]:
                sharded = isinstance(p, DTensor)  # (not narrowing p: it stays a Parameter for the dicts)
                if sharded and p in names:
                    view = self.views.get(p)
                    if view is None:
                        # A view: the optimizer's in-place update writes straight into the DTensor's local shard.
                        view = nn.Parameter(local_data(p))
                        mark_sharded(view, tp_groups(p))  # its norm sums over the tp ranks, as the DTensor's did
                        copy_marks(p, view)  # a pipeline's tied copy stays out of the norm
                        self.views[p] = view
                        self._by_name[names[p]] = p
                    adopted += 1
                    p = view
                params.append(p)
            group["params"] = params
        return adopted

    def take(self, p: nn.Parameter, grad: torch.Tensor) -> bool:
        """After the reduction: put ``p``'s reduced (tp-local) gradient on its view and clear ``p.grad``. Returns
        whether ``p`` has a view (else the caller sets ``p.grad``).

        Added to a gradient the view still holds (no ``zero_grad`` since the last step, or one that zeroed in place),
        as ZeRO-1/2's masters do: the sum a gradient left in place would have accumulated to in one process.
        """
        view = self.views.get(p)
        if view is None:
            return False
        if view.grad is None:
            view.grad = grad
        else:
            view.grad.add_(grad)
        p.grad = None
        return True

    def set_full_grads(self, params: Sequence[nn.Parameter], data: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
        """Stage 0: hand a bucket's reduced gradients (``flat``, laid out as ``data``, the parameters' local tensors)
        to its parameters, or to their views."""
        offset = 0
        for p, d in zip(params, data):
            grad = flat[offset : offset + d.numel()].view_as(d)
            if not self.take(p, grad):
                set_grad(p, grad)
            offset += d.numel()

    def hand_grads(self, params: Iterable[nn.Parameter]) -> None:
        """`take` each parameter's own (already reduced and settled) gradient."""
        for p in params:
            if p in self.views:
                g = local_grad(p)
                if g is not None:
                    self.take(p, g)

    def owner_of(self, p: nn.Parameter) -> nn.Parameter:
        """What the optimizer holds for ``p``: its view, or ``p`` itself."""
        return self.views.get(p, p)

    def distribute(self, name: str, value: Any) -> Any:
        """A view's optimizer-state tensor as the DTensor of its parameter (what the optimizer held before); any
        other value as it is."""
        p = self._by_name.get(name)
        if p is None or not isinstance(value, torch.Tensor) or value.dim() == 0 or value.shape != self.views[p].shape:
            return value
        return dtensors.like(value, p)
