"""Low-rank adapters out of a sharded checkpoint, in PEFT's own folder format.

A checkpoint saved under `lightning_par.ParallelStrategy` from a LightningModule that holds a model wrapped by
``peft.get_peft_model`` records each such model's adapter configurations (`adapter_configs`, in ``meta.pt`` under
``lightning_par_adapters``: the JSON ``PeftConfig.save_pretrained`` writes). ``lightning-par consolidate CKPT_DIR
OUT --format peft [--adapter NAME]`` then writes ``OUT/adapter_model.safetensors`` and ``OUT/adapter_config.json``,
which ``peft.PeftModel.from_pretrained(base_model, OUT)`` loads unchanged: the adapter tensors only (read with DCP,
whole, from whatever layout saved them), under PEFT's names. PEFT's names are the module's own with the adapter name
taken out (``...q_proj.lora_A.default.weight`` -> ``...q_proj.lora_A.weight``) and, for DoRA's magnitude, the
``.weight`` of its module too (``lora_magnitude_vector``), as ``peft.get_peft_model_state_dict`` writes them.

LoRA and DoRA adapters are written; other PEFT methods, ``modules_to_save`` and trained biases are refused with the
fix (the whole model: ``--format hf``). The folder is written as ``OUT.tmp`` and renamed when complete.
"""

from __future__ import annotations

import json
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_par.checkpoint.reader import CheckpointError, SafeLoadPlanner, read_index, read_meta, safe_load

ADAPTERS = "lightning_par_adapters"  # meta.pt entry: {peft model's path: {adapter name: config JSON}}
WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PEFT's file names
_PREFIX = "state_dict."


def adapter_configs(module: nn.Module) -> dict[str, dict[str, str]]:
    """Each PEFT model inside ``module`` (its path; ``""``: the module itself) -> adapter name -> its configuration
    as the JSON PEFT writes. Found by what PEFT models have (a ``peft_config`` dict of configs and a ``base_model``),
    the outermost of nested ones."""
    found: dict[str, dict[str, str]] = {}
    for path, mod in module.named_modules():
        configs = getattr(mod, "peft_config", None)
        if any(path.startswith(f"{p}.") or not p for p in found) or not hasattr(mod, "base_model"):
            continue
        if isinstance(configs, dict) and configs and all(hasattr(c, "to_dict") for c in configs.values()):
            found[path] = {name: _json(config) for name, config in configs.items()}
    return found


def _json(config: Any) -> str:
    # As PeftConfigMixin.save_pretrained: sets as lists, sorted keys.
    data = {k: sorted(v) if isinstance(v, set) else v for k, v in config.to_dict().items()}
    return json.dumps(data, indent=2, sort_keys=True, default=str)


def _choose(ckpt: Path, found: dict[str, dict[str, str]], adapter: Optional[str]) -> tuple[str, str, dict[str, Any]]:
    if not found:
        raise CheckpointError(
            f"{ckpt} records no PEFT adapter: it was saved from a model not wrapped by peft.get_peft_model, or by an "
            "earlier lightning_par; write the whole model with --format hf"
        )
    names = [(path, name) for path, configs in found.items() for name in configs]
    picked = [(p, n) for p, n in names if adapter is None or n == adapter]
    if len(picked) != 1:
        listed = ", ".join(f"{n!r}" + (f" (in {p})" if p else "") for p, n in names)
        why = f"no adapter {adapter!r}" if adapter is not None else "several adapters"
        raise CheckpointError(f"{ckpt} holds {why}: {listed}; pass --adapter NAME")
    path, name = picked[0]
    config = json.loads(found[path][name])
    if config.get("peft_type") != "LORA":
        raise CheckpointError(
            f"adapter {name!r} is {config.get('peft_type')}: --format peft writes LoRA (and DoRA) adapters; write the "
            "whole model with --format hf"
        )
    if config.get("modules_to_save") or config.get("bias", "none") != "none":
        raise CheckpointError(
            f"adapter {name!r} also trains whole modules (modules_to_save) or biases, which --format peft does not "
            "write yet; write the whole model with --format hf"
        )
    return path, name, config


def peft_names(keys: Sequence[str], path: str, adapter: str) -> dict[str, str]:
    """Checkpoint keys (``state_dict.<name>``) of the LoRA tensors of ``adapter`` in the PEFT model at ``path`` ->
    their names in PEFT's file."""
    base = f"{_PREFIX}{path}." if path else _PREFIX
    out: dict[str, str] = {}
    for key in keys:
        parts = key[len(base) :].split(".") if key.startswith(base) else []
        hits = [i for i, part in enumerate(parts) if part == adapter and i > 0 and parts[i - 1].startswith("lora_")]
        if not hits:
            continue
        name = ".".join(parts[: hits[0]] + parts[hits[0] + 1 :])
        out[key] = name[: -len(".weight")] if name.endswith("lora_magnitude_vector.weight") else name
    return out


def export_peft(ckpt_dir: str | Path, out: str | Path, adapter: Optional[str] = None) -> list[Path]:
    """Write the LoRA adapter of the checkpoint folder ``ckpt_dir`` as a PEFT folder ``out``.

    Args:
        ckpt_dir: a checkpoint folder written under `lightning_par.ParallelStrategy` (any layout).
        out: the folder to write (replaced if it exists).
        adapter: the adapter's name, where the checkpoint holds more than one.

    Returns:
        the files written.

    Raises:
        CheckpointError: no adapter recorded, several without ``adapter``, another PEFT method, or no tensor found.
    """
    ckpt, out = Path(ckpt_dir), Path(out)
    index = read_index(ckpt)
    path, name, config = _choose(ckpt, read_meta(ckpt).get(ADAPTERS) or {}, adapter)
    entries = {k: md for k, md in index.state_dict_metadata.items() if isinstance(md, TensorStorageMetadata)}
    renamed = peft_names(list(entries), path, name)
    if not renamed:
        raise CheckpointError(f"{ckpt} holds no tensor of adapter {name!r}: was it saved before the adapters existed?")
    flat = {k: torch.empty(entries[k].size, dtype=entries[k].properties.dtype) for k in renamed}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*load in a single process")
        safe_load(flat, ckpt, SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file({renamed[k]: t.contiguous() for k, t in flat.items()}, str(tmp / WEIGHTS), metadata={"format": "pt"})
    (tmp / CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))
    if out.exists():
        shutil.rmtree(out)
    tmp.rename(out)
    return [out / WEIGHTS, out / CONFIG]
