"""Infer a tensor-parallel plan for a model's repeated blocks from structure and shapes; no process groups.

Blocks are grouped by structure; the first block of each group is probed (`lightning_par.blocks._probe`), its
Linears are paired Megatron-style (`lightning_par.parallel.tensor.plan_pairs`), its norms on the residual stream go
sequence-parallel, and the user's ``tp_plan`` overrides are applied last, over every group. The plan's types live
in `lightning_par.parallel.tensor.plan_types`.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Any

from torch import nn

from lightning_par.blocks._probe import _is_norm, _norm_size, _registration_order, _Trace, _trace_blocks
from lightning_par.blocks.trunk import Trunk, find_trunk
from lightning_par.parallel.experts.finder import find_moe_layers
from lightning_par.parallel.tensor.adapters import find_adapters
from lightning_par.parallel.tensor.mha import add_to_plan, check_pairs, splittable
from lightning_par.parallel.tensor.plan_affine import affine, affine_modules
from lightning_par.parallel.tensor.plan_pairs import _in, _Inference, _outer_roles, _Region, head_params
from lightning_par.parallel.tensor.plan_types import (
    _ALLOWED,
    _SPARE,
    _SPLIT_NORMS,
    ALIASES,
    STYLES,
    HeadInfo,
    MLPInfo,
    ModuleShape,
    TPPlan,
    TPPlanError,
)

__all__ = ["STYLES", "HeadInfo", "MLPInfo", "ModuleShape", "TPPlan", "TPPlanError", "infer_tp_plan"]


def _shape(m: nn.Module) -> ModuleShape | None:
    if (a := affine(m)) is not None:  # nn.Linear, or an affine leaf such as Hugging Face's Conv1D
        return ModuleShape("linear", a.in_features, a.out_features)
    if isinstance(m, nn.Embedding):
        return ModuleShape("embedding", m.num_embeddings, m.embedding_dim)
    return ModuleShape("norm", _norm_size(m), _norm_size(m)) if _is_norm(m) else None


def _signature(block: nn.Module) -> list[tuple[str, str, list[tuple[int, ...]]]]:
    return [
        (n, type(m).__name__, [tuple(p.shape) for p in m.parameters(recurse=False)]) for n, m in block.named_modules()
    ]


def _inside(name: str, roots: tuple[str, ...]) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def _glob(name: str, pattern: str) -> bool:
    a, b = name.split("."), pattern.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b))


def infer_tp_plan(model: nn.Module, *, overrides: dict[str, str] | None = None, trunk: Trunk | None = None) -> TPPlan:
    """Infer which Linears of the model's blocks to split by columns or rows, and the head counts tp must divide.

    Args:
        model: the user's module; it is only inspected (one forward pass on its ``example_input_array`` or else a
            (1, 8) batch of token 0, in eval mode, with hooks that are removed afterwards).
        overrides: the user's ``tp_plan``: module-name patterns (``*`` for the block index, globs allowed) to
            styles; they replace inferred styles, and silence inference errors about the modules they cover.
        trunk: the blocks to plan (default: the model's trunk, `find_trunk`); another stack of blocks, such as an
            encoder-decoder's encoder (`blocks.trunk.other_trunks`).

    Raises:
        TPPlanError: no trunk, ambiguous or unsplittable projections (naming the modules and showing a
            ``tp_plan``), or a bad override.
    """
    trunk = trunk if trunk is not None else find_trunk(model)
    if trunk is None:
        raise TPPlanError("found no trunk of >= 2 same-class blocks in a ModuleList/Sequential/ModuleDict")
    groups = _groups(trunk)
    in_blocks = set(trunk.names)
    outer: dict[str, nn.Module] = {}
    marker = -1
    for n, m in model.named_modules():
        if n == trunk.path and marker < 0:
            marker = len(outer)
        parts = n.split(".")
        if not any(".".join(parts[:j]) in in_blocks for j in range(1, len(parts) + 1)) and _shape(m) is not None:
            outer[n] = m
    # Blocks that differ (DeepSeek-V3's dense first block, x-transformers' attention and feed-forward layers): each
    # structure is planned from its first block, under patterns naming exactly its blocks.
    probed = []
    for idx in groups.values():
        block = trunk.blocks[idx[0]]
        moe = _moe_layers(model, trunk.names[idx[0]])
        kept = {n: m for n, m in block.named_modules() if n and not _inside(n, moe)}
        projections = affine_modules(kept)  # adapters too: their outputs end the probe's walks (plan_pairs)
        inner = {n: m for n, m in kept.items() if n in projections or _is_norm(m)}
        probed.append((moe, kept, projections, inner))
    outer_proj = {n for n, m in outer.items() if affine(m) is not None}
    # One forward pass probes the first block of every structure.
    # A projection inside an adapter wrapper is read through the wrapper's sum (parallel/tensor/adapters.py).
    wrappers = tuple({b.rpartition(".")[0]: b for b in find_adapters(trunk.blocks[i[0]]) if "." in b}
                     for i in groups.values())  # fmt: skip
    traces = _trace_blocks(
        model, [(trunk.blocks[i[0]], p[3], set(p[2]) | outer_proj) for i, p in zip(groups.values(), probed)], outer,
        wrappers,
    )  # fmt: skip
    found = [
        _infer_group(model, trunk, idx, prefix, outer, marker, p, tr)
        for (prefix, idx), p, tr in zip(groups.items(), probed, traces)
    ]
    got, traced = found[0].trace, found[0].traced
    styles, inferred, heads, mlps, shapes = {}, {}, {}, {}, {}
    split_norms: dict[str, tuple[str, ...]] = {}
    problems: dict[str, tuple[str, ...]] = {}
    notes: list[str] = []
    fused: set[str] = set()
    chunked: dict[str, tuple[int, ...]] = {}
    inplace: tuple[str, ...] = ()
    tails: tuple[str, ...] = ()
    whole: dict[str, None] = {}
    for g in found:
        styles.update(g.styles)
        heads.update(g.heads)
        mlps.update(g.mlps)
        shapes.update(g.shapes)
        split_norms.update(g.split_norms)
        problems.update(g.problems)
        notes += [n for n in g.notes if n not in notes]
        fused |= {k for h in g.heads.values() for k in h.fused_split}
        fused |= {k for m in g.mlps.values() for k in m.fused_split}
        chunked.update(g.chunked)
        inplace += g.inplace
        tails += g.tails
        whole.update(dict.fromkeys(g.whole))
    shapes.update({n: s for n, m in outer.items() if (s := _shape(m)) is not None})
    inferred = dict(styles)
    covered = _override(styles, shapes, fused, chunked, overrides or {})
    for h in heads.values():
        # A per-head table goes with its attention's heads; kept whole where the heads are (a tp_plan's choice).
        split = any(styles.get(p) in ("colwise", "colwise_fused") for p in h.projections[:-1])
        styles.update({t: "colwise" if split else "replicate" for t in h.head_tables if t not in covered})
    _check_split_norms(styles, inferred, split_norms, covered)
    check_pairs(styles, heads)
    for h in heads.values():
        if any(styles.get(p) != "replicate" for p in h.latent) and any(
            styles.get(p) == "colwise" for p in h.projections
        ):
            # Each rank's heads read all of the latent: a split latent would give them a slice of it.
            bad = ", ".join(f"{p} ({styles.get(p)})" for p in h.latent if styles.get(p) != "replicate")
            raise TPPlanError(
                f"tp_plan splits the low-rank latent {bad} of the latent attention ({', '.join(h.projections)}), "
                "which every head reads whole; map it to 'replicate', or map all of that attention to 'replicate'"
            )
    errors = []
    for msg, mods in problems.items():
        if mods and covered.issuperset(mods):
            notes.append(f"tp_plan decides where inference could not: {msg.split('; pass e.g.')[0]}")
        else:
            errors.append(msg)
    if errors:
        raise TPPlanError("\n".join(errors))
    vocab, embedding, output, final_norm = _outer_roles(got, shapes)
    return TPPlan(
        trunk=trunk.path,
        first_block=trunk.names[0],
        n_blocks=len(trunk.names),
        hidden_size=got.hidden,
        styles=styles,
        heads=heads,
        mlps=mlps,
        shapes=shapes,
        vocab_size=vocab,
        embedding=embedding,
        output=output,
        final_norm=final_norm,
        traced=traced,
        notes=tuple(notes),
        whole=tuple(whole),
        groups={p: tuple(trunk.names[i] for i in idx) for p, idx in groups.items()} if len(groups) > 1 else {},
        inplace=inplace,
        tails=tails,
    )


def _groups(trunk: Trunk) -> dict[str, list[int]]:
    """Pattern prefix -> indices of the blocks of one structure (`_signature`), in order of first appearance.

    One structure: ``{trunk}.*``. Several: each group's block keys, explicit (``model.layers.0``, or a set
    ``model.layers.{1,2,3}``), since ``*`` would cover the other structures' blocks too.
    """
    by_sig: dict[str, list[int]] = {}
    for i, block in enumerate(trunk.blocks):
        by_sig.setdefault(repr(_signature(block)), []).append(i)
    head = f"{trunk.path}." if trunk.path else ""
    keys = [n[len(head) :] for n in trunk.names]
    if len(by_sig) == 1 and not any("." in k for k in keys):  # blocks nested in lists of lists: explicit keys
        return {f"{head}*": list(range(len(trunk.blocks)))}

    def token(idx: list[int]) -> str:
        return keys[idx[0]] if len(idx) == 1 else "{" + ",".join(keys[j] for j in idx) + "}"

    return {head + token(idx): idx for idx in by_sig.values()}


@dataclasses.dataclass
class _Group:
    """What inference found for one block structure (patterns under its prefix)."""

    trace: _Trace
    traced: bool
    styles: dict[str, str]
    heads: dict[str, HeadInfo]
    mlps: dict[str, MLPInfo]
    shapes: dict[str, ModuleShape]
    split_norms: dict[str, tuple[str, ...]]
    problems: dict[str, tuple[str, ...]]
    notes: list[str]
    whole: tuple[str, ...]
    chunked: dict[str, tuple[int, ...]]  # projections whose output the probe saw split into parts -> their widths
    inplace: tuple[str, ...]  # projections whose output the code changes in place
    tails: tuple[str, ...] = ()  # regions whose code reads their output projection's output (`TPPlan.tails`)


def _moe_layers(model: nn.Module, block_name: str) -> tuple[str, ...]:
    # Mixture-of-experts layers are kept whole: the plan splits attention and dense MLPs around them, and each tp
    # rank runs the router and experts on the same replicated hidden state (sequence parallelism is then off:
    # parallel/tensor/apply.py). Experts are sharded by expert parallelism, not by tp.
    first = block_name + "."
    return tuple(m.name[len(first) :] for m in find_moe_layers(model) if m.name.startswith(first))


def _infer_group(
    model: nn.Module,
    trunk: Trunk,
    idx: list[int],
    prefix: str,
    outer: dict[str, nn.Module],
    marker: int,
    probed: tuple[tuple[str, ...], dict[str, nn.Module], dict[str, Any], dict[str, nn.Module]],
    got: _Trace | str,
) -> _Group:
    block, block_name = trunk.blocks[idx[0]], trunk.names[idx[0]]
    whole, kept, projections, inner = probed
    notes: list[str] = []
    traced = not isinstance(got, str)
    if isinstance(got, str):
        notes.append(
            f"the probe forward failed ({got}); pairs guessed from registration order (set the module's "
            "example_input_array to probe with a real input)"
        )
        got = _registration_order(inner, list(outer), max(marker, 0), projections)
    inf = _Inference(model, trunk, got, dict(block.named_modules()), projections, idx[0], prefix)
    if not inf.lin and len(trunk.blocks) == len(idx):
        raise TPPlanError(
            f"{block_name} holds no nn.Linear or other projection (a leaf with a 2-D weight whose forward is "
            "x @ W + b), so tensor parallelism has nothing to split"
        )
    styles, regions, split_norms = _block_styles(inf, traced, notes) if inf.lin else ({}, [], {})
    if not inf.lin:
        styles = {inf.pat(n): "replicate" for n, m in inner.items() if _is_norm(m)}
    heads: dict[str, HeadInfo] = {}
    mlps: dict[str, MLPInfo] = {}
    for r in regions:
        key = inf.pat(r.parent)
        if r.head is not None:
            heads[key if key not in heads else inf.pat(r.out)] = r.head
        else:
            projs = tuple(inf.pat(n) for n in (*r.ins, r.out))
            region = inf.pat(r.module)
            gated = len(r.ins) == 2 or bool(r.mlp_fused)
            mlps[key if key not in mlps else inf.pat(r.out)] = MLPInfo(r.hidden, gated, projs, region, r.mlp_fused)
    shapes = {inf.pat(n): s for n, m in kept.items() if (s := _shape(m)) is not None}
    head_params(inf, regions, heads)
    chunked, inplace = inf.output_uses()
    # torch's nn.MultiheadAttention: its packed q/k/v is no Linear the probe sees (parallel/tensor/mha.py).
    add_to_plan(kept, inf.pat, styles, heads, shapes)
    notes += [f"kept whole (mixture of experts): {inf.pat(w)}" for w in whole]
    # A module of the region reading its output projection's output: the region's code goes on after it.
    tails = tuple(inf.pat(r.module) for r in regions if r.module and any(
        n.startswith(r.module + ".") and r.out in src for n, src in inf.tr.producers.items()))  # fmt: skip
    return _Group(got, traced, styles, heads, mlps, shapes, split_norms, inf.problems, notes, whole, chunked, inplace,
                  tails)  # fmt: skip


def _split_norm(
    inf: _Inference, n: str, size: int, src: list[str], colwise: dict[str, _Region], fused: set[str]
) -> str:
    """The style of a norm that reads column-split projections, or a problem when no style makes it exact."""
    owns = any(True for _ in inf.mods[n].parameters(recurse=False))
    if size in {h.head_dim for p in src if (h := colwise[p].head)}:
        # Per head (Qwen3's q_norm / k_norm): each rank normalises its own heads, exact; a weight's gradient then
        # covers this rank's heads only, so 'head_norm' sums it over tp (parallel/tensor/heads.py).
        return "head_norm" if owns else "replicate"
    p = src[0]
    if len(src) == 1 and inf.pat(p) not in fused and size == inf.lin[p].out_features:
        # Over the projection's whole output (OLMoE's, OLMo2's q_norm): the weight is split like that output and
        # the norm's statistics are reduced over tp (parallel/tensor/heads.py).
        return "colwise_norm"
    inf.problem(
        f"norm {inf.pat(n)} normalizes width {size} of the column-split {inf.desc(src)}; each rank would "
        "normalize only its shard",
        dict.fromkeys([n, *src], "replicate"),
    )
    return "replicate"


def _check_split_norms(
    styles: dict[str, str], inferred: dict[str, str], split_norms: dict[str, tuple[str, ...]], covered: set[str]
) -> None:
    """After the user's overrides: a norm follows its projections, and keeps the one style exact for them."""
    for norm, src in split_norms.items():
        split = all(styles.get(p) in ("colwise", "colwise_fused") for p in src)
        want = inferred[norm] if split else "replicate"
        if norm not in covered:
            styles[norm] = want  # its projections kept whole by the tp_plan: so is the norm's input
        elif styles[norm] != want:
            how = f"reads the column-split {', '.join(src)}" if split else f"reads {', '.join(src)}, kept whole"
            raise TPPlanError(
                f"tp_plan[{norm!r}] = {styles[norm]!r}, but {norm} {how}: under that style it would train a "
                f"different model; map it to {want!r}, or keep it and {', '.join(src)} 'replicate'"
            )
    for norm, style in styles.items():
        if style in _SPLIT_NORMS and norm not in split_norms:
            raise TPPlanError(
                f"tp_plan[{norm!r}] = {style!r} applies only to a norm that reads a column-split projection, which "
                f"{norm} does not; map it to 'sequence_parallel' or 'replicate'"
            )


def _block_styles(
    inf: _Inference, traced: bool, notes: list[str]
) -> tuple[dict[str, str], list[_Region], dict[str, tuple[str, ...]]]:
    tr, lin, pat = inf.tr, inf.lin, inf.pat
    regions = inf.pair()
    colwise = {p: r for r in regions for p in r.ins}
    rowwise = {r.out for r in regions}
    fused = {k for r in regions for k in r.fused_split}
    styles: dict[str, str] = {}
    split_norms: dict[str, tuple[str, ...]] = {}  # norm reading column-split projections -> those projections
    for n, m in inf.mods.items():
        if n in lin:
            style = "colwise_fused" if pat(n) in fused else "colwise" if n in colwise else "replicate"
            styles[pat(n)] = "rowwise" if n in rowwise else style
        elif n and _is_norm(m):
            size = tr.in_width.get(n) or _norm_size(m)
            src = sorted(tr.producers.get(n, set()) & colwise.keys())
            if src:
                styles[pat(n)] = _split_norm(inf, n, size, src, colwise, fused)
                split_norms[pat(n)] = tuple(pat(p) for p in src)
                continue
            # Norms on the residual stream, outside every pair and region, can run on a sequence shard.
            on_stream = size == tr.hidden and (n in inf.idx if traced else "." not in n) and not _in(n, regions)
            styles[pat(n)] = "sequence_parallel" if on_stream else "replicate"
    if not regions and not inf.problems and not any(splittable(m) for m in inf.mods.values()):
        inf.problem(
            f"found no attention or MLP in {inf.block_name}: no Linear back to the hidden width {tr.hidden} is "
            f"the only reader of other Linears ({inf.desc(lin)})",
            dict.fromkeys(lin, "replicate"),
        )
    latent = {k for r in regions if r.head for k in r.head.latent}
    # An attention torch packs (`tensor.mha`) pairs its own out_proj, which the probe never sees called.
    packed = {f"{n}.out_proj" for n, m in inf.mods.items() if splittable(m)}
    spare = [pat(n) for n in lin if n not in colwise and n not in rowwise and pat(n) not in latent and n not in packed]
    if spare and regions:
        notes.append(_SPARE + ", ".join(spare))
    if fused & inf.guessed:
        fused = fused & inf.guessed
        notes.append(
            f"colwise_fused ({', '.join(sorted(fused))}) assumes a [q | k | v] output; for a head-by-head "
            "interleaved one (GPT-NeoX query_key_value) override it with 'colwise'"
        )
    return styles, regions, split_norms


def _override(
    styles: dict[str, str],
    shapes: dict[str, ModuleShape],
    fused: set[str],
    chunked: dict[str, tuple[int, ...]],
    overrides: dict[str, str],
) -> set[str]:
    """Apply the user's ``tp_plan`` to ``styles`` in place; return the patterns it set."""
    covered: set[str] = set()
    for pattern, style in overrides.items():
        style = ALIASES.get(style, style)
        if style not in STYLES:
            raise TPPlanError(f"tp_plan[{pattern!r}] = {style!r} is not a style; choose one of {', '.join(STYLES)}")
        hits = [k for k in shapes if _glob(k, pattern)]
        if not hits:
            raise TPPlanError(
                f"tp_plan pattern {pattern!r} matches no Linear, Embedding or norm (use * for the block index); "
                f"choose from {', '.join(shapes)}"
            )
        for k in hits:
            if style not in _ALLOWED[kind := shapes[k].kind]:
                raise TPPlanError(
                    f"tp_plan[{pattern!r}] = {style!r} cannot apply to {kind} {k}; choose one of "
                    f"{', '.join(_ALLOWED[kind])}"
                )
            if style == "colwise" and k in chunked:
                # Rank r would hold columns [r*w/tp, (r+1)*w/tp) of the output: whole parts on one rank, none on
                # another, so the code that splits the output would compute something else.
                fix = "'colwise_fused' (each rank holds its slice of every part)" if k in fused else "'replicate'"
                raise TPPlanError(
                    f"tp_plan[{pattern!r}] = 'colwise' splits {k}'s output across its parts: the model splits it "
                    f"into widths {chunked[k]}, so each rank would hold whole parts of some and none of others and "
                    f"train a different model; map it to {fix}"
                )
            if style == "colwise_fused" and k not in fused:
                raise TPPlanError(
                    f"tp_plan[{pattern!r}] = 'colwise_fused' but {k} has no known split into parts ([q | k | v], "
                    "[gate | up]); use 'colwise' if its output is laid out head by head"
                )
            styles[k] = style
            covered.add(k)
    return covered
