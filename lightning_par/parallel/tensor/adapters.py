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

DoRA's magnitudes (peft ``use_dora=True``) follow their bases' output rows (`split_dora`); the plan's probes see DoRA
as LoRA (`dora_as_lora`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial
from typing import Any, Optional, cast

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import SequenceParallel

from lightning_par.checkpoint.fast_state import clean_name
from lightning_par.checkpoint.pretrained.names import AdapterNames
from lightning_par.parallel.tensor.affine import _GatherParts
from lightning_par.parallel.tensor.heads import _params_as
from lightning_par.parallel.tensor.plan_affine import Affine, affine
from lightning_par.parallel.tensor.plan_types import TPPlanError
from lightning_par.utils.dtensors import local, storages

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
    """Names (relative to ``root``) of every adapter's ``a`` and ``b``, and of peft's DoRA magnitude modules: the plan
    leaves them to their base (`split_dora` places the magnitudes)."""
    leaves = {n for pairs in find_adapters(root).values() for pair in pairs for n in pair}
    for base in find_adapters(root):
        wrapper, _, _ = base.rpartition(".")
        at, owner = (f"{wrapper}.", root.get_submodule(wrapper)) if wrapper else ("", root)
        leaves |= {f"{at}lora_magnitude_vector.{k}" for k in dora_layers(owner)}
    return leaves


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


def dora_layers(wrapper: nn.Module) -> dict[str, nn.Module]:
    """peft's DoRA magnitude modules of an adapter wrapper, by adapter name (empty for LoRA and a user's wrapper)."""
    magnitudes = getattr(wrapper, "lora_magnitude_vector", None)
    return dict(magnitudes.items()) if isinstance(magnitudes, nn.ModuleDict) else {}


def split_dora(block_name: str, block: nn.Module, adapters: dict[str, Pairs], styles: dict[str, Any],
               split: dict[str, str], mesh: DeviceMesh, sequence_parallel: bool,
               kv: Optional[dict[str, Tensor]] = None) -> None:  # fmt: skip
    """DoRA (Liu et al., arXiv 2402.09353) on the split bases of ``block``, once its styles are applied.

    peft's DoRA scales each output row of ``base(x) + s B A x`` by ``m / ||W + s B A||_row`` (the norm detached, the
    paper's section 4.3). Its magnitude ``m`` follows the base's output rows: split with them under a column split
    (each rank's rows have whole norms), whole under a row split, where each rank holds a slice of every row: the
    squared norms are summed over tp before the root. Beside key/value heads replicated over the ranks (`kv_heads`:
    each rank computes its head's rows, gathered from the even shards) ``m`` is gathered for the same rows, its
    gradient summed back over the ranks sharing them, as the base's and ``B``'s are (`affine._GatherParts`). Each
    magnitude module's forward becomes `_dora_forward` on the rank's tensors; the formula is peft's.

    Args:
        block_name: the block's name (for errors).
        styles: the torch styles applied to the block's plain ``nn.Linear`` projections (block-relative names).
        split: every split projection's style (``colwise``, ``rowwise``, ...), block-relative.
        kv: the output rows this rank computes of each projection holding replicated key/value heads.

    Raises:
        TPPlanError: a DoRA base split by lightning_par's own split with its rows regrouped (a fused projection, a
            ``Conv1D``).
    """
    kv = kv or {}
    for base in adapters:
        wrapper_name, _, _ = base.rpartition(".")
        layers = dora_layers(block.get_submodule(wrapper_name) if wrapper_name else block)
        style = split.get(base, "replicate")
        if not layers or style not in ("colwise", "colwise_fused", "rowwise"):
            continue
        rows = kv.get(base) if style == "colwise" and isinstance(block.get_submodule(base), nn.Linear) else None
        if base not in styles and rows is None:
            raise TPPlanError(
                f"{block_name}.{wrapper_name} is a DoRA layer (peft use_dora=True) whose base lightning_par splits "
                "with its own regrouped rows (a fused projection or a Conv1D); train it without tensor parallelism "
                "(tp=1: zero3, pipe and the other layouts train DoRA)"
            )
        row = style == "rowwise"
        for layer in layers.values():
            distribute_module(layer, mesh, _params_as(Replicate() if row else Shard(0)))
            forward = partial(_dora_forward, layer, mesh=mesh, row=row, sequence_parallel=sequence_parallel, rows=rows)
            object.__setattr__(layer, "forward", forward)


@contextlib.contextmanager
def dora_as_lora(root: nn.Module) -> Iterator[None]:
    """Inside, every peft DoRA layer of ``root`` adds ``s B A x`` alone, as LoRA does: what the plan's probes and
    value checks see. DoRA scales each output row of its wrapper by a per-row constant, which changes no data flow
    between projections; under tp its exactness is `split_dora`'s (tests/test_tp_lora.py), not the checks'."""
    layers = [layer for m in root.modules() for layer in dora_layers(m).values()]
    for layer in layers:
        object.__setattr__(layer, "forward", _lora_only)
    try:
        yield
    finally:
        for layer in layers:
            del layer.forward


def _lora_only(x: Tensor, *, lora_A: nn.Module, lora_B: nn.Module, scaling: float, **_: Any) -> Tensor:
    return lora_B(lora_A(x)) * scaling


def _dora_forward(layer: nn.Module, x: Tensor, *, lora_A: nn.Module, lora_B: nn.Module, scaling: float,
                  base_layer: nn.Module, base_result: Optional[Tensor] = None, adapter_name: str = "default",
                  mesh: DeviceMesh, row: bool, sequence_parallel: bool,
                  rows: Optional[Tensor] = None) -> Tensor:  # fmt: skip
    """peft's ``DoraLinearLayer.forward`` on this rank's tensors (`split_dora`): what it adds to the base's output."""

    def mine(t: Tensor) -> Tensor:  # this rank's output rows: its even shard, or its key/value head's rows
        return t if rows is None else cast(Tensor, _GatherParts.apply(t, rows, mesh.get_group()))

    weight = mine(_param(base_layer, "weight"))
    with torch.no_grad():  # peft detaches the norm and the low-rank product in it
        full = weight.to(x.dtype) + scaling * (mine(_param(lora_B, "weight")) @ _param(lora_A, "weight")).to(x.dtype)
        squares = full.pow(2).sum(dim=1)
        if row:  # each rank holds a slice of every row
            dist.all_reduce(squares, group=mesh.get_group())
        norm = squares.sqrt()
    magnitude = cast(Tensor, layer.weight)
    if row and sequence_parallel:  # each rank's output rows are its sequence shard's: its gradient is a partial sum
        magnitude = cast(DTensor, magnitude).to_local(grad_placements=[Partial()])
    scale = (mine(local(magnitude)) / norm).view(1, -1)
    lora_result = local(lora_B(lora_A(x)))
    if base_result is None and rows is not None:  # as `affine` computes replicated heads' rows: a partial input grad
        base_result = F.linear(cast(DTensor, x).to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x,
                               weight)  # fmt: skip
    elif base_result is None:  # lora dropout in training: peft recomputes the base on the dropped-out input
        # As the base's style computes it, in DTensors, so that the input's gradient is reduced as the base's is.
        into = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(-1) if row else Replicate()])
        out = cast(DTensor, F.linear(into, cast(DTensor, base_layer.weight)))  # this rank's columns, or partial sums
        if row:
            out = out.redistribute(mesh, [Shard(1) if sequence_parallel else Replicate()])
        base_result = out.to_local()
    elif base_layer.bias is not None:
        base_result = local(base_result) - mine(_param(base_layer, "bias"))
    return (scale - 1) * local(base_result) + scale * lora_result * scaling


def _param(module: nn.Module, name: str) -> Tensor:
    return local(cast(Tensor, getattr(module, name)))


def quantised_weights(root: nn.Module) -> list[str]:
    """Names of ``root``'s parameters stored as a tensor subclass of other tensors (QLoRA's 4-bit NF4 bases)."""
    return [n for n, p in root.named_parameters() if len(storages(p)) > 1]


def _values(p: Tensor) -> Tensor:
    # A quantised weight's values: torchao's NF4Tensor dequantises with get_original_weight, others with dequantize.
    values = getattr(p, "get_original_weight", None) or p.dequantize
    return cast(Tensor, values())


@contextlib.contextmanager
def quantised_as_plain(root: nn.Module) -> Iterator[None]:
    """Inside, each quantised weight of ``root`` is a plain frozen parameter of its values: what the plan's probes
    and value checks see (they slice weights, which a 4-bit tensor does not support)."""
    swaps = []
    for mod in root.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if len(storages(p)) > 1:
                swaps.append((mod, name, p))
                mod.register_parameter(name, nn.Parameter(_values(p).detach(), requires_grad=False))
    try:
        yield
    finally:
        for mod, name, p in swaps:
            mod.register_parameter(name, p)


def split_quantised(name: str, mod: nn.Module, style: str, mesh: DeviceMesh, sequence_parallel: bool) -> None:
    """A projection whose frozen weight is quantised (QLoRA's NF4 base), split over tp without splitting the weight:
    the 4-bit weight stays whole on every rank (its values come in blocks with their own scales, which torchao splits
    by rows only, across the double-quantised groups), and each forward dequantises it and multiplies by this rank's
    rows (column split: the output's columns, as `ColwiseParallel` gives them) or columns (row split: a partial sum,
    all-reduced, or reduce-scattered along the sequence under sequence parallelism), in DTensors, so that the input's
    gradient is reduced as the plain split's is. Exact: one process multiplies by the same dequantised values.

    Raises:
        TPPlanError: the projection has a trainable bias, or a style other than a plain column or row split.
    """
    bias = getattr(mod, "bias", None)
    if style not in ("colwise", "rowwise") or (bias is not None and bias.requires_grad):
        raise TPPlanError(
            f"{name} holds a quantised weight ({type(mod.weight).__name__}) and is split {style!r}"
            + (" with a trainable bias" if bias is not None and bias.requires_grad else "")
            + "; tensor parallelism splits a quantised base only by plain columns or rows with a frozen bias: train it "
            "with ZeRO (e.g. strategy='zero3', which shards the 4-bit weights themselves) or pipeline parallelism"
        )
    weight, row = cast(Tensor, mod.weight), style == "rowwise"
    tp, rank = mesh.size(), mesh.get_local_rank()
    width = weight.shape[1 if row else 0] // tp
    mine = slice(rank * width, (rank + 1) * width)

    def forward(x: Tensor) -> Tensor:
        values = _values(weight).to(x.dtype)
        if row:
            into = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Shard(-1)])
            w = DTensor.from_local(values[:, mine], mesh, [Shard(1)])
            out = cast(DTensor, F.linear(into, w)).redistribute(mesh, [Shard(1) if sequence_parallel else Replicate()])
        else:
            into = x if isinstance(x, DTensor) else DTensor.from_local(x, mesh, [Replicate()])
            out = cast(DTensor, F.linear(into, DTensor.from_local(values[mine], mesh, [Shard(0)])))
        local_out = out.to_local()
        if bias is not None:
            local_out = local_out + (local(cast(Tensor, bias)) if row else local(cast(Tensor, bias))[mine])
        return local_out

    object.__setattr__(mod, "forward", forward)


@contextlib.contextmanager
def as_planned(root: nn.Module) -> Iterator[None]:
    """``root``'s adapters as the tensor-parallel plan's probes and value checks see them, wherever a plan is
    inferred (the strategies, the planner): DoRA as LoRA (`dora_as_lora`), 4-bit bases as their values
    (`quantised_as_plain`); each is split by its own rule afterwards (`split_dora`, `split_quantised`)."""
    with dora_as_lora(root), quantised_as_plain(root):
        yield
