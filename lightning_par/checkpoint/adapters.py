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

import dataclasses
import json
import shutil
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_par.checkpoint import checksums
from lightning_par.checkpoint.fast_state import clean_name
from lightning_par.checkpoint.reader import CheckpointError, SafeLoadPlanner, read_index, read_meta, safe_load

ADAPTERS = "lightning_par_adapters"  # meta.pt entry: {peft model's path: {adapter name: config JSON}}
# meta.pt entry of a checkpoint saved with checkpoint_frozen=False: {"count": frozen parameters left out, "pretrained":
# the resolved path of the base they come from again}.
FROZEN_LEFT_OUT = "lightning_par_frozen_left_out"

WEIGHTS, CONFIG = "adapter_model.safetensors", "adapter_config.json"  # PEFT's file names
_PREFIX = "state_dict."


def frozen_names(module: nn.Module) -> frozenset[str]:
    """The names (as in checkpoints) of ``module``'s parameters that do not train (``requires_grad=False``)."""
    return frozenset(clean_name(n) for n, p in module.named_parameters() if not p.requires_grad)


def peft_models(module: nn.Module) -> list[tuple[str, nn.Module, dict[str, Any]]]:
    """The PEFT models inside ``module``: (path, ``""`` for the module itself; the model; its ``peft_config``,
    adapter name -> config). Found by what PEFT models have (a ``peft_config`` dict of configs and a
    ``base_model``), the outermost of nested ones; what checkpoints record and meta-device set-up initialises."""
    found: list[tuple[str, nn.Module, dict[str, Any]]] = []
    for path, mod in module.named_modules():
        configs = getattr(mod, "peft_config", None)
        if any(path.startswith(f"{p}.") or not p for p, _, _ in found) or not hasattr(mod, "base_model"):
            continue
        if isinstance(configs, dict) and configs and all(hasattr(c, "to_dict") for c in configs.values()):
            found.append((path, mod, configs))
    return found


def adapter_configs(module: nn.Module) -> dict[str, dict[str, str]]:
    """Each PEFT model inside ``module`` (`peft_models`) -> adapter name -> its configuration as the JSON PEFT
    writes."""
    return {path: {name: _json(c) for name, c in configs.items()} for path, _, configs in peft_models(module)}


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
    checksums.verify(Path(ckpt))  # one process: every file
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


@dataclasses.dataclass
class Merge:
    """The base model's weights from a PEFT model's checkpoint, each adapter merged into its base layer
    (``--format hf --merge-adapters``).

    Args:
        source: each weight's name in the unwrapped model (the PEFT wrapper and ``base_layer`` taken out) -> the
            checkpoint name it is read from.
        lora: merged weights' names -> (``lora_A``, ``lora_B``, DoRA's magnitude or ``None``, scale), checkpoint
            names.
    """

    source: dict[str, str]
    lora: dict[str, tuple[str, str, Optional[str], float]]

    def keys(self, name: str) -> list[str]:
        """The checkpoint names ``name``'s value is computed from."""
        extra = self.lora.get(name)
        return [self.source[name], *(k for k in (extra or ())[:3] if isinstance(k, str))]

    def value(self, name: str, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """``W + scale * B @ A`` (LoRA), scaled row by row to DoRA's magnitude where there is one, from ``tensors``
        (read by `keys`), in fp32 and cast back to the base weight's dtype (as peft's ``merge_and_unload``)."""
        base = tensors[self.source[name]]
        if name not in self.lora:
            return base
        a, b, magnitude, scale = self.lora[name]
        weight = base.float() + scale * (tensors[b].float() @ tensors[a].float())
        if magnitude is not None:  # DoRA: each output row rescaled to its magnitude (Liu et al., arXiv 2402.09353)
            weight = weight * (tensors[magnitude].float() / torch.linalg.norm(weight, dim=1)).unsqueeze(1)
        return weight.to(base.dtype)


def merge_plan(ckpt: Path, shapes: dict[str, tuple[int, ...]], adapter: Optional[str]) -> Merge:
    """How to write the unwrapped base model of the PEFT model in checkpoint ``ckpt``, from its model weights'
    names and shapes (``shapes``: names without ``state_dict.``)."""
    meta = read_meta(ckpt)
    if meta.get(FROZEN_LEFT_OUT):
        raise CheckpointError(
            f"{ckpt} holds the trained weights only (saved with checkpoint_frozen=False): the base to merge into is "
            "not in it; write the adapter with --format peft and merge it onto the base with PEFT "
            "(PeftModel.from_pretrained(base, OUT).merge_and_unload())"
        )
    path, name, config = _choose(ckpt, meta.get(ADAPTERS) or {}, adapter)
    if config.get("fan_in_fan_out") or config.get("alpha_pattern") or config.get("rank_pattern"):
        raise CheckpointError(
            f"adapter {name!r} sets fan_in_fan_out, alpha_pattern or rank_pattern, which --merge-adapters does not "
            "merge yet; write the adapter with --format peft and merge it with peft's merge_and_unload"
        )
    wrapper = f"{path}.base_model.model." if path else "base_model.model."
    outer = f"{path}." if path else ""
    source: dict[str, str] = {}
    for key in shapes:
        if ".lora_" in f".{key}":
            continue  # the adapters (this one and any other) go into the merged weights, or nowhere
        plain = outer + key[len(wrapper) :] if key.startswith(wrapper) else key
        source[plain.replace(".base_layer.", ".")] = key
    lora: dict[str, tuple[str, str, Optional[str], float]] = {}
    alpha, rslora = float(config["lora_alpha"]), bool(config.get("use_rslora"))
    for plain, key in source.items():
        stem = key[: -len("base_layer.weight")] if key.endswith(".base_layer.weight") else None
        a, b = f"{stem}lora_A.{name}.weight", f"{stem}lora_B.{name}.weight"
        if stem is None or a not in shapes or b not in shapes:
            continue
        r = shapes[a][0]  # the adapter's rank, from its own shape
        magnitude = f"{stem}lora_magnitude_vector.{name}.weight"
        lora[plain] = (a, b, magnitude if magnitude in shapes else None, alpha / (r**0.5 if rslora else r))
    if not lora:
        raise CheckpointError(f"{ckpt}: no base layer of adapter {name!r} found to merge into")
    return Merge(source, lora)
