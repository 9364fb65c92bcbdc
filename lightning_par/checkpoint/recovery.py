"""Find the checkpoint to resume from after a crash: the newest complete folder, never a partial one."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Optional, Union

from lightning_par.checkpoint.reader import INDEX, CheckpointError, read_index

# Suffixes of folders that are not checkpoints: a save in progress or interrupted (`.tmp`), and the previous
# checkpoint while it is being replaced where folders cannot be exchanged atomically (`.old`).
_NOT_CHECKPOINTS = (".tmp", ".old")


def latest(dirpath: Union[str, Path]) -> Optional[Path]:
    """The most recently written complete checkpoint folder in ``dirpath``, or ``None`` if there is none.

    For ``trainer.fit(model, ckpt_path=latest(dirpath))`` after a crash. Unlike ``ckpt_path="last"`` (which needs
    ``ModelCheckpoint(save_last=True)`` and reads ``last*.ckpt`` only), it considers every checkpoint folder.
    ``.tmp`` and ``.old`` folders are skipped, and so is a folder that fails `reader.read_index` (a missing or
    truncated file; with a warning): a save interrupted at any point is never chosen. "Most recent" is the
    modification time of the folder's index, which DCP writes last.

    Args:
        dirpath: the folder holding the checkpoint folders (``ModelCheckpoint``'s ``dirpath``).
    """
    root = Path(dirpath)
    if not root.is_dir():
        return None
    candidates: list[tuple[int, Path]] = []
    for p in root.iterdir():
        if p.name.endswith(_NOT_CHECKPOINTS) or not (p / INDEX).is_file():
            continue
        try:
            candidates.append(((p / INDEX).stat().st_mtime_ns, p))
        except FileNotFoundError:  # removed meanwhile
            continue
    for _, path in sorted(candidates, reverse=True):
        try:
            read_index(path)
        except CheckpointError as err:
            warnings.warn(f"skipping incomplete checkpoint {path}: {err}", stacklevel=2)
            continue
        return path
    return None
