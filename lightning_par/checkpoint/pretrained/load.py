"""Fill a model that is already laid out over its ranks with pretrained weights, each rank reading only what it owns.

`load_pretrained` takes the model's state dict in checkpoint view (``lightning_par.checkpoint.dcp.model_state``:
parameter and buffer names of the module, plain tensors of the full shape or DTensors whose ``.shape`` is the full
shape) and fills it in place, in three steps:

1. **Validate, on metadata only, the same on every rank.** Each rank opens the file's headers
   (`pretrained_sources`), then the ranks exchange their view names and shapes and a digest of what they found, so
   that the prefix rewrite (`pretrained_names`), the missing and unexpected keys and the shape mismatches are decided
   on the whole model (a pipeline stage holds only its own names) and a bad file fails every rank with the same
   `PretrainedError` before any rank reads a tensor: no rank is left waiting in a collective.
2. **Read only this rank's part.** A DTensor split by plain ``Shard`` / ``Replicate`` (FSDP2, tensor parallelism,
   expert shards, both nested) reads its one rectangular region of the file tensor (safetensors ``get_slice``, or a
   memory-mapped torch file), so a rank of an 8-way sharded model reads about an eighth of it. A fused projection
   (``[q | k | v]`` split chunk by chunk over ``tp``, `lightning_par.checkpoint.strided`) owns several regions: it
   reads the whole tensor and keeps its slices (`lightning_par.checkpoint.place.place_full`), so a rank's peak is one
   full tensor, never the model. A plain tensor is read whole.
3. **Sharded lightning_par checkpoints** go through DCP itself, which plans each rank's reads from its DTensors.

A Hugging Face file saved in another layout than the model's modules (transformers 5 writes MoE experts one by one
and holds them stacked) is read through transformers' own conversion mapping when ``hf_model`` is given
(`lightning_par.checkpoint.pretrained.convert`): the validation then sees the converted names and shapes.

Values are cast to each view's dtype (a bf16 model reads an fp32 file, and the reverse).

A model that gets its storage part by part (DeepSpeed's ZeRO-3 partitions a meta-built model unit by unit) takes the
two steps apart: `prepare_pretrained` validates on names and shapes alone, `PretrainedPlan.read_into` fills a part.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from lightning_par.checkpoint.place import place_full, region_of
from lightning_par.checkpoint.pretrained.convert import convert_source
from lightning_par.checkpoint.pretrained.names import AdapterNames, NameMatch, listing, match_names
from lightning_par.checkpoint.pretrained.report import PretrainedReport
from lightning_par.checkpoint.pretrained.sources import (
    DCPSource,
    PretrainedError,
    Source,
    open_source,
)
from lightning_par.checkpoint.reader import CheckpointError, SafeLoadPlanner, safe_load
from lightning_par.checkpoint.strided import canonicalize, is_fused, restore
from lightning_par.utils import dtensors

__all__ = ["PretrainedError", "PretrainedPlan", "PretrainedReport", "load_pretrained", "prepare_pretrained"]


def _storage_key(t: torch.Tensor) -> tuple[int, ...] | None:
    # Tied names are two entries over one storage (state dicts hold detached aliases, not the same object).
    local = dtensors.storages(t)[0]  # (fp8 training's weights wrap their values: the values' storage)
    if local.numel() == 0 or local.device.type == "meta":
        return None
    return (local.untyped_storage().data_ptr(), local.storage_offset(), *local.shape, *local.stride())


def _ties(views: Mapping[str, torch.Tensor]) -> dict[str, tuple[str, ...]]:
    groups: dict[tuple[int, ...], list[str]] = {}
    for name, view in views.items():
        key = _storage_key(view)
        if key is not None:
            groups.setdefault(key, []).append(name)
    return {n: tuple(m for m in group if m != n) for group in groups.values() if len(group) > 1 for n in group}


def _gather(item: Any) -> list[Any]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [item]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, item)
    return out


def _digest(source: Source) -> str:
    return hashlib.sha1(repr(sorted(source.shapes.items())).encode()).hexdigest()


def _validate(
    path: Path,
    shapes: Mapping[str, tuple[int, ...]],
    local_ties: dict[str, tuple[str, ...]],
    strict: bool,
    module_type: str,
    hf_model: nn.Module | None,
    local_error: str | None,
    adapters: AdapterNames | None = None,
) -> tuple[Source, NameMatch, dict[str, tuple[str, ...]]]:
    """Open the file and decide the name match on every rank's names; raise the same error on every rank.

    Args:
        local_error: what this rank found wrong with its own views (raised on every rank, after the file's own
            errors).

    Returns:
        the source, the match, and every rank's ties (name -> the names sharing its tensor, or filling it).
    """
    source: Source | None = None
    error: str | None = None
    try:
        source = open_source(path)
        if hf_model is not None and not isinstance(source, DCPSource):  # our own checkpoints hold module names
            source = convert_source(source, hf_model)
        if local_error is not None:
            raise PretrainedError(local_error)
    except PretrainedError as err:
        error = str(err)
    except Exception as err:  # raised here alone, it would leave the other ranks waiting in the exchange below
        error = f"reading {path} failed: {type(err).__name__}: {err}"
    mine = (error, dict(shapes), local_ties, _digest(source) if source else None)
    everyone = _gather(mine)
    failed = [(r, e) for r, (e, *_) in enumerate(everyone) if e is not None]
    if failed:
        ranks = ", ".join(str(r) for r, e in failed if e == failed[0][1])
        where = f" (rank {ranks})" if len(everyone) > 1 else ""
        raise PretrainedError(f"{failed[0][1]}{where}")
    if len({d for *_, d in everyone}) > 1:
        raise PretrainedError(
            f"{path} holds different tensors on different ranks: every rank must read the same checkpoint (a shared "
            "filesystem, or the same copy on every node)"
        )
    assert source is not None
    every: dict[str, tuple[int, ...]] = {}
    ties: dict[str, tuple[str, ...]] = {}
    for _, rank_shapes, rank_ties, _ in everyone:
        every.update(rank_shapes)
        for n, ps in rank_ties.items():
            ties[n] = tuple(dict.fromkeys((*ties.get(n, ()), *ps)))
    match = match_names(every, source.shapes, ties, adapters=adapters)
    _refuse(path, source, match, every, strict, module_type)
    return source, match, ties


def _refuse(
    path: Path,
    source: Source,
    match: NameMatch,
    shapes: Mapping[str, tuple[int, ...]],
    strict: bool,
    module_type: str,
) -> None:
    mismatched = [
        f"{k}: file {list(source.shapes[k])} vs model {list(shapes[n])}"
        for n, k in match.pairs.items()
        if tuple(source.shapes[k]) != tuple(shapes[n])
    ]
    problems = []
    if mismatched:
        problems.append(f"{len(mismatched)} shape mismatch(es): {listing(mismatched)}")
    if strict and match.missing:
        problems.append(f"{len(match.missing)} module tensor(s) missing from the file: {listing(match.missing)}")
    if strict and match.unexpected:
        problems.append(f"{len(match.unexpected)} file tensor(s) the module lacks: {listing(match.unexpected)}")
    if not problems:
        return
    model = f"the model{f' ({module_type})' if module_type else ''}"
    fix = "use a checkpoint of this model's architecture and size"
    if not mismatched:
        fix += (
            "; if the names differ by more than one prefix, rename them; to keep the module's own values for the "
            "missing tensors and skip the extra ones, pass strict=False"
        )
    raise PretrainedError(
        f"{path} ({source.describe()}) does not fit {model} under the name rewrite '{match.rewrite}': "
        f"{'; '.join(problems)}; {fix}"
    )


@torch.no_grad()
def _fill(source: Source, key: str, view: torch.Tensor) -> int:
    """Copy file tensor ``key`` into ``view`` (this rank's part only); the bytes read."""
    sliceable = isinstance(view, DTensor) and not is_fused(view) and source.can_slice(key)
    region = region_of(view) if isinstance(view, DTensor) and sliceable else None
    if region is not None:
        local = dtensors.local(view)
        if local.numel() == 0:
            return 0  # an uneven split left this rank no rows
        part = source.read(key, region)
        local.copy_(part)
        return part.numel() * part.element_size()
    full = source.read(key)
    place_full(full, view)
    return full.numel() * full.element_size()


def _fill_dcp(source: DCPSource, pairs: Mapping[str, str], views: Mapping[str, torch.Tensor]) -> int:
    # Tied names share one storage: DCP loads it once. Fused tensors are stored whole (strided.py), as load_sharded
    # reads them: canonicalize (collective over each tensor's mesh), load, restore.
    state: dict[str, Any] = {}
    seen: set[tuple[int, ...]] = set()
    for name, key in pairs.items():
        if name not in views:
            continue
        skey = _storage_key(views[name])
        if skey is not None and skey in seen:
            continue
        if skey is not None:
            seen.add(skey)
        state[key] = views[name]
    canonical, swaps = canonicalize({"state_dict": state})
    distributed = dist.is_available() and dist.is_initialized()
    try:
        safe_load(canonical, source.path, SafeLoadPlanner(), no_dist=not distributed)
    except CheckpointError as err:
        raise PretrainedError(str(err)) from err
    restore(swaps)
    return sum(dtensors.local(v).numel() * source.dtypes[k].itemsize for k, v in state.items())


@dataclasses.dataclass
class PretrainedPlan:
    """A checkpoint validated against the whole model (`prepare_pretrained`), read part by part with `read_into`.

    Args:
        path: the checkpoint.
        source: its opened files (metadata only until read).
        match: the name match decided on every rank's names.
        pairs: module name -> the file key that fills it (a tied name through its partner's key), every rank's.
        strict: as given to `prepare_pretrained` (the report lists what ``strict=False`` skipped).
    """

    path: Path
    source: Source
    match: NameMatch
    pairs: dict[str, str]
    strict: bool
    _start: float = dataclasses.field(default_factory=time.perf_counter, repr=False)
    _read: int = dataclasses.field(default=0, repr=False)
    _filled: set[str] = dataclasses.field(default_factory=set, repr=False)

    @property
    def names(self) -> frozenset[str]:
        """The module names the file fills (the others keep their own values: recomputed or ``strict=False``)."""
        return frozenset(self.pairs)

    def read_into(self, views: Mapping[str, torch.Tensor]) -> int:
        """Fill ``views`` (any subset of the model's names, in checkpoint view) from the file, in place.

        Only this rank's part of each view is read; names the file does not fill are left as they are. Reading is
        local, except from a sharded lightning_par checkpoint (DCP), where every rank calls it with the same names.

        Returns:
            the bytes of tensor data read.
        """
        pairs = {n: k for n, k in sorted(self.pairs.items()) if n in views}
        if isinstance(self.source, DCPSource):
            read = _fill_dcp(self.source, pairs, views)
        else:
            # Two names over one storage are read once; only within one call, where every view is alive (a freed
            # storage's address may come back for a later call's tensor).
            read, seen = 0, set()
            for name, key in pairs.items():
                skey = _storage_key(views[name])
                if skey is None or skey not in seen:
                    read += _fill(self.source, key, views[name])
                if skey is not None:
                    seen.add(skey)
        self._read += read
        self._filled.update(pairs)
        return read

    def report(self) -> PretrainedReport:
        """What the `read_into` calls so far did on this rank."""
        return PretrainedReport(
            path=str(self.path),
            format=self.source.describe(),
            rewrite=self.match.rewrite,
            tensors=len(self._filled),
            bytes_read=self._read,
            ignored=tuple(self.match.ignored),
            tied=tuple(n for n in self.match.tied if n in self._filled),
            skipped=tuple(self.match.missing + self.match.unexpected) if not self.strict else (),
            fresh=len(self.match.fresh),
            seconds=time.perf_counter() - self._start,
        )


def _prepare(
    path: Path,
    shapes: Mapping[str, tuple[int, ...]],
    local_ties: dict[str, tuple[str, ...]],
    strict: bool,
    module_type: str,
    hf_model: nn.Module | None,
    local_error: str | None,
    start: float,
    adapters: AdapterNames | None = None,
) -> PretrainedPlan:
    source, match, ties = _validate(path, shapes, local_ties, strict, module_type, hf_model, local_error, adapters)
    pairs = dict(match.pairs)
    for name in match.tied:  # the partner's file tensor; read once when the two share storage (read_into)
        pairs[name] = pairs[next(p for p in ties[name] if p in match.pairs)]
    return PretrainedPlan(path, source, match, pairs, strict, _start=start)


def prepare_pretrained(
    path: str | Path,
    shapes: Mapping[str, Sequence[int]],
    *,
    module_type: str = "",
    tied: Mapping[str, str] | None = None,
    strict: bool = True,
    hf_model: nn.Module | None = None,
    adapters: AdapterNames | None = None,
) -> PretrainedPlan:
    """The first step of `load_pretrained` alone: open ``path`` and validate it against the whole model, on metadata.

    For a model that gets its storage part by part (DeepSpeed's ZeRO-3 partitions a meta-built model unit by
    unit, `lightning_par.parallel.deepspeed.meta_init`): validate before anything is allocated, then fill each part with
    ``plan.read_into(views)`` once it exists. Collective when a process group is initialised.

    Args:
        path: as in `load_pretrained`.
        shapes: this rank's module names in checkpoint view and their full shapes (tensors on the meta device
            have them); the ranks' names are united.
        module_type: as in `load_pretrained`.
        tied: module name -> the module name sharing its tensor (both directions), since meta tensors have no storage
            to tell; a name missing from the file is filled through its partner.
        strict: as in `load_pretrained`.
        hf_model: as in `load_pretrained`.
        adapters: as in `load_pretrained`.

    Raises:
        PretrainedError: as `load_pretrained`, on every rank alike, before any tensor is read.
    """
    start = time.perf_counter()
    local_ties: dict[str, tuple[str, ...]] = {}
    for name, other in (tied or {}).items():
        local_ties[name] = (*local_ties.get(name, ()), other)
    sizes = {n: tuple(int(d) for d in s) for n, s in shapes.items()}
    return _prepare(Path(path), sizes, local_ties, strict, module_type, hf_model, None, start, adapters)


def load_pretrained(
    path: str | Path,
    views: Mapping[str, torch.Tensor],
    *,
    module_type: str = "",
    tied: Mapping[str, str] | None = None,
    strict: bool = True,
    hf_model: nn.Module | None = None,
    adapters: AdapterNames | None = None,
) -> PretrainedReport:
    """Fill ``views`` in place with the pretrained weights at ``path``, reading only what this rank owns.

    `prepare_pretrained` and `PretrainedPlan.read_into` in one. Collective when a process group is initialised:
    every rank of the world calls it, with its own views.

    Args:
        path: a Hugging Face folder (``model.safetensors`` or a sharded ``model.safetensors.index.json``), a
            ``.safetensors`` file, a file written by ``lightning-par consolidate``, or a sharded lightning_par
            checkpoint folder (see `lightning_par.checkpoint.pretrained.sources`).
        views: the model's state dict in checkpoint view (``lightning_par.checkpoint.dcp.model_state``): the module's
            names, each a full-shape tensor or a DTensor of the full shape. Names tied to one storage need only one
            of them in the file (Hugging Face leaves out ``lm_head.weight`` when it is tied).
        module_type: the model's class name, for messages (``"LlamaForCausalLM"``).
        tied: module name -> module name whose file tensor fills it when the file lacks it: a tied weight that this
            rank holds as its own copy (a pipeline's last stage holding the output head tied to the embedding).
        strict: refuse missing and unexpected tensors (the default). ``False``: missing ones keep their values,
            unexpected ones are skipped, both are listed in the report. Shape mismatches are always refused.
        hf_model: the Hugging Face model the views are of, or a module holding it (the LightningModule): a file in
            another layout than its modules (transformers 5 saves MoE experts one by one, and holds them stacked) is
            converted by transformers' own checkpoint conversion mapping for it
            (`lightning_par.checkpoint.pretrained.convert`). ``None``: the file's names are read as they are.
        adapters: the model's low-rank adapters (`lightning_par.parallel.tensor.adapters.adapter_names`): a base
            checkpoint fills the wrapped layers under their unwrapped names, and the adapters keep their own values.

    Returns:
        what was read, printable as one start-up log line.

    Raises:
        PretrainedError: the path is in no accepted format; a file is missing, truncated or corrupt; or the names or
            shapes do not fit the model. Raised on every rank alike, before any tensor is read.
    """
    start = time.perf_counter()
    path = Path(path)
    local_ties = _ties(views)
    for name, other in (tied or {}).items():
        local_ties[name] = (*local_ties.get(name, ()), other)
    meta = [n for n, v in views.items() if dtensors.local(v).device.type == "meta"]
    error = None
    if meta:
        error = (
            f"{len(meta)} tensor(s) are still on the meta device ({listing(meta, 3)}): materialise the model "
            "(to_empty) before filling it with pretrained weights, or use prepare_pretrained() with their shapes "
            "and read each part once it has storage"
        )
    shapes = {n: tuple(v.shape) for n, v in views.items()}
    plan = _prepare(path, shapes, local_ties, strict, module_type, hf_model, error, start, adapters)
    plan.read_into(views)
    return plan.report()
