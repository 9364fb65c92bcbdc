"""Match the names in a pretrained file to a module's own names: one prefix rewrite, found from the names alone.

The same weights are named differently on the two sides in a few regular ways: a LightningModule that holds a
Hugging Face model as ``self.model`` names its weights ``model.model.layers.0...`` where the file says
``model.layers.0...``; a file written from ``LlamaForCausalLM`` has ``model.`` before every trunk weight that a bare
``LlamaModel`` lacks (and ``transformer.``, ``bert.``, ... for other families). Each case is one prefix taken off one
side or put on it, so that is all that is searched: every rewrite "module ``P`` + rest = file ``Q`` + rest" with one of
``P``, ``Q`` a dotted prefix seen in the names (up to three parts) and the other empty, plus one-part prefixes on both
sides (``backbone.`` for ``model.``), scored by how many module names then find their file key. The winner is
reported, so a surprising choice is visible at start-up.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping

_DEPTH = 3  # parts in a candidate prefix: "model.", "model.model.", "model.model.backbone."

# Keys that old files carry but current modules compute instead of store (non-persistent buffers): the rotary
# frequency table of Llama-style attention, GPT-2's causal mask and its fill value. Ignored when nothing matches them.
_RECOMPUTED = (("rotary_emb", "inv_freq"), ("attn", "masked_bias"), ("attn", "bias"))


@dataclasses.dataclass(frozen=True)
class PrefixRewrite:
    """The module's name ``module + rest`` is the file's key ``file + rest``.

    Args:
        module: the prefix the module's names have and the file's keys lack (a LightningModule's ``model.``).
        file: the prefix the file's keys have and the module's names lack (a base-model prefix such as ``model.``).
    """

    module: str = ""
    file: str = ""

    def to_file(self, name: str) -> str | None:
        """The file key for the module's ``name``, or ``None`` when ``name`` is not under ``module``."""
        if not name.startswith(self.module):
            return None
        return self.file + name[len(self.module) :]

    def to_module(self, key: str) -> str | None:
        """The module name for the file's ``key``, or ``None`` when ``key`` is not under ``file``."""
        if not key.startswith(self.file):
            return None
        return self.module + key[len(self.file) :]

    def __str__(self) -> str:
        if not self.module and not self.file:
            return "names as they are"
        if not self.file:
            return f"module name = '{self.module}' + file key"
        if not self.module:
            return f"file key = '{self.file}' + module name"
        return f"module '{self.module}' + rest = file '{self.file}' + rest"


def _prefixes(names: Iterable[str]) -> set[str]:
    found: set[str] = set()
    for name in names:
        parts = name.split(".")[:-1]  # the last part is the tensor's own name, never a prefix
        for depth in range(1, min(len(parts), _DEPTH) + 1):
            found.add(".".join(parts[:depth]) + ".")
    return found


def _score(rewrite: PrefixRewrite, names: Iterable[str], keys: set[str]) -> int:
    return sum(1 for n in names if rewrite.to_file(n) in keys)


def choose_rewrite(names: Iterable[str], keys: Iterable[str]) -> PrefixRewrite:
    """The prefix rewrite under which most of the module's ``names`` find their key among the file's ``keys``.

    Ties go to the shorter rewrite (fewer characters added and removed), so names that already match keep
    themselves. With no match at all the names are kept as they are (and the caller reports what is missing).

    Args:
        names: the module's parameter and buffer names.
        keys: the file's tensor names.
    """
    names, key_set = sorted(set(names)), set(keys)
    name_prefixes, key_prefixes = _prefixes(names), _prefixes(key_set)
    candidates = [PrefixRewrite()]
    candidates += [PrefixRewrite(module=p) for p in sorted(name_prefixes)]
    candidates += [PrefixRewrite(file=p) for p in sorted(key_prefixes)]
    candidates += [
        PrefixRewrite(module=p, file=q)
        for p in sorted(name_prefixes)
        for q in sorted(key_prefixes)
        if p.count(".") == 1 and q.count(".") == 1 and p != q
    ]
    best, best_key = PrefixRewrite(), (0, 0)
    for rewrite in candidates:
        key = (_score(rewrite, names, key_set), -(len(rewrite.module) + len(rewrite.file)))
        if key[0] > best_key[0] or (key[0] == best_key[0] and key[0] > 0 and key[1] > best_key[1]):
            best, best_key = rewrite, key
    return best


def is_recomputed(key: str) -> bool:
    """Whether ``key`` is a buffer that current modules recompute rather than load (``rotary_emb.inv_freq``)."""
    return tuple(key.split(".")[-2:]) in _RECOMPUTED


@dataclasses.dataclass(frozen=True)
class NameMatch:
    """How the module's names meet the file's keys under one rewrite.

    Args:
        rewrite: the prefix rewrite applied.
        pairs: module name -> file key, for every name whose key is in the file.
        missing: module names without a file key (tied names excepted).
        tied: module names without a file key whose tensor is another matched name's (filled through it).
        unexpected: file keys no module name maps to (recomputed buffers excepted).
        ignored: file keys skipped on purpose (recomputed buffers such as ``rotary_emb.inv_freq``).
        fresh: module names the file does not hold and should not: low-rank adapters added to a pretrained model,
            which keep their own initial values.
    """

    rewrite: PrefixRewrite
    pairs: dict[str, str]
    missing: list[str]
    tied: list[str]
    unexpected: list[str]
    ignored: list[str]
    fresh: list[str] = dataclasses.field(default_factory=list)


def match_names(
    names: Iterable[str],
    keys: Iterable[str],
    tied_to: Mapping[str, tuple[str, ...]],
    rewrite: PrefixRewrite | None = None,
    adapters: AdapterNames | None = None,
) -> NameMatch:
    """Pair the module's names with the file's keys under ``rewrite`` (default: `choose_rewrite`'s).

    Args:
        names: the module's names (every rank's, so that all ranks decide the same).
        keys: the file's tensor names.
        tied_to: module name -> the other module names holding the same tensor (tied weights), or whose file
            tensor should fill it (a pipeline stage's own copy of a tied weight).
        rewrite: a fixed rewrite instead of the best one.
        adapters: the model's low-rank adapters: its names are also tried as the model without its adapter
            wrappers has them (a base checkpoint for a model wrapped by ``peft.get_peft_model``), and whichever
            view pairs more names wins (a checkpoint of the wrapped model itself keeps its own names).
    """
    plain = _match(sorted(set(names)), set(keys), tied_to, rewrite, {}, frozenset())
    if adapters is None or not adapters.aliases:
        return plain
    viewed = _match(sorted(set(names)), set(keys), tied_to, rewrite, adapters.aliases, adapters.fresh)
    return viewed if len(viewed.pairs) > len(plain.pairs) else plain


@dataclasses.dataclass(frozen=True)
class AdapterNames:
    """A model's low-rank adapters, by name (`lightning_par.parallel.tensor.adapters.adapter_names`).

    Args:
        aliases: each wrapped base layer's tensor -> its name in the model without the wrappers (peft's
            ``q_proj.base_layer.weight`` -> ``q_proj.weight``).
        fresh: the wrappers' own tensors (``lora_A``, ``lora_B``, DoRA's magnitude), which a base checkpoint does not
            hold.
    """

    aliases: Mapping[str, str]
    fresh: frozenset[str]


def _match(
    names: list[str],
    key_set: set[str],
    tied_to: Mapping[str, tuple[str, ...]],
    rewrite: PrefixRewrite | None,
    aliases: Mapping[str, str],
    fresh: frozenset[str],
) -> NameMatch:
    view = {n: aliases.get(n, n) for n in names}
    rewrite = rewrite if rewrite is not None else choose_rewrite([view[n] for n in names if n not in fresh], key_set)
    pairs: dict[str, str] = {}
    unmatched: list[str] = []
    for name in names:
        key = rewrite.to_file(view[name])
        if key is not None and key in key_set:
            pairs[name] = key
        else:
            unmatched.append(name)
    tied = [n for n in unmatched if any(p in pairs for p in tied_to.get(n, ()))]
    new = [n for n in unmatched if n in fresh and n not in set(tied)]
    missing = [n for n in unmatched if n not in set(tied) and n not in fresh]
    used = set(pairs.values())
    rest = sorted(key_set - used)
    ignored = [k for k in rest if is_recomputed(k)]
    unexpected = [k for k in rest if not is_recomputed(k)]
    return NameMatch(rewrite, pairs, missing, tied, unexpected, ignored, new)


def listing(items: list[str], limit: int = 10) -> str:
    """The first ``limit`` of ``items`` and how many more, for an error message."""
    shown = ", ".join(items[:limit])
    return shown + (f" and {len(items) - limit} more" if len(items) > limit else "")
