"""Read a Hugging Face checkpoint saved in another layout than its modules hold, by transformers' own conversion.

Transformers 5 keeps the experts of a mixture-of-experts layer stacked in the module
(``mlp.experts.gate_up_proj`` ``[E, 2I, H]``, ``mlp.experts.down_proj`` ``[E, H, I]``) but ``save_pretrained`` writes,
and the Hub publishes, the per-expert layout (``block_sparse_moe.experts.0.w1.weight``, ``w2``, ``w3`` for Mixtral;
``mlp.experts.0.gate_proj.weight`` ... for Qwen2-MoE, OLMoE, DeepSeek-V3 and the other families mapped like it).
``from_pretrained`` converts on load with the model's checkpoint conversion mapping
(``transformers.conversion_mapping.get_model_conversion_mapping``: ``WeightRenaming`` and ``WeightConverter``s whose
ops, ``MergeModulelist``, ``Concatenate``, ``Chunk``, ``Transpose``..., live in ``transformers.core_model_loading``).

`convert_source` puts the same mapping in front of a `Source`: file keys are renamed and grouped exactly as
``convert_and_load_state_dict_in_model`` does (its key renaming, its natural sort, a copy of the matching converter
per target), and the converted source lists the *target* names and shapes, so that the name match, the missing /
unexpected keys and the shape checks of `lightning_par.checkpoint.pretrained.load` see the model's own names. The shapes
come from running each converter on meta tensors while the file is opened: metadata only, the same on every rank,
and an op that cannot convert these keys is refused then, before any rank reads a tensor.

No table here names a model: whatever transformers maps for the model's class (or ``model_type``), and only that, is
converted. The mapping is taken from a copy of the model built on the meta device from its config (no memory), so a
model that FSDP2 re-classed, or a pipeline stage that dropped layers, gets the mapping and parameter shapes of the
whole, unwrapped model on every rank.

Memory: a converted tensor is made from its source tensors read whole (an expert-sharded rank reads every expert of
the layer, then keeps its rows), so the transient is one target tensor (one layer's stacked experts) plus its
sources, never the model. Tensors the mapping only renames (or leaves alone) are still read region by region.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_par.checkpoint.pretrained.names import listing
from lightning_par.checkpoint.pretrained.sources import PretrainedError, Region, Source

__all__ = ["ConvertedSource", "convert_source", "find_hf_models"]


def find_hf_models(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The outermost Hugging Face ``PreTrainedModel``\\ s in ``module`` (itself included) and their names in it.

    A LightningModule that keeps its model as ``self.model`` gives ``[("model", MixtralForCausalLM)]``; models nested
    in another one (a VLM's language model) are covered by the outer model's mapping and not listed. Empty without
    transformers.
    """
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return []
    found: list[tuple[str, nn.Module]] = []
    for name, sub in module.named_modules():
        if isinstance(sub, PreTrainedModel) and not any(p == "" or name.startswith(p + ".") for p, _ in found):
            found.append((name, sub))
    return found


def _skeleton(model: nn.Module) -> nn.Module:
    """The model's own transformers class, built on the meta device from a copy of its config."""
    from transformers import PreTrainedModel

    # fully_shard re-classes a module as FSDP<Class>, defined in torch: transformers would take that for custom code
    # and skip its mapping. The first class in the MRO not defined by torch is the model's own (a user's subclass
    # stays a user's class, which transformers itself does not convert either).
    cls = next(
        c for c in type(model).__mro__ if issubclass(c, PreTrainedModel) and not c.__module__.startswith("torch.")
    )
    try:
        with torch.device("meta"):
            return cls._from_config(copy.deepcopy(model.config))  # type: ignore[attr-defined,no-any-return]
    except Exception as err:  # raised here alone, it would leave the other ranks waiting in the validation exchange
        raise PretrainedError(
            f"building {cls.__name__} on the meta device to read its checkpoint conversion mapping failed: "
            f"{type(err).__name__}: {err}; pass hf_model=None to read the file's names as they are"
        ) from err


@dataclasses.dataclass
class _Group:
    """One conversion: the file keys one ``WeightConverter`` turns into its targets.

    Args:
        first: the renamed key transformers calls the conversion by (its first target).
        converter: the mapping's converter; copied for every run, as each run consumes what it collected.
        sources: (source pattern, file key), in transformers' order (natural sort: expert 10 after expert 9).
        targets: the converted names, known after the run on meta tensors.
    """

    first: str
    converter: Any
    sources: list[tuple[str, str]] = dataclasses.field(default_factory=list)
    targets: tuple[str, ...] = ()


def _ops(group: _Group) -> str:
    return " -> ".join(type(op).__name__ for op in getattr(group.converter, "operations", ()))


def _run(group: _Group, load: Callable[[str], torch.Tensor], model: nn.Module) -> dict[str, torch.Tensor]:
    """Convert ``group`` with transformers' own converter: its ops, its naming of the outputs."""
    converter = copy.deepcopy(group.converter)
    for pattern, key in group.sources:
        # A callable is what transformers collects when it loads synchronously: called once, when converting.
        converter.add_tensor(group.first, key, pattern, functools.partial(load, key))
    with torch.no_grad():
        out = converter.convert(group.first, model=model, config=model.config)
    return {name: t[0] if isinstance(t, list) else t for name, t in out.items()}


class ConvertedSource(Source):
    """A `Source` seen through a transformers conversion mapping: ``shapes`` holds the converted names and shapes.

    Args:
        inner: the file as written.
        model: the meta-device model whose mapping and parameter shapes drive the conversion.
        renamed: converted name -> file key, for tensors the mapping renames or leaves as they are.
        groups: the conversions, each with its targets known.
        shapes: every converted name and its shape.
    """

    def __init__(
        self,
        inner: Source,
        model: nn.Module,
        renamed: dict[str, str],
        groups: list[_Group],
        shapes: dict[str, tuple[int, ...]],
    ) -> None:
        super().__init__(inner.path, inner.kind, shapes, inner.files)
        self.inner, self.model, self.renamed, self.groups = inner, model, renamed, groups
        self._group_of = {t: g for g in groups for t in g.targets}
        # The outputs of the last conversion not yet read: a one-to-many conversion (q|k|v -> q, k, v) runs once for
        # its targets read one after the other, and holds no more than its own outputs.
        self._pending: tuple[_Group, dict[str, torch.Tensor]] | None = None

    def read(self, key: str, region: Region | None = None) -> torch.Tensor:
        if key in self.renamed:
            return self.inner.read(self.renamed[key], region)
        group = self._group_of[key]
        if self._pending is None or self._pending[0] is not group or key not in self._pending[1]:
            self._pending = (group, _run(group, self.inner.read, self.model))
        full = self._pending[1].pop(key)
        if not self._pending[1]:
            self._pending = None
        return full[region] if region is not None else full

    def can_slice(self, key: str) -> bool:
        # A converted tensor exists only whole; a renamed one is the file's tensor and reads a region as the file does.
        return key in self.renamed and self.inner.can_slice(self.renamed[key])

    def describe(self) -> str:
        made = sum(len(g.targets) for g in self.groups)
        read = sum(len(g.sources) for g in self.groups)
        return (
            f"{self.inner.describe()}; {made} tensor(s) converted from {read} file key(s) by transformers' "
            f"{type(self.model).__name__} mapping"
        )


def _plan(source: Source, model: nn.Module) -> ConvertedSource | None:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings, dot_natural_key

    mapping = get_model_conversion_mapping(model)  # type: ignore[arg-type]
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    converters = [t for t in mapping if isinstance(t, WeightConverter)]
    renamed: dict[str, str] = {}
    groups: dict[str, _Group] = {}
    for key in sorted(source.shapes, key=dot_natural_key):
        # transformers' rename_source_key: every renaming, then the first converter that matches. Done here step by
        # step to know which converter matched (two may share a source pattern). No base_model_prefix: the prefix is
        # matched afterwards on every rank's names (pretrained_names); a pipeline stage's module would decide it
        # differently per rank.
        name, pattern, converter = apply_renamings(key, renamings), None, None
        for converter in converters:
            converted, pattern = converter.rename_source_key(name)
            if pattern is not None:
                name = converted
                break
        if pattern is None:
            if name in renamed:
                raise PretrainedError(
                    f"{source.path}: transformers' {type(model).__name__} mapping renames both {renamed[name]} and "
                    f"{key} to {name}; the file mixes two layouts of one weight: keep one of them"
                )
            renamed[name] = key
        else:
            group = groups.setdefault(name, _Group(name, converter))
            if group.converter is not converter:
                raise PretrainedError(
                    f"{source.path}: two converters of transformers' {type(model).__name__} mapping make {name} "
                    f"({group.converter} from {group.sources[0][1]}, {converter} from {key}); the file mixes two "
                    "layouts of one weight, or the mapping is ambiguous: keep one layout in the file"
                )
            group.sources.append((pattern, key))
    if not groups and all(n == k for n, k in renamed.items()):
        return None  # the file is in the module's layout already
    shapes = {n: source.shapes[k] for n, k in renamed.items()}
    for group in groups.values():
        try:
            out = _run(group, lambda k: torch.empty(source.shapes[k], device="meta"), model)
        except Exception as err:
            keys = [k for _, k in group.sources]
            raise PretrainedError(
                f"{source.path}: transformers' {type(model).__name__} mapping cannot convert {listing(keys, 3)} into "
                f"{group.first} ({_ops(group)}): {type(err).__name__}: {err}; this op or these keys are not "
                "convertible here: load the folder with from_pretrained and save model.state_dict() as a .safetensors "
                "file, which is read as it is"
            ) from err
        clash = sorted(set(out) & set(shapes))
        if clash:
            raise PretrainedError(
                f"{source.path}: {listing(clash, 3)} is both in the file and converted from "
                f"{listing([k for _, k in group.sources], 3)} by transformers' {type(model).__name__} mapping; the "
                "file mixes two layouts of one weight: keep one of them"
            )
        group.targets = tuple(out)
        shapes.update({n: tuple(t.shape) for n, t in out.items()})
    return ConvertedSource(source, model, renamed, list(groups.values()), shapes)


def convert_source(source: Source, hf_model: nn.Module) -> Source:
    """``source`` seen through the checkpoint conversion mapping transformers has for the model in ``hf_model``.

    Args:
        source: an opened safetensors or torch file (`lightning_par.checkpoint.pretrained.sources.open_source`).
        hf_model: a Hugging Face ``PreTrainedModel``, or a module holding one (the LightningModule). With several,
            the first whose mapping changes any of the file's keys is used.

    Returns:
        a `ConvertedSource`, or ``source`` itself when no mapping changes a key (the file is in the module's layout,
        the model has no mapping, or transformers is not installed).

    Raises:
        PretrainedError: a conversion cannot run on the file's keys (the message names the keys, the ops and the
            model), or the file holds one weight in two layouts.
    """
    for _, model in find_hf_models(hf_model):
        converted = _plan(source, _skeleton(model))
        if converted is not None:
            return converted
    return source
