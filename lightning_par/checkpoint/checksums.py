"""A checksum for every file of a checkpoint folder: written at save, checked at load.

The reader's checks (`reader.read_index`) catch a missing or truncated file; a byte flipped inside a tensor's data
(bad disk, a copy gone wrong, bit rot on a shared filesystem) keeps every size and would load without a word, and
training would go on from corrupted weights. So every save records a CRC-32 per file in ``checksums.json``:

- at save, after DCP's save and the small files are written and before the folder is committed, every rank hashes
  the files it wrote (its ``__<rank>_*.distcp`` and ``rank_<rank>.pt``; rank 0 also ``.metadata`` and ``meta.pt``),
  and rank 0 writes the table gathered from all of them (`record`): the hashing is spread over the ranks, each
  reading back only what it wrote;
- at load, before any tensor is read, the files are split over the ranks, each checks its share, and all ranks
  agree: a mismatch fails on every rank, naming the file (`verify`). A single process (``lightning-par
  consolidate``) checks them all.

CRC-32 (``zlib``) finds any change of up to 32 bits in a file and every single flipped byte; it is not a defence
against deliberate tampering (the reader's allow-list is what keeps code out). Checkpoints written before this file
existed have no table and load as before.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path
from typing import Any, Optional

import torch.distributed as dist

from lightning_par.checkpoint.reader import INDEX, META, CheckpointError

FILE = "checksums.json"
_CHUNK = 1 << 24  # 16 MiB read at a time


def crc32(file: Path) -> str:
    """The CRC-32 of ``file``'s bytes, as 8 hex digits, read in chunks (no more than 16 MiB in memory)."""
    value = 0
    with open(file, "rb") as f:
        while chunk := f.read(_CHUNK):
            value = zlib.crc32(chunk, value)
    return f"{value:08x}"


def _written_by(folder: Path, rank: int) -> list[Path]:
    names = [p for p in folder.glob(f"__{rank}_*.distcp")] + [folder / f"rank_{rank}.pt"]
    names += [folder / INDEX, folder / META] if rank == 0 else []
    return sorted(p for p in names if p.is_file())


def _distributed(group: Optional[dist.ProcessGroup]) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def record(folder: Path, rank: int, group: Optional[dist.ProcessGroup] = None) -> None:
    """Every rank of ``group`` hashes the files it wrote into ``folder``; rank 0 writes the table (``FILE``).

    Call on every rank after DCP's save and `dcp.write_small`, before `dcp.commit`.
    """
    mine = {p.name: crc32(p) for p in _written_by(folder, rank)}
    tables: list[Any] = [mine]
    if _distributed(group):
        tables = [None] * dist.get_world_size(group)
        dist.all_gather_object(tables, mine, group=group)
    if rank == 0:
        merged = {name: value for table in tables for name, value in table.items()}
        (folder / FILE).write_text(json.dumps({"algorithm": "crc32", "files": merged}, indent=1, sort_keys=True))


def verify(folder: Path, rank: int = 0, world: int = 1, group: Optional[dist.ProcessGroup] = None) -> None:
    """Check ``folder``'s files against the table written with them; every rank of ``group`` (``world`` of them)
    calls it and checks every ``world``-th file.

    Raises:
        CheckpointError: on every rank, naming the first file whose bytes changed (or that is missing).
    """
    table_file = folder / FILE
    if not table_file.is_file():
        return  # written before checksums existed
    try:
        table: dict[str, str] = json.loads(table_file.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        bad = [f"{FILE} (unreadable: {err})"]
    else:
        names = sorted(table)[rank::world]
        bad = [n for n in names if not (folder / n).is_file() or crc32(folder / n) != table[n]]
    if world > 1 and _distributed(group):
        found: list[Any] = [None] * world
        dist.all_gather_object(found, bad, group=group)
        bad = sorted({n for part in found for n in part})
    if bad:
        more = f" (and {len(bad) - 1} more: {', '.join(bad[1:4])})" if len(bad) > 1 else ""
        raise CheckpointError(
            f"{folder / bad[0]} does not match the checksum written with it{more}: its bytes changed after the save "
            f"(a bad disk, an interrupted copy), so the checkpoint is not loaded and nothing was modified; load an "
            f"earlier checkpoint, or copy this one again from where it was saved"
        )
