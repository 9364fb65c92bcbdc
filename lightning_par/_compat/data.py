"""Private torch API of the DataLoader's worker processes (re-exported by `lightning_par._compat`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def hidden_worker_info() -> Iterator[None]:
    """Inside, ``torch.utils.data.get_worker_info()`` returns ``None`` (it returns the module global
    torch.utils.data._utils.worker._worker_info, torch 2.11 + 2.13): a source read through `DataParallelStream`, which
    splits the stream over the loader's workers itself, must not split it again (`datasets` and the torch docs'
    pattern do when they see a worker)."""
    from torch.utils.data._utils import worker

    saved, worker._worker_info = worker._worker_info, None  # type: ignore[attr-defined]
    try:
        yield
    finally:
        worker._worker_info = saved  # type: ignore[attr-defined]
