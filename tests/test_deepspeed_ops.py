"""The DeepSpeed op cache's housekeeping: stale build locks and the ops of deleted venvs go, live ones stay."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from deepspeed_ops import STALE_LOCK_S, remove_orphans, remove_stale_locks


def test_stale_lock_removed_fresh_lock_kept(tmp_path: Path) -> None:
    stale, fresh = tmp_path / "cpu_adam" / "lock", tmp_path / "async_io" / "lock"
    for lock in (stale, fresh):
        lock.parent.mkdir()
        lock.touch()
    old = time.time() - STALE_LOCK_S - 60
    os.utime(stale, (old, old))
    assert remove_stale_locks(tmp_path) == [stale]
    assert not stale.exists() and fresh.exists()


def test_ops_of_a_deleted_venv_removed(tmp_path: Path) -> None:
    mine, gone, alive, unknown = (tmp_path / n for n in ("mine", "gone", "alive", "unknown"))
    for folder, venv in ((gone, tmp_path / "deleted-clone" / ".venv"), (alive, tmp_path)):
        (folder / "cpu_adam").mkdir(parents=True)
        (folder / "venv").write_text(str(venv))
    unknown.mkdir()  # no record: not ours to judge
    assert remove_orphans(mine) == [gone]
    assert (mine / "venv").read_text() == sys.prefix
    assert alive.is_dir() and unknown.is_dir() and not gone.exists()
