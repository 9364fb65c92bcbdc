"""Low-rank adapters under tensor parallelism: LoRA (Hu et al., arXiv 2106.09685) as peft's ``get_peft_model`` and
users add it, recognised by structure and split with the projection each adapts.

An adapter wrapper is a module whose projections are one frozen base (a direct child: peft's ``base_layer``, a
user's ``base``) and pairs ``a``, ``b`` with ``a: in -> r``, ``b: r -> out`` of the base's widths and a rank
``r`` below both (peft's ``lora_A.default`` / ``lora_B.default``, one pair per named adapter); its output is
``base(x) + b(a(x)) * scale``. The plan sees the base only (the pairing and the head inference are unchanged by
the wrapper), and each pair follows its base's style, so that ``b(a(x))`` is split exactly as ``base(x)`` is:

- column-split base (q, k, v, gate, up; fused or with replicated key/value heads alike): ``b`` is split by rows
  exactly as the base's output is, ``a`` stays whole as a replicated DTensor; ``a``'s gradient comes back
  ``Partial`` from the ranks' ``b`` slices and is summed over tp like a sequence-parallel norm's, its input gradient
  joins the region's one reduction;
- row-split base (o, down): ``a`` is split by columns (its input is the rank's slice of the hidden units) and its
  output all-reduced (reduce-scattered along the sequence under sequence parallelism), as the base's is; ``b`` is
  whole: plain under tp alone (equal input on every rank), a `SequenceParallel` module on the sequence shard.
"""

from __future__ import annotations

from typing import Any, cast

from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import SequenceParallel

from lightning_par.checkpoint.fast_state import clean_name
from lightning_par.checkpoint.pretrained.names import AdapterNames
from lightning_par.parallel.tensor.heads import _params_as
from lightning_par.parallel.tensor.plan_affine import Affine, affine
from lightning_par.parallel.tensor.plan_types import TPPlanError

Pairs = tuple[tuple[str, str], ...]


def find_adapters(root: nn.Module) -> dict[str, Pairs]:
    """Base projection -> its ``(a, b)`` adapter pairs, for every adapter wrapper inside ``root`` (names relative
    to ``root``)."""
    found: dict[str, Pairs] = {}
    known = {id(m): a for m in root.modules() if (a := affine(m)) is not None}  # each leaf probed once
    for name, wrapper in root.named_modules():
        if not any(id(m) in known for m in wrapper.children()):
            continue  # no projection of its own: not a wrapper
        leaves = {n: known[id(m)] for n, m in wrapper.named_modules() if n and id(m) in known}
        for base in (n for n in leaves if "." not in n):
            pairs = _pairs(base, leaves)
            if pairs:
                prefix = f"{name}." if name else ""
                found[prefix + base] = tuple((prefix + a, prefix + b) for a, b in pairs)
                break
    return found


def _pairs(base: str, leaves: dict[str, Affine]) -> Pairs:
    """The low-rank pairs of ``base`` when every other projection of the wrapper belongs to one, else ``()``."""
    width_in, width_out = leaves[base].in_features, leaves[base].out_features
    others = [n for n in leaves if n != base]
    rank = min(width_in, width_out)  # a low-rank pair's inner width is below both
    downs = [n for n in others if leaves[n].in_features == width_in and leaves[n].out_features < rank]
    ups = [n for n in others if leaves[n].out_features == width_out and n not in downs]
    if not downs or len(downs) != len(ups) or len(downs) + len(ups) != len(others):
        return ()
    # One adapter: its two; several (peft's named adapters): matched by their last name part.
    key = (lambda n: n.rpartition(".")[2]) if len(downs) > 1 else (lambda n: "")
    by_key = {key(u): u for u in ups}
    pairs = tuple((d, by_key[key(d)]) for d in downs if key(d) in by_key)
    if len(pairs) != len(downs) or any(leaves[a].out_features != leaves[b].in_features for a, b in pairs):
        return ()
    return pairs


def adapter_leaves(root: nn.Module) -> set[str]:
    """Names (relative to ``root``) of every adapter's ``a`` and ``b``: the plan leaves them to their base."""
    return {n for pairs in find_adapters(root).values() for pair in pairs for n in pair}


def adapter_styles(styles: dict[str, str], adapters: dict[str, Pairs]) -> dict[str, tuple[str, str]]:
    """Adapter projection -> (its split style, its base), for the bases ``styles`` splits: ``b`` of a column split
    takes the base's style, ``a`` of a row split is ``rowwise``; the other one of each pair stays whole."""
    got: dict[str, tuple[str, str]] = {}
    for base, pairs in adapters.items():
        style = styles.get(base, "replicate")
        for a, b in pairs:
            if style == "rowwise":
                got[a] = ("rowwise", base)
            elif style in ("colwise", "colwise_fused"):
                got[b] = (style, base)
    return got


def whole_adapters(
    block: nn.Module,
    adapters: dict[str, Pairs],
    follows: dict[str, tuple[str, str]],
    mesh: DeviceMesh,
    sequence_parallel: bool,
) -> dict[str, Any]:
    """Place the unsplit projection of each pair whose base is split: ``a`` of a column split becomes a replicated
    DTensor module in ``block`` now; ``b`` of a row split gets the returned `SequenceParallel` style under sequence
    parallelism (it reads the sequence shard) and stays plain otherwise."""
    styles: dict[str, Any] = {}
    for pairs in adapters.values():
        for a, b in pairs:
            if follows.get(a, ("", ""))[0] == "rowwise" and sequence_parallel:
                styles[b] = SequenceParallel(sequence_dim=1, use_local_output=True)
            elif b in follows:
                distribute_module(block.get_submodule(a), mesh, _params_as(Replicate()), cast(Any, _replicated_input))
    return styles


def _replicated_input(mod: nn.Module, args: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
    # The region's gathered input arrives as a replicated DTensor already; a plain one (a region kept at the block)
    # is the same on every rank, and its gradient from the column-split ``b`` comes back Partial: all-reduced here.
    return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False)
                 if isinstance(x, Tensor) and not isinstance(x, DTensor) else x for x in args)  # fmt: skip


def adapter_names(root: nn.Module) -> AdapterNames:
    """``root``'s low-rank adapters by parameter name, for reading a base checkpoint into the adapted model
    (`lightning_par.checkpoint.pretrained`): each wrapped base layer's parameters under the wrapper's name (peft's
    ``q_proj.base_layer.weight`` is the base model's ``q_proj.weight``; a user's ``q.base.weight`` its ``q.weight``),
    and the wrapper's other parameters (the pairs, DoRA's magnitude) as the adapters' own. Names as in checkpoints
    (`checkpoint.fast_state.clean_name`)."""
    aliases: dict[str, str] = {}
    fresh: set[str] = set()
    for base in find_adapters(root):
        wrapper, _, leaf = base.rpartition(".")
        owner = root.get_submodule(wrapper) if wrapper else root
        outer = f"{wrapper}." if wrapper else ""
        for name, _ in owner.named_parameters():
            full = clean_name(outer + name)
            if name.startswith(f"{leaf}."):
                aliases[full] = clean_name(outer + name[len(leaf) + 1 :])
            else:
                fresh.add(full)
    return AdapterNames(aliases, frozenset(fresh))


def refuse_dora(root: nn.Module) -> None:
    """Raise, naming the first one, when ``root`` holds peft DoRA layers (a magnitude vector per adapter).

    Raises:
        TPPlanError: DoRA normalises each output row of ``base + B A``; under a row split that norm spans the tp
            ranks, which tensor parallelism does not compute.
    """
    for name, mod in root.named_modules():
        magnitudes = getattr(mod, "lora_magnitude_vector", None)
        if isinstance(magnitudes, nn.ModuleDict) and len(magnitudes) > 0:
            raise TPPlanError(
                f"{name} is a DoRA layer (peft use_dora=True): its magnitude normalises each output row of base + B A, "
                "a norm that spans the tensor-parallel ranks under a row split, which lightning_par does not compute; "
                "train it without tensor parallelism (tp=1: zero3, pipe and the other layouts train DoRA), or use LoRA "
                "(use_dora=False) under tp"
            )
