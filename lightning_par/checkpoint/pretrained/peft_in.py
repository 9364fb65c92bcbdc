"""Existing adapters into a layout: a PEFT folder (``PeftModel.save_pretrained``'s ``adapter_model.safetensors``)
read after the base, into the adapted model's own adapter tensors.

``pretrained=["base_folder", "adapter_folder"]``: the first source fills the base weights (the adapters keep their
values, `lightning_par.checkpoint.pretrained.names.AdapterNames`); each later one is a PEFT adapter folder and fills
the adapters. PEFT saves an adapter without its name: the module's ``q_proj.lora_A.default.weight`` is the file's
``q_proj.lora_A.weight``, DoRA's ``lora_magnitude_vector.default.weight`` its ``lora_magnitude_vector``; the prefix
(``base_model.model.``) is found as for any checkpoint. Every adapter tensor of the model must be in the file and
every tensor of the file must be an adapter of the model, shapes included (a different rank ``r`` or other target
modules are refused, naming them), before anything is read.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Optional, Union

from lightning_par.checkpoint.pretrained.names import AdapterNames
from lightning_par.checkpoint.pretrained.sources import PretrainedError

ADAPTER_FILE = "adapter_model.safetensors"
_PARTS = "lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector"
_NAMED = re.compile(rf"\.({_PARTS})\.([^.]+)(\.weight|\.bias)?$")

Sources = Union[str, Sequence[str], None]


def base_source(pretrained: Sources) -> Optional[str]:
    """The base checkpoint of a ``pretrained=`` argument (a list's first source), unchecked; ``None`` without one."""
    if pretrained is None or isinstance(pretrained, (str, Path)):
        return str(pretrained) if pretrained is not None else None
    return str(pretrained[0]) if len(pretrained) else None


def split_sources(pretrained: Sources) -> tuple[Optional[str], tuple[str, ...]]:
    """(the base checkpoint, the PEFT adapter files to read after it) of a ``pretrained=`` argument.

    Raises:
        PretrainedError: a later source that is not a PEFT adapter folder (or its safetensors file), naming it.
    """
    if pretrained is None or isinstance(pretrained, (str, Path)):
        return base_source(pretrained), ()
    sources = [str(p) for p in pretrained]
    if not sources:
        return None, ()
    adapters = []
    for source in sources[1:]:
        path = Path(source)
        file = path / ADAPTER_FILE if path.is_dir() else path
        if file.name != ADAPTER_FILE or not file.is_file():
            raise PretrainedError(
                f"pretrained={sources}: after the base checkpoint each source must be a PEFT adapter folder (holding "
                f"{ADAPTER_FILE}, as PeftModel.save_pretrained writes it); {source} is not. Put the base first"
            )
        adapters.append(str(file))
    return sources[0], tuple(adapters)


def peft_view(fresh: Iterable[str]) -> AdapterNames:
    """The model's adapter tensors under the names PEFT saves them with (without the adapter's name).

    Raises:
        PretrainedError: the model holds several adapters (a PEFT folder holds one: which would it fill?).
    """
    aliases: dict[str, str] = {}
    names: set[str] = set()
    for name in fresh:
        found = _NAMED.search(name)
        if found is None:
            continue
        part, adapter, tail = found.groups()
        names.add(adapter)
        tail = "" if part == "lora_magnitude_vector" else (tail or "")
        aliases[name] = f"{name[: found.start()]}.{part}{tail}"
    if len(names) > 1:
        raise PretrainedError(
            f"the model holds several adapters ({sorted(names)}) and a PEFT folder holds one; load it into a model "
            "with only the adapter it fills (peft's get_peft_model with one config), and add the others after loading"
        )
    return AdapterNames(aliases, frozenset())

