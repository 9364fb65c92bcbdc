"""Read a sharded checkpoint folder safely: check it against its index first, never unpickle arbitrary objects.

DCP's own `FileSystemReader` unpickles ``.metadata`` with plain `pickle.load` and its `DefaultLoadPlanner` loads
non-tensor values (optimizer ``param_groups``) with ``torch.load(weights_only=False)``: both run whatever a
crafted file names. Here ``.metadata`` is unpickled with an allow-list of DCP's metadata classes and non-tensor
values must pass ``torch.load(weights_only=True)`` first; tensors DCP already reads with ``weights_only=True``.

Before any tensor is read, every data file the index names is checked to exist and to be long enough, and the
model's keys and shapes are compared with the checkpoint's, so a damaged or foreign checkpoint fails on every rank
with one message that names the file and the fix, instead of a per-rank traceback from inside DCP (or not at all:
DCP ignores unexpected keys and reads a truncated file without complaint when the part it needs is intact).
"""

from __future__ import annotations

import io
import pickle
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Optional, Union

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.tensor import DTensor
from torch.futures import Future
from typing_extensions import override

from lightning_par import _compat

META = "meta.pt"
INDEX = ".metadata"

_FIX_INCOMPLETE = "the checkpoint was not completely written or copied; copy the whole folder again or use an older one"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded; the message names the file, the problem and the fix."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """A checkpoint folder, or a file inside it, that does not exist."""


# ---- no arbitrary unpickling ----------------------------------------------------------------------------------
_METADATA_GLOBALS = (
    {
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "StorageMeta",
            "MetadataIndex",
            "ChunkStorageMetadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "TensorProperties",
        )
    }
    | set(_compat.DCP_INDEX_PRIVATE_GLOBALS)
    | {
        ("torch", "Size"),
        ("pathlib", "PosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "PureWindowsPath"),
        ("collections", "OrderedDict"),
    }
)


class _Disallowed(pickle.UnpicklingError):
    """A global outside the allow-list: refused before it is imported or called."""


class _MetadataUnpickler(pickle.Unpickler):
    """`pickle.Unpickler` restricted to what DCP's index holds (the "Restricting Globals" recipe of the pickle docs)."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise _Disallowed(f"{module}.{name} is not allowed in a checkpoint index")


class SafeFileSystemReader(_compat.FileSystemReaderSliceHook):
    """`FileSystemReader` whose ``.metadata`` is unpickled with an allow-list instead of plain `pickle.load`, and
    whose read errors name the data file and byte range that failed."""

    _reading: Any = None

    @override
    def before_slice(self, sinfo: Any) -> None:
        self._reading = sinfo  # DCP slices each item just before reading it; remembered for the error message

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        self._reading = None
        try:
            return super().read_data(plan, planner)
        except Exception as err:
            info, where = self._reading, f"{self.path}"
            if info is not None:
                where = f"{Path(self.path) / info.relative_path} (bytes {info.offset}-{info.offset + info.length})"
            if isinstance(err, pickle.UnpicklingError):
                # Not torch's own text: it goes on to suggest weights_only=False.
                raise CheckpointError(
                    f"{where} holds a record that torch.load(weights_only=True) refuses: corrupt bytes, or an object "
                    f"that would run code when unpickled, which is never loaded; {_FIX_INCOMPLETE}"
                ) from err
            raise CheckpointError(f"{where} is corrupt ({type(err).__name__}: {err}); {_FIX_INCOMPLETE}") from err

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        name = INDEX if rank is None else f"__{rank}{INDEX}"
        with open(Path(self.path) / name, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if not isinstance(metadata, Metadata):
            raise pickle.UnpicklingError(f"{name} holds a {type(metadata).__name__}, not DCP Metadata")
        storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
        storage_meta.load_id = self.load_id  # as FileSystemReader does
        metadata.storage_meta = storage_meta
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """`DefaultLoadPlanner` whose non-tensor values must load with ``weights_only=True``.

    The bytes are checked with the restricted loader, then handed unchanged to DCP's own ``load_bytes``: the same
    bytes can then only build the plain values (numbers, strings, tuples, lists, dicts) the check allowed.
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        torch.load(value, weights_only=True)
        value.seek(0)
        super().load_bytes(read_item, value)


# ---- checks against the index ---------------------------------------------------------------------------------
def read_index(path: Union[str, Path]) -> Metadata:
    """Check that ``path`` is a complete checkpoint folder and return its DCP index.

    Checks, in order: the folder exists and is a folder; ``.metadata`` and ``meta.pt`` exist; the index unpickles
    (allow-listed classes only); every data file it names exists and is as long as the index says.

    Args:
        path: the checkpoint folder written by ``trainer.save_checkpoint`` / ``ModelCheckpoint``.

    Raises:
        CheckpointNotFoundError: the folder or a file in it is missing.
        CheckpointError: the path is a plain file, or a file is corrupt or truncated.
    """
    path = Path(path)
    if not path.exists():
        hint = (
            " (a .tmp folder next to it is an interrupted save)" if path.with_name(path.name + ".tmp").exists() else ""
        )
        raise CheckpointNotFoundError(
            f"checkpoint {path} does not exist{hint}; pass a folder written by trainer.save_checkpoint or "
            "ModelCheckpoint under ParallelStrategy"
        )
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} is a file, not a folder: ParallelStrategy reads sharded folders (.metadata, "
            f"__<rank>_0.distcp, {META}). A single-file Lightning checkpoint loads under a single-device strategy; "
            "to start a ParallelStrategy run from its weights, load its state_dict into the model before fit"
        )
    inside = sorted(p.name for p in path.iterdir() if (p / INDEX).is_file())
    if inside and not (path / INDEX).exists():
        raise CheckpointNotFoundError(
            f"{path} is a folder of checkpoints ({_listing(inside)}), not a checkpoint; pass one of them"
        )
    for name in (INDEX, META):
        if not (path / name).is_file():
            raise CheckpointNotFoundError(
                f"{path / name} is missing, so {path} is not a complete lightning_par checkpoint (expected "
                f"{INDEX}, {META} and __<rank>_0.distcp files); {_FIX_INCOMPLETE}"
            )
    try:
        metadata = SafeFileSystemReader(path).read_metadata()
    except _Disallowed as err:
        raise CheckpointError(
            f"{path / INDEX} names code to run ({err}), so it was not written by DCP or was altered; it is not "
            "loaded. Use a checkpoint from a trusted source"
        ) from err
    except Exception as err:
        raise CheckpointError(f"{path / INDEX} is corrupt or truncated ({err}); {_FIX_INCOMPLETE}") from err
    need: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        need[info.relative_path] = max(need.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(need.items()):
        file = path / name
        if not file.is_file():
            raise CheckpointNotFoundError(
                f"{file} is missing: the index {INDEX} lists {len(need)} data files ({', '.join(sorted(need))}); "
                f"{_FIX_INCOMPLETE}"
            )
        have = file.stat().st_size
        if have < size:
            raise CheckpointError(
                f"{file} is truncated: {have} bytes, the index {INDEX} needs at least {size}; {_FIX_INCOMPLETE}"
            )
    return metadata


def read_meta(path: Union[str, Path]) -> dict[str, Any]:
    """The non-tensor rest of Lightning's checkpoint (``meta.pt``), loaded with ``weights_only=True``."""
    file = Path(path) / META
    try:
        meta = torch.load(file, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as err:
        raise CheckpointError(
            f"{file} holds objects other than plain data, which are never loaded (weights_only=True); register "
            "trusted classes with torch.serialization.add_safe_globals, or use a checkpoint from a trusted source"
        ) from err
    except Exception as err:
        raise CheckpointError(f"{file} is corrupt or truncated ({err}); {_FIX_INCOMPLETE}") from err
    if not isinstance(meta, dict):
        raise CheckpointError(f"{file} holds a {type(meta).__name__}, not Lightning's checkpoint dict")
    return meta


def _leaves(obj: Any, prefix: str) -> Iterator[tuple[str, Any]]:
    # DCP's flattening: dicts always, lists only when they hold containers (param_groups), "."-joined keys.
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, list) and any(isinstance(v, (dict, list)) for v in obj):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}.{i}")
    else:
        yield prefix, obj


def _shape(value: Any) -> Any:
    return tuple(value.shape) if isinstance(value, (torch.Tensor, DTensor)) else None


def _listing(keys: list[str], limit: int = 4) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def check_keys(
    path: Path, metadata: Metadata, state: dict[str, Any], strict: bool, elsewhere: frozenset[str] = frozenset()
) -> list[str]:
    """Compare the state to load with the checkpoint's keys and shapes.

    Shapes must match. Model keys (``state_dict.*``) missing from the checkpoint, or in it but not in the model,
    fail when ``strict``; otherwise the missing ones are returned, to be left out of the load. Optimizer state
    must always be complete.

    Args:
        path: the checkpoint folder (for messages).
        metadata: its index, from `read_index`.
        state: the nested state about to be loaded (model under ``state_dict``, optimizers under ``optimizer_<i>``).
        strict: the LightningModule's ``strict_loading``.
        elsewhere: flattened model keys that other ranks load (other pipeline stages): not unexpected here.

    Returns:
        the flattened model keys the checkpoint lacks (empty when ``strict``).
    """
    saved = metadata.state_dict_metadata
    want = dict(_leaves(state, ""))
    mismatched = []
    for k, v in want.items():
        md, shape = saved.get(k), _shape(v)
        if isinstance(md, TensorStorageMetadata) and shape is not None and tuple(md.size) != shape:
            mismatched.append(f"{k}: checkpoint {tuple(md.size)} vs model {shape}")
    missing = [k for k in want if k not in saved]
    missing_model = [k for k in missing if k.startswith("state_dict.")]
    missing_optim = [k for k in missing if not k.startswith("state_dict.")]
    unexpected = [k for k in saved if k.startswith("state_dict.") and k not in want and k not in elsewhere]
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es): {_listing(mismatched)}")
    if strict and missing_model:
        problems.append(f"{len(missing_model)} model key(s) missing from the checkpoint: {_listing(missing_model)}")
    if strict and unexpected:
        problems.append(f"{len(unexpected)} unexpected key(s) in the checkpoint: {_listing(unexpected)}")
    if missing_optim:
        problems.append(
            f"optimizer state missing for {len(missing_optim)} key(s): {_listing(missing_optim)} (a checkpoint saved "
            "with weights only, or with other optimizers, cannot resume fit)"
        )
    if problems:
        fix = "load a checkpoint of this model and optimizer"
        if not mismatched and not missing_optim:
            fix += ", or set strict_loading = False on the LightningModule to skip missing and unexpected keys"
        raise CheckpointError(f"checkpoint {path} does not match the model: {'; '.join(problems)}; {fix}")
    if missing_model or unexpected:
        warnings.warn(
            f"strict_loading=False: {len(missing_model)} model key(s) not in checkpoint {path} keep their values "
            f"({_listing(missing_model)}); {len(unexpected)} unexpected key(s) are ignored ({_listing(unexpected)})",
            stacklevel=2,
        )
    return missing_model


def _describe(path: Path, err: CheckpointException) -> str:
    # DCP gathers every rank's exception (with its traceback) into one; keep each distinct message once.
    by_message: dict[str, list[int]] = {}
    ours = True
    for rank, failure in sorted(err.failures.items()):
        exc = failure[0] if isinstance(failure, tuple) else failure
        ours = ours and isinstance(exc, CheckpointError)  # these name the file already
        text = str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"
        by_message.setdefault(text, []).append(rank)
    if ours and len(by_message) == 1:
        return next(iter(by_message))
    return f"loading checkpoint {path} failed: " + "; ".join(f"rank(s) {r}: {m}" for m, r in by_message.items())


def load_tensors(
    path: Path, metadata: Metadata, state: dict[str, Any], strict: bool = True, elsewhere: frozenset[str] = frozenset()
) -> list[str]:
    """Check ``state`` against the checkpoint (`check_keys`), then load it in place with DCP, resharding as needed.

    Args:
        path: the checkpoint folder, already checked by `read_index`.
        metadata: its index.
        state: nested state with plain or DTensor values; loaded in place.
        strict, elsewhere: see `check_keys`.

    Returns:
        the model keys left out because the checkpoint lacks them (only when not ``strict``).
    """
    skipped = check_keys(path, metadata, state, strict, elsewhere)
    for key in skipped:
        state["state_dict"].pop(key[len("state_dict.") :], None)
    safe_load(state, path)
    return skipped


def safe_load(
    state: dict[str, Any], path: Path, planner: Optional[SafeLoadPlanner] = None, no_dist: bool = False
) -> None:
    """`torch.distributed.checkpoint.load` with the safe reader and planner; its errors become `CheckpointError`.

    Args:
        state: the state to load in place (DCP reshards into its DTensors).
        path: the checkpoint folder.
        planner: a `SafeLoadPlanner` with other options than the default.
        no_dist: load in this process alone, with no process group.
    """
    try:
        dcp.load(
            state, storage_reader=SafeFileSystemReader(path), planner=planner or SafeLoadPlanner(), no_dist=no_dist
        )
    except CheckpointException as err:  # a BaseException: it would escape `except Exception`
        raise CheckpointError(_describe(path, err)) from None
