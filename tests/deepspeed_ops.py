"""DeepSpeed's JIT-built CPU ops, built once per machine outside the timed tests.

DeepSpeed compiles its C++ ops on first use (measured on the 2-core CI machines: ``cpu_adam`` 125 CPU-s, the shared
memory collectives ``shm_comm`` 65 CPU-s, ``async_io`` where libaio is installed), into ``TORCH_EXTENSIONS_DIR``.
The tests keep that folder outside the checkout (`extensions_folder`), one per venv: torch rebuilds an op whenever its
compile command changes, and DeepSpeed's command names the include folders of the venv it is installed in, so two
venvs sharing one folder would rebuild each other's ops. `.ci/run` keeps its venv at a fixed path outside the checkout
(so a clean clone reuses what an earlier run built) and builds the ops before pytest starts
(``python tests/deepspeed_ops.py``), printing how long that took. torch guards a build with a ``lock`` file and
waits for it with no timeout, so a build killed midway would make every later DeepSpeed test wait out its own limit:
`remove_stale_locks` deletes locks older than any build.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import sys
import time
from pathlib import Path

# A build takes 1-3 minutes here: a lock older than this was left by a killed build.
STALE_LOCK_S = 15 * 60


def extensions_folder() -> Path:
    """``TORCH_EXTENSIONS_DIR`` if set, else a cache folder per torch build and venv (outside any checkout)."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import torch

    venv = hashlib.sha256(sys.prefix.encode()).hexdigest()[:12]
    return Path.home() / ".cache" / "lightning_par" / "torch_extensions" / f"torch-{torch.__version__}" / venv


def remove_orphans(folder: Path) -> list[Path]:
    """Delete the sibling op folders of ``folder`` whose venv no longer exists (a deleted clone's); return them.

    Each folder records the venv it was built for in a ``venv`` file (written here for ``folder``).
    """
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "venv").write_text(sys.prefix)
    removed = []
    for sibling in folder.parent.iterdir():
        record = sibling / "venv"
        if sibling != folder and record.is_file() and not Path(record.read_text()).exists():
            shutil.rmtree(sibling, ignore_errors=True)
            removed.append(sibling)
    return removed


def remove_stale_locks(folder: Path, older_than_s: float = STALE_LOCK_S) -> list[Path]:
    """Delete the build locks under ``folder`` older than ``older_than_s`` seconds; return them."""
    removed = []
    if folder.is_dir():
        now = time.time()
        for lock in folder.glob("**/lock"):
            if now - lock.stat().st_mtime > older_than_s:
                lock.unlink(missing_ok=True)
                removed.append(lock)
    return removed


def build() -> dict[str, float]:
    """Load (building where needed) the ops the DeepSpeed tests use; seconds per op."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.accelerator import get_accelerator

    times = {}
    names = ["CPUAdamBuilder", "ShareMemCommBuilder", "AsyncIOBuilder", "PinMemoryBuilder"]
    for name in names:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue  # async_io without libaio: its test is skipped with the reason
        start = time.perf_counter()
        builder.load(verbose=False)
        times[builder.name] = time.perf_counter() - start
    return times


if __name__ == "__main__":
    folder = extensions_folder()
    os.environ["TORCH_EXTENSIONS_DIR"] = str(folder)
    for lock in remove_stale_locks(folder):
        print(f"removed a stale build lock: {lock}")
    for orphan in remove_orphans(folder):
        print(f"removed the ops of a venv that no longer exists: {orphan}")
    start = time.perf_counter()
    try:
        built = build()
    except ImportError as err:  # DeepSpeed not installed: nothing to build
        print(f"DeepSpeed ops: not built ({err})")
        sys.exit(0)
    ops = ", ".join(f"{k} {v:.1f} s" for k, v in built.items())
    print(f"DeepSpeed ops in {folder}: {ops} ({time.perf_counter() - start:.1f} s in all)")
