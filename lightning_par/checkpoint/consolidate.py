"""Turn a sharded checkpoint folder into one plain Lightning checkpoint file that needs no lightning_par to load.

``lightning-par consolidate CKPT_DIR OUT`` (or `consolidate`) writes ``OUT``: Lightning's checkpoint dict with
full tensors (``state_dict`` keyed by the original names, ``optimizer_states`` in torch's own id-keyed format,
loops, schedulers, ``hyper_parameters``), so ``MyModule.load_from_checkpoint(OUT)`` and
``Trainer(...).fit(model, ckpt_path=OUT)`` work on one device. With the ``safetensors`` package installed it also
writes the weights alone to ``OUT.safetensors``.

Of a checkpoint trained with local SGD (``sync_every``), the weights are the anchor theta (the weights of the last
synchronisation, the same for every replica) and the optimizer state is replica 0's; the other replicas' weights and
state and the outer momentum are left out, with a warning (a fit resumed from the file trains without local SGD).

It runs in one process with no process group, and holds the whole model and optimizer state in memory at once
(about 3x the fp32 weights for Adam): run it on a machine with that much RAM, not inside every rank of a job.
"""

from __future__ import annotations

import argparse
import itertools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from lightning_par.checkpoint import checksums
from lightning_par.checkpoint.dcp import LOCAL_SGD
from lightning_par.checkpoint.reader import CheckpointError, SafeLoadPlanner, read_index, read_meta, safe_load
from lightning_par.checkpoint.resume_state import KEY


def _slot(node: Any, key: Any, default: Any) -> Any:
    if isinstance(node, list):
        node.extend([None] * (key + 1 - len(node)))
        if node[key] is None:
            node[key] = default
        return node[key]
    return node.setdefault(key, default)


def _unflatten(flat: dict[str, Any], paths: dict[str, tuple[Any, ...]]) -> dict[str, Any]:
    # DCP records each flat key's path; an int step is a list index (``param_groups.0.lr``).
    root: dict[str, Any] = {}
    for key, value in flat.items():
        path = paths.get(key, (key,))
        node: Any = root
        for part, nxt in itertools.pairwise(path):
            node = _slot(node, part, [] if isinstance(nxt, int) else {})
        _slot(node, path[-1], None)
        node[path[-1]] = value
    return root


def load_full_state(ckpt_dir: Union[str, Path]) -> dict[str, Any]:
    """Read a sharded checkpoint folder into one process as full tensors, keyed by the original names.

    Args:
        ckpt_dir: the folder written by ``trainer.save_checkpoint`` / ``ModelCheckpoint`` under ParallelStrategy.

    Returns:
        ``meta.pt``'s entries plus ``state_dict`` (name -> tensor) and ``optimizer_<i>``
        (``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``).
    """
    path = Path(ckpt_dir)
    index = read_index(path)
    checksums.verify(Path(path))  # one process: every file
    meta = read_meta(path)
    flat: dict[str, Any] = {
        key: torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
        for key, md in index.state_dict_metadata.items()
    }
    # The keys above are already DCP's flat keys, and bytes must land in this very dict: no flattening; `_unflatten`
    # restores the nesting.
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*load in a single process")
        safe_load(flat, path, SafeLoadPlanner(flatten_state_dict=False, flatten_sharded_tensors=False), no_dist=True)
    paths = index.planner_data if isinstance(index.planner_data, dict) else {}
    return {**meta, **_unflatten(flat, paths)}


def to_torch_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """A name-keyed optimizer state (`load_full_state`'s ``optimizer_<i>``) in ``Optimizer.state_dict()`` format.

    torch numbers parameters in the order of the param groups; the saved groups list the names in that order, so
    the same optimizer built over the plain model (same ``configure_optimizers``) loads it.

    Args:
        state: ``{"state": {name: {...}}, "param_groups": [{..., "params": [names]}]}``.
    """
    ids: dict[str, int] = {}
    groups = []
    for group in state["param_groups"]:
        groups.append({**group, "params": [ids.setdefault(name, len(ids)) for name in group["params"]]})
    return {
        "state": {ids[name]: s for name, s in state.get("state", {}).items() if name in ids},
        "param_groups": groups,
    }


def consolidate(
    ckpt_dir: Union[str, Path], out_file: Union[str, Path], safetensors: Optional[bool] = None
) -> list[Path]:
    """Write a sharded checkpoint folder as one plain Lightning checkpoint file.

    Args:
        ckpt_dir: the sharded folder.
        out_file: the file to write (``torch.save`` format, loadable with ``weights_only=True``).
        safetensors: also write the weights to ``<out_file>.safetensors``. ``None``: if the ``safetensors``
            package is installed; ``True`` raises when it is not.

    Returns:
        the files written: ``out_file``, then ``<out_file>.safetensors`` if it was written.
    """
    save_file = _safetensors_writer(required=bool(safetensors)) if safetensors is not False else None
    state = _without_replicas(load_full_state(ckpt_dir), ckpt_dir)
    optimizers = sorted((k for k in state if k.startswith("optimizer_")), key=lambda k: int(k.split("_")[1]))
    checkpoint = {k: v for k, v in state.items() if k not in optimizers}
    checkpoint.setdefault("state_dict", {})
    if optimizers:
        checkpoint["optimizer_states"] = [to_torch_optimizer_state(state[k]) for k in optimizers]
    out = Path(out_file)
    out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, out)
    written = [out]
    if save_file is not None:
        weights = out.with_name(out.name + ".safetensors")
        save_file(
            {k: v.contiguous() for k, v in checkpoint["state_dict"].items() if isinstance(v, torch.Tensor)},
            str(weights),
        )
        written.append(weights)
    return written


def _without_replicas(state: dict[str, Any], ckpt_dir: Union[str, Path]) -> dict[str, Any]:
    """Local SGD's per-replica state (`LOCAL_SGD`) replaced by replica 0's optimizers; the weights are theta."""
    replicas = state.pop(LOCAL_SGD, None)
    if replicas is None:
        return state
    counts = state.get(KEY, {}).get(LOCAL_SGD, {})
    warnings.warn(
        f"{ckpt_dir} was trained with local SGD (sync_every={counts.get('every')}, {counts.get('replicas')} replicas): "
        "the consolidated weights are the anchor of the last synchronisation, the optimizer state is replica 0's; "
        "the replicas' own weights and the outer momentum are left out, so a fit resumed from it trains without "
        "local SGD",
        stacklevel=3,
    )
    first = replicas.get("replica_0", {})
    return {**state, **{k: v for k, v in first.items() if k.startswith("optimizer_")}}


def _safetensors_writer(required: bool) -> Optional[Callable[..., None]]:
    try:
        from safetensors.torch import save_file
    except ImportError:
        if required:
            raise ImportError(
                "writing OUT.safetensors needs the safetensors package; pip install safetensors, or pass "
                "--no-safetensors"
            ) from None
        return None
    return save_file


def main(argv: Optional[Sequence[str]] = None) -> None:
    """``lightning-par consolidate CKPT_DIR OUT [--format lightning|hf|peft] [--safetensors | --no-safetensors]``."""
    from lightning_par.checkpoint import export_hf
    from lightning_par.checkpoint.adapters import export_peft

    parser = argparse.ArgumentParser(
        prog="lightning-par consolidate",
        description="Write a sharded lightning_par checkpoint folder as one plain Lightning checkpoint file, "
        "(--format hf) as a Hugging Face folder that from_pretrained loads, or (--format peft) its LoRA adapter as "
        "a folder peft's PeftModel.from_pretrained loads.",
    )
    parser.add_argument("ckpt_dir", help="checkpoint folder written under ParallelStrategy")
    parser.add_argument(
        "out", help="file to write (loads with MyModule.load_from_checkpoint(OUT)); with --format hf, a folder"
    )
    parser.add_argument(
        "--format",
        choices=("lightning", "hf", "peft"),
        default="lightning",
        help="lightning (default): one Lightning checkpoint file; hf: a Hugging Face folder of safetensors weights; "
        "peft: the LoRA adapter alone, a folder peft.PeftModel.from_pretrained loads",
    )
    parser.add_argument("--adapter", help="--format peft: the adapter's name, where the model holds several")
    parser.add_argument(
        "--safetensors",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also write OUT.safetensors with the weights (default: if the safetensors package is installed)",
    )
    export_hf.add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        if args.format == "hf":
            written = list(export_hf.run(args))
        elif args.format == "peft":
            written = export_peft(args.ckpt_dir, args.out, args.adapter)
        else:
            written = consolidate(args.ckpt_dir, args.out, safetensors=args.safetensors)
    except (CheckpointError, ImportError) as err:
        parser.exit(2, f"lightning-par consolidate: error: {err}\n")
    if args.format in ("hf", "peft"):
        print(f"wrote {args.out}: " + ", ".join(p.name for p in written))
        return
    note = "" if len(written) > 1 else " (no .safetensors: the safetensors package is not installed, or turned off)"
    print("wrote " + " and ".join(map(str, written)) + note)
