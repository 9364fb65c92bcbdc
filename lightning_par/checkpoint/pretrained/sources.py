"""The files pretrained weights come from: what each holds (names and shapes, from headers only) and how to read a part.

Accepted, detected from the path:

- a folder with ``model.safetensors.index.json``: Hugging Face, sharded (the ``weight_map`` names each shard);
- a folder with ``model.safetensors`` (or exactly one ``*.safetensors``): Hugging Face, one file;
- a ``*.safetensors`` file (``lightning-par consolidate``'s ``OUT.safetensors`` among them);
- a folder with ``.metadata``: a sharded lightning_par checkpoint (DCP), read with DCP itself;
- any other file: a torch / Lightning checkpoint (``lightning-par consolidate``'s ``OUT``, read as
  ``OUT.safetensors`` when that is next to it), its ``state_dict`` memory-mapped.

Opening a source reads metadata only (safetensors headers, the DCP index, a torch file's record table), so that every
rank can validate names and shapes before any rank reads a tensor. safetensors checks on open that its header
covers the file exactly, which is how a truncated or corrupt file is caught before training.
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_par.checkpoint.reader import INDEX, CheckpointError, read_index

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
FORMATS = (
    f"a Hugging Face folder ({SAFETENSORS}, or {SAFETENSORS_INDEX} with its shards), a .safetensors file, a "
    "Lightning checkpoint file written by `lightning-par consolidate` (OUT, or OUT.safetensors), or a sharded "
    f"lightning_par checkpoint folder ({INDEX} and __<rank>_0.distcp files)"
)

Region = tuple[slice, ...]


class PretrainedError(ValueError):
    """Pretrained weights that cannot fill the model; the message names the file and the fix."""


class Source:
    """Tensors in a pretrained checkpoint: ``shapes`` (file key -> shape) known on open, tensors read on demand.

    Args:
        path: what the user passed.
        kind: the format, for the report (``"hf-sharded"``, ``"safetensors"``, ``"dcp"``, ``"torch"``).
        shapes: every tensor's key and shape.
        files: the data files that hold them.
    """

    def __init__(self, path: Path, kind: str, shapes: dict[str, tuple[int, ...]], files: int) -> None:
        self.path, self.kind, self.shapes, self.files = path, kind, shapes, files

    def read(self, key: str, region: Region | None = None) -> torch.Tensor:
        """The tensor ``key`` (only ``region`` of it, when given), in the file's dtype, on the CPU."""
        raise NotImplementedError(f"{self.kind} checkpoints are loaded with DCP, not tensor by tensor")

    def can_slice(self, key: str) -> bool:
        """Whether ``read(key, region)`` reads only ``region`` (a converted tensor exists only whole)."""
        return True

    def describe(self) -> str:
        """The format and file count, for the start-up line."""
        return self.kind if self.files <= 1 else f"{self.kind}, {self.files} files"


class SafetensorsSource(Source):
    """One or more safetensors files; each tensor, or a region of it, read through ``safe_open(...).get_slice``.

    Args:
        path: what the user passed (for messages).
        kind: as in `Source`.
        where: file key -> the shard holding it (a sharded index's ``weight_map``); or one file holding them all.
    """

    def __init__(self, path: Path, kind: str, where: Mapping[str, Path] | Path) -> None:
        self.path = path
        self._handles: dict[Path, Any] = {}
        self._where: dict[str, Path] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for file in [where] if isinstance(where, Path) else sorted(set(where.values())):
            handle = self._open(file)
            for key in handle.keys():
                if isinstance(where, Path) or where.get(key) == file:
                    shapes[key], self._where[key] = tuple(handle.get_slice(key).get_shape()), file
        listed = [] if isinstance(where, Path) else [k for k in where if k not in shapes]
        if listed:
            key = listed[0]
            assert not isinstance(where, Path)
            raise PretrainedError(
                f"{where[key]} does not hold {key} (nor {len(listed) - 1} more keys) that {path / SAFETENSORS_INDEX} "
                "says it holds: the index and the shards are from different checkpoints; download the folder again"
            )
        super().__init__(path, kind, shapes, len(self._handles))

    def _open(self, file: Path) -> Any:
        from safetensors import safe_open

        if not file.is_file():
            raise PretrainedError(
                f"{file} is missing: {self.path / SAFETENSORS_INDEX} lists it as a shard; copy or download the whole "
                "folder again"
            )
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as err:  # SafetensorError is not exported as a class one can import everywhere
            raise PretrainedError(
                f"{file} is not a readable safetensors file ({err}): truncated or corrupt; copy or download it again"
            ) from err
        self._handles[file] = handle
        return handle

    def read(self, key: str, region: Region | None = None) -> torch.Tensor:
        part = self._handles[self._where[key]].get_slice(key)
        return part[region] if region is not None else part[:]


class TorchFileSource(Source):
    """A ``torch.save`` file (a Lightning checkpoint's ``state_dict``, or a flat dict of tensors), memory-mapped, so
    that reading a region touches only its pages."""

    def __init__(self, path: Path) -> None:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except (pickle.UnpicklingError, RuntimeError, EOFError, OSError, ValueError) as err:
            raise PretrainedError(
                f"{path} is not a pretrained checkpoint that can be read ({err}); expected {FORMATS}"
            ) from err
        state = obj.get("state_dict", obj) if isinstance(obj, dict) else None
        if not isinstance(state, dict) or not any(isinstance(v, torch.Tensor) for v in state.values()):
            raise PretrainedError(f"{path} holds no tensors under 'state_dict'; expected {FORMATS}")
        self._state = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        super().__init__(path, "torch", {k: tuple(v.shape) for k, v in self._state.items()}, 1)

    def read(self, key: str, region: Region | None = None) -> torch.Tensor:
        t = self._state[key]
        return t[region] if region is not None else t


class DCPSource(Source):
    """A sharded lightning_par checkpoint folder: the model's tensors under ``state_dict.`` in DCP's index."""

    PREFIX = "state_dict."

    def __init__(self, path: Path) -> None:
        try:
            self.metadata = read_index(path)
        except CheckpointError as err:
            raise PretrainedError(str(err)) from err
        self.dtypes: dict[str, torch.dtype] = {}
        shapes: dict[str, tuple[int, ...]] = {}
        for key, md in self.metadata.state_dict_metadata.items():
            if key.startswith(self.PREFIX) and isinstance(md, TensorStorageMetadata):
                shapes[key[len(self.PREFIX) :]] = tuple(md.size)
                self.dtypes[key[len(self.PREFIX) :]] = md.properties.dtype
        files = len({info.relative_path for info in (self.metadata.storage_data or {}).values()})
        super().__init__(path, "dcp", shapes, files)


def _sharded(folder: Path) -> SafetensorsSource:
    index_file = folder / SAFETENSORS_INDEX
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (ValueError, KeyError, TypeError) as err:
        raise PretrainedError(
            f"{index_file} is not a safetensors index (a JSON object with a 'weight_map'): {err}; download it again"
        ) from err
    return SafetensorsSource(folder, "hf-sharded", {k: folder / f for k, f in weight_map.items()})


def open_source(path: str | Path) -> Source:
    """Detect the format of ``path`` and read its metadata (no tensor data).

    Raises:
        PretrainedError: the path does not exist, is in no accepted format, or a file in it is missing, truncated
            or corrupt; the message names the file.
    """
    path = Path(path)
    if not path.exists():
        raise PretrainedError(f"pretrained checkpoint {path} does not exist; pass {FORMATS}")
    if path.is_file():
        if path.suffix == ".safetensors":
            return SafetensorsSource(path, "safetensors", path)
        sibling = path.with_name(path.name + ".safetensors")  # consolidate writes OUT and OUT.safetensors
        if sibling.is_file():
            return SafetensorsSource(sibling, "safetensors", sibling)
        return TorchFileSource(path)
    if (path / SAFETENSORS_INDEX).is_file():
        return _sharded(path)
    if (path / SAFETENSORS).is_file():
        return SafetensorsSource(path, "hf", path / SAFETENSORS)
    if (path / INDEX).is_file():
        return DCPSource(path)
    singles = sorted(path.glob("*.safetensors"))
    if len(singles) == 1:
        return SafetensorsSource(singles[0], "safetensors", singles[0])
    found = ", ".join(sorted(p.name for p in path.iterdir())[:8]) or "nothing"
    hint = ""
    if any(path.glob("*.bin")) or any(path.glob("*.pt")):
        hint = " (pickled .bin/.pt weights are not read: save the model with save_pretrained(safe_serialization=True))"
    raise PretrainedError(f"{path} holds {found}: not a pretrained checkpoint{hint}; pass {FORMATS}")
