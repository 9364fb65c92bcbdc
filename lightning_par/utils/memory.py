"""Count the bytes of tensor storages that ops create, live and at peak: exact activation memory on any device.

tracemalloc does not see tensor memory and RSS is noisy (docs/testing.md); `saved_tensors_hooks` miss what
checkpointing keeps inside its own hooks. A dispatch mode sees every op, inside checkpointed regions too.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_par import _compat


class LiveStorageBytes(_compat.TorchDispatchMode):
    """Bytes of the tensor storages created under this mode, while alive, and their peak at op boundaries.

    Entered around a forward, `now()` afterwards is the activation memory held until backward; tensors created
    before the mode (parameters) are not counted, nor are views and in-place results of existing storages.
    """

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[_compat.StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        # Outputs that share an input's storage (views, in-place ops: a parameter's .t()) allocate nothing.
        leaves = _compat.tree_leaves((args, kwargs))
        inputs = {_compat.storage_id(t.untyped_storage()) for t in leaves if isinstance(t, Tensor)}
        for t in _compat.tree_leaves(out):
            if isinstance(t, Tensor) and _compat.storage_id(t.untyped_storage()) not in inputs:
                storage = t.untyped_storage()
                self.live.setdefault(_compat.storage_id(storage), (_compat.StorageWeakRef(storage), storage.nbytes()))
        self.peak = max(self.peak, self.now())
        return out

    def now(self) -> int:
        """Bytes of the counted storages still alive."""
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        return sum(n for _, n in self.live.values())
