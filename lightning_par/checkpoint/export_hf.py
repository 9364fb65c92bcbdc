"""Write a sharded lightning_par checkpoint as a Hugging Face folder that ``from_pretrained`` loads unchanged.

``lightning-par consolidate CKPT_DIR OUT --format hf [--config CONFIG] [--prefix P] [--max-shard-size 5GB]`` writes
``OUT/model.safetensors`` (or ``model-0000i-of-0000n.safetensors`` shards and ``model.safetensors.index.json`` past
``--max-shard-size``) and copies ``config.json`` (and ``generation_config.json`` when it is next to it).

Names: the checkpoint holds the LightningModule's names (``model.model.layers.0...`` for a module that keeps the
Hugging Face model as ``self.model``); the folder must hold the Hugging Face model's (``model.layers.0...``). The
wrapper prefix is taken off:

- ``--prefix P``: exactly ``P`` (every weight must be under it; ``--prefix ''`` keeps the names);
- otherwise, with ``--config`` and ``transformers`` installed: the model the config names is built on the meta device
  (no memory, no download) and the prefix that maps the checkpoint's names onto its names is chosen
  (`lightning_par.checkpoint.pretrained.names.choose_rewrite`), and the result is checked key by key;
- otherwise: the one first name part that every weight shares (``model.``), when there is one.

Tied weights (the output head and the embedding) are written once, as ``save_pretrained`` does: the names the model
built from ``--config`` ties to an earlier name are left out (without a config both copies are written, which
``from_pretrained`` loads as well).

MoE experts are written stacked, under the module's own names (``mlp.experts.gate_up_proj``): transformers 5's
``from_pretrained`` loads them as they are (its conversion mapping rewrites only the per-expert layout it saves).

Memory: shards are planned from the index's sizes, then each shard's tensors are read (DCP, only those keys), written
and dropped before the next, so the peak is one shard (or one tensor larger than a shard), never the model. Runs in
one process with no process group. The folder is written as ``OUT.tmp`` and renamed when complete.
"""

from __future__ import annotations

import json
import re
import shutil
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_par.checkpoint import checksums
from lightning_par.checkpoint.adapters import Merge, merge_plan
from lightning_par.checkpoint.pretrained.names import PrefixRewrite, choose_rewrite, listing
from lightning_par.checkpoint.pretrained.sources import SAFETENSORS, SAFETENSORS_INDEX
from lightning_par.checkpoint.reader import CheckpointError, SafeLoadPlanner, read_index, safe_load

_PREFIX = "state_dict."
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(size: int | str) -> int:
    """Bytes in ``size``: an int, or ``"20KB"``, ``"500MB"``, ``"5GB"`` (powers of 10, as Hugging Face) or ``"1GiB"``.

    Raises:
        CheckpointError: not a size.
    """
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*", size.upper())
    if m is None or m.group(2) not in _UNITS:
        raise CheckpointError(f"--max-shard-size {size!r} is not a size; write e.g. 5GB, 500MB or 20KB")
    return int(float(m.group(1)) * _UNITS[m.group(2)])


def _config_file(config: str | Path) -> Path:
    path = Path(config)
    file = path / "config.json" if path.is_dir() else path
    if not file.is_file():
        raise CheckpointError(f"--config {config}: no config.json there; pass the config.json or its folder")
    return file


def _hf_model_names(config_file: Path) -> tuple[list[str], set[str]] | None:
    """The state-dict names of the model ``config_file`` describes and those tied to an earlier name; ``None``
    without transformers."""
    try:
        import transformers
    except ImportError:
        return None
    config = transformers.AutoConfig.from_pretrained(str(config_file.parent))
    arch = (getattr(config, "architectures", None) or [None])[0]
    cls: Any = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        model = cls._from_config(config) if cls is not None else transformers.AutoModelForCausalLM.from_config(config)
    first: dict[int, str] = {}
    tied = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        if first.setdefault(id(param), name) != name:
            tied.add(name)
    return list(model.state_dict()), tied


def _rewrite(names: list[str], prefix: str | None, hf: tuple[list[str], set[str]] | None) -> PrefixRewrite:
    if prefix is not None:
        outside = [n for n in names if not n.startswith(prefix)]
        if outside:
            raise CheckpointError(
                f"{len(outside)} weight(s) are not under --prefix {prefix!r} ({listing(outside, 4)}); pass the prefix "
                "every weight shares, or --prefix '' to keep the names"
            )
        return PrefixRewrite(module=prefix)
    if hf is not None:
        return choose_rewrite(names, hf[0])
    heads = {n.split(".", 1)[0] for n in names}
    return (
        PrefixRewrite(module=f"{heads.pop()}.") if len(heads) == 1 and all("." in n for n in names) else PrefixRewrite()
    )


def _check(ckpt: Path, renamed: dict[str, str], hf: tuple[list[str], set[str]], config: Path) -> None:
    want = [n for n in hf[0] if n not in hf[1]]
    missing = sorted(set(want) - set(renamed.values()))
    unexpected = sorted(set(renamed.values()) - set(hf[0]))
    if missing or unexpected:
        raise CheckpointError(
            f"{ckpt} does not hold the model {config} describes: {len(missing)} missing ({listing(missing, 6)}), "
            f"{len(unexpected)} unexpected ({listing(unexpected, 6)}); pass the config of the trained model, or "
            "--prefix with the LightningModule attribute that holds the Hugging Face model (e.g. --prefix model.)"
        )


def _plan(sizes: dict[str, int], limit: int) -> list[list[str]]:
    shards: list[list[str]] = [[]]
    used = 0
    for key, size in sizes.items():
        if shards[-1] and used + size > limit:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += size
    return shards


def export_hf(
    ckpt_dir: str | Path,
    out_dir: str | Path,
    *,
    config: str | Path | None = None,
    prefix: str | None = None,
    max_shard_size: int | str = "5GB",
    save_file: Callable[..., None] | None = None,
    merge_adapters: bool = False,
    adapter: str | None = None,
) -> list[Path]:
    """Write the model weights of a sharded checkpoint folder as a Hugging Face folder, one shard at a time.

    Args:
        ckpt_dir: the sharded folder (``trainer.save_checkpoint`` under ParallelStrategy).
        out_dir: the folder to write; must not exist yet, or be empty.
        config: the model's ``config.json`` or a folder holding it; copied, and used to name and check the weights.
        prefix: the LightningModule's prefix to take off every name (``"model."``); ``None``: chosen (module docs).
        max_shard_size: bytes per safetensors file (``"5GB"``); a larger tensor gets a file of its own.
        merge_adapters: the checkpoint's model is wrapped by ``peft.get_peft_model``: write the base model with its
            LoRA / DoRA adapter merged in (`lightning_par.checkpoint.adapters.merge_plan`; ``adapter`` names it
            where there are several).
        save_file: writes one shard (default ``safetensors.torch.save_file``); tests pass a recorder.

    Returns:
        the files written.

    Raises:
        CheckpointError: the checkpoint is damaged, the names do not fit the config's model, or ``out_dir`` is in use.
    """
    ckpt, out = Path(ckpt_dir), Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty folder; remove it or choose another OUT")
    if save_file is None:
        from safetensors.torch import save_file as write
    else:
        write = save_file
    index = read_index(ckpt)
    checksums.verify(Path(ckpt))  # one process: every file
    entries = {
        k: md
        for k, md in index.state_dict_metadata.items()
        if k.startswith(_PREFIX) and isinstance(md, TensorStorageMetadata)
    }
    names = [k[len(_PREFIX) :] for k in entries]
    if not names:
        raise CheckpointError(f"{ckpt} holds no model weights (no {_PREFIX}* tensors); pass a training checkpoint")
    # The weights as named in the written model -> how each is computed from the checkpoint's tensors.
    plain = Merge({n: n for n in names}, {})
    if merge_adapters:
        plain = merge_plan(ckpt, {n: tuple(entries[_PREFIX + n].size) for n in names}, adapter)
        names = list(plain.source)
    config_file = _config_file(config) if config is not None else None
    hf = _hf_model_names(config_file) if config_file is not None else None
    rewrite = _rewrite(names, prefix, hf)
    renamed = {n: rewrite.to_file(n) or n for n in names}
    if hf is not None:
        renamed = {n: k for n, k in renamed.items() if k not in hf[1]}  # tied copies: written once, as HF does
        _check(ckpt, renamed, hf, config_file)  # type: ignore[arg-type]
    stored = {n: entries[_PREFIX + plain.source[n]] for n in renamed}
    sizes = {n: md.size.numel() * md.properties.dtype.itemsize for n, md in stored.items()}
    shards = _plan(sizes, parse_size(max_shard_size))
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    files = [SAFETENSORS] if len(shards) == 1 else [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in
                                                    range(1, len(shards) + 1)]  # fmt: skip
    weight_map: dict[str, str] = {}
    for file, shard in zip(files, shards):
        flat = {_PREFIX + k: torch.empty(entries[_PREFIX + k].size, dtype=entries[_PREFIX + k].properties.dtype)
                for n in shard for k in plain.keys(n)}  # fmt: skip
        with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
            warnings.filterwarnings("ignore", message=".*load in a single process")
            safe_load(
                flat, ckpt, SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True
            )
        read = {k[len(_PREFIX) :]: t for k, t in flat.items()}
        tensors = {renamed[n]: plain.value(n, read).contiguous() for n in shard}
        write(tensors, str(tmp / file), metadata={"format": "pt"})
        weight_map.update({renamed[n]: file for n in shard})
        del flat  # before the next shard is read: one shard in memory at a time
    if len(shards) > 1:
        total = {"total_size": sum(sizes.values())}
        (tmp / SAFETENSORS_INDEX).write_text(json.dumps({"metadata": total, "weight_map": weight_map}, indent=2))
        files.append(SAFETENSORS_INDEX)
    if config_file is not None:
        for name in ("config.json", "generation_config.json"):
            src = config_file if name == "config.json" else config_file.parent / name
            if src.is_file():
                shutil.copyfile(src, tmp / name)
                files.append(name)
    if out.exists():
        out.rmdir()  # empty, checked above
    tmp.rename(out)
    return [out / f for f in files]


def add_arguments(parser: Any) -> None:
    """The ``--format hf`` options of ``lightning-par consolidate``."""
    parser.add_argument("--config", help="--format hf: the model's config.json or its folder (copied; names checked)")
    parser.add_argument(
        "--prefix", help="--format hf: prefix to take off every name (default: chosen, see `lightning-par` docs)"
    )
    parser.add_argument("--max-shard-size", default="5GB", help="--format hf: bytes per safetensors file (5GB)")
    parser.add_argument(
        "--merge-adapters",
        action="store_true",
        help="--format hf, for a model wrapped by peft.get_peft_model: the base model with its LoRA adapter merged in",
    )


def run(args: Any) -> Sequence[Path]:
    """``lightning-par consolidate CKPT_DIR OUT --format hf``: the parsed ``args`` of `add_arguments`."""
    return export_hf(
        args.ckpt_dir, args.out, config=args.config, prefix=args.prefix, max_shard_size=args.max_shard_size,
        merge_adapters=args.merge_adapters, adapter=args.adapter,
    )  # fmt: skip
