"""Infer a tensor-parallel plan for a model's repeated blocks from structure and shapes; no process groups.

Megatron-LM pairing (arXiv 1909.08053): a Linear is split by columns only when its output is read by exactly one
Linear, split by rows, that maps back to the hidden width E, so each pair costs one all-reduce (or reduce-scatter
plus all-gather under sequence parallelism, arXiv 2205.05198). Who reads whom comes from the autograd graph of one
forward pass on a (1, 8) token batch; widths say what a pair is, names only break ties: one or two E->H into H->E
is an MLP (plain or gated); E->Q, E->K, E->K (K < Q: grouped query) or one fused E->Q+2K into Q->E is attention.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_par.plans._probe import _is_norm, _norm_size, _registration_order, _Trace, _trace
from lightning_par.plans.trunk import Trunk, find_trunk

STYLES = ("colwise", "rowwise", "colwise_fused_qkv", "sequence_parallel", "replicate")
_SHARDED = ("colwise", "rowwise", "colwise_fused_qkv")
_ALLOWED = {
    "linear": ("colwise", "rowwise", "colwise_fused_qkv", "replicate"),
    "embedding": ("colwise", "rowwise", "replicate"),
    "norm": ("sequence_parallel", "replicate"),
}
_HEAD_DIM = ("head_dim", "head_size", "attention_head_size", "d_head")
_N_HEADS = ("n_heads", "n_head", "num_heads", "num_attention_heads")
_N_KV = ("n_kv_heads", "num_key_value_heads", "n_kv_head", "num_kv_heads", "n_head_kv")
_WIDTH = ("n_embd", "hidden_size", "embed_dim", "all_head_size")
_QKV_HINTS = (("q", "wq", "q_proj", "query"), ("k", "wk", "k_proj", "key"), ("v", "wv", "v_proj", "value"))


class TPPlanError(ValueError):
    """A tensor-parallel plan cannot be inferred, overridden or used at the requested tp."""


@dataclasses.dataclass(frozen=True)
class ModuleShape:
    """Kind and the two dims a style can split: Linear (in, out), Embedding (vocab, dim), norm (size, size)."""

    kind: str
    in_dim: int
    out_dim: int


@dataclasses.dataclass(frozen=True)
class HeadInfo:
    """Head counts of one attention module (``n_kv_heads < n_heads`` under grouped-query attention).

    Args:
        source: the attribute ``head_dim`` was read (or derived) from.
        local_attrs: the module's int attributes holding a global count, by kind ("n_heads", "n_kv_heads",
            "q_width"): code that uses them in ``view`` needs them rewritten to per-rank values.
        fused_split: fused projection pattern -> widths of its output chunks, ``(q, k, v)`` or ``(k, v)``.
        projections: q, k, v (or the fused one), then the output projection.
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    source: str
    local_attrs: dict[str, str]
    fused_split: dict[str, tuple[int, ...]]
    projections: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class MLPInfo:
    """One feed-forward: ``hidden`` inner width, ``gated`` for two input projections, then the output one."""

    hidden: int
    gated: bool
    projections: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class TPPlan:
    """A tensor-parallel plan: styles by module pattern plus what tp has to divide. Print with `format_plan`.

    Args:
        trunk: path of the block container; patterns name blocks ``{trunk}.*``; first_block names block 0.
        styles: pattern -> one of `STYLES` for every Linear and norm of a block, plus overridden outer modules.
        heads, mlps: attention / MLP module pattern -> head counts / inner width.
        shapes: every Linear, Embedding and norm (block ones as patterns) -> kind and dims, for overrides.
        vocab_size, embedding, output, final_norm: the head's width, token embedding, head and the norm before it.
        traced: False when the forward pass failed and pairs were guessed from registration order.
    """

    trunk: str
    first_block: str
    n_blocks: int
    hidden_size: int
    styles: dict[str, str]
    heads: dict[str, HeadInfo]
    mlps: dict[str, MLPInfo]
    shapes: dict[str, ModuleShape]
    vocab_size: int | None
    embedding: str | None
    output: str | None
    final_norm: str | None
    traced: bool
    notes: tuple[str, ...]

    @property
    def mlp_hidden(self) -> dict[str, int]:
        return {k: m.hidden for k, m in self.mlps.items()}

    @property
    def sequence_parallel(self) -> tuple[str, ...]:
        return tuple(k for k, s in self.styles.items() if s == "sequence_parallel")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _shape(m: nn.Module) -> ModuleShape | None:
    if isinstance(m, nn.Linear):
        return ModuleShape("linear", m.in_features, m.out_features)
    if isinstance(m, nn.Embedding):
        return ModuleShape("embedding", m.num_embeddings, m.embedding_dim)
    return ModuleShape("norm", _norm_size(m), _norm_size(m)) if _is_norm(m) else None


def _lookup(obj: Any, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        v = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return name, v
    return None


@dataclasses.dataclass
class _Region:
    parent: str
    ins: tuple[str, ...]
    out: str
    hidden: int
    head: HeadInfo | None


class _Inference:
    def __init__(self, model: nn.Module, trunk: Trunk, tr: _Trace, mods: dict[str, nn.Module]) -> None:
        self.model, self.trunk, self.tr, self.mods = model, trunk, tr, mods
        self.lin = {n: m for n, m in mods.items() if isinstance(m, nn.Linear)}
        self.idx = {n: i for i, n in enumerate(tr.order)}
        self.prefix = f"{trunk.path}.*" if trunk.path else "*"
        self.problems: dict[str, tuple[str, ...]] = {}  # message -> patterns an override must cover to silence it

    def pat(self, rel: str) -> str:
        return f"{self.prefix}.{rel}" if rel else self.prefix

    def problem(self, msg: str, hint: dict[str, str]) -> None:
        plan = ", ".join(f'"{self.pat(k)}": "{v}"' for k, v in hint.items())
        self.problems[f"{msg}; pass e.g. tp_plan={{{plan}}} (styles: {', '.join(STYLES)})"] = tuple(
            self.pat(k) for k in hint
        )

    def desc(self, names: Any) -> str:
        return ", ".join(f"{self.pat(n)} ({self.lin[n].in_features}->{self.lin[n].out_features})" for n in names)

    def by_hint(self, names: list[str]) -> list[str]:
        def key(n: str) -> tuple[int, int]:
            last = n.rsplit(".", 1)[-1].lower()
            return next((i for i, h in enumerate(_QKV_HINTS) if last in h), 3), self.idx.get(n, 0)

        return sorted(names, key=key)

    def sources(self, parent: str) -> list[tuple[str, Any]]:
        block, pmod, model = self.trunk.names[0], self.mods[parent], self.model
        here = f"{block}.{parent}" if parent else block
        got = [(here, pmod), (f"{here}.config", getattr(pmod, "config", None)), (block, self.trunk.blocks[0])]
        got += [(f"model{a}", getattr(model, a[1:], None) if a else model) for a in ("", ".config", ".hparams")]
        return [(label, obj) for label, obj in got if obj is not None]

    def classify(self, o: str, ins: list[str]) -> _Region | None:
        lin, e = self.lin, self.tr.hidden
        q, parent = lin[o].in_features, o.rpartition(".")[0]
        pmod = self.mods[parent]
        own = _lookup(vars(pmod), _HEAD_DIM + _N_HEADS) is not None
        pair = {**dict.fromkeys(ins, "colwise"), o: "rowwise"}
        a = [p for p in ins if lin[p].out_features == q]
        b = [p for p in ins if lin[p].out_features != q]
        bw = [lin[p].out_features for p in b]
        what = f"{self.pat(o)} ({q}->{e}) reads {self.desc(ins)}"
        if any(lin[p].in_features != e for p in ins):
            self.problem(f"{what}, which do not all read the hidden width {e}", dict.fromkeys(pair, "replicate"))
            return None
        if not b and (len(a) == 1 or (len(a) == 2 and not own)):
            return _Region(parent, tuple(ins), o, q, None)
        if (not own and len(b) == 1 and bw[0] != 3 * q) or (own and not b and len(a) == 2):
            # E->2H may be a fused gate+up, E->H twice a gate and up; only a head attribute marks attention.
            self.problem(f"{what}: an MLP or attention with fused projections? ('replicate' is always safe)", pair)
            return None
        fused: dict[str, tuple[int, ...]] = {}
        if not b and len(a) == 3:
            qkv, kw = tuple(self.by_hint(a)), q
        elif len(a) == 1 and len(b) == 2 and bw[0] == bw[1]:
            qkv, kw = (a[0], *self.by_hint(b)), bw[0]
        elif len(a) == 1 and len(b) == 1:
            qkv, kw = (a[0], b[0]), bw[0] // 2
            fused[self.pat(b[0])] = (kw, bw[0] - kw)
        elif not a and len(b) == 1 and bw[0] > q:
            qkv, kw = (b[0],), (bw[0] - q) // 2
            fused[self.pat(b[0])] = (q, kw, bw[0] - q - kw)
        else:
            self.problem(f"{what}: neither an MLP (E->H, H->E) nor attention (E->Q, E->K, E->K or E->Q+2K, Q->E)", pair)
            return None
        srcs, hd, src = self.sources(parent), 0, ""
        for label, obj in srcs:
            hit = _lookup(obj, _HEAD_DIM) or _lookup(obj, _N_HEADS)
            if hit:
                hd, src = (hit[1] if hit[0] in _HEAD_DIM else q // hit[1]), f"{label}.{hit[0]}"
                break
        where = f"attention {self.pat(parent)} ({self.desc(qkv)} into {self.pat(o)})"
        if not hd:
            self.problem(f"{where} has no head count: give it a head_dim or n_heads attribute", pair)
            return None
        n_heads, n_kv = q // hd, kw // hd
        if q % hd or kw % hd or any(w[-1] != w[-2] for w in fused.values()) or n_kv == 0 or n_heads % n_kv:
            widths = f"q={q}" + "".join(f", {k}={w}" for k, w in fused.items())
            self.problem(
                f"{where}: {widths} does not split into whole heads of head_dim={hd} (from {src}) with k and v of "
                f"{kw} each and n_heads a multiple of n_kv_heads",
                dict.fromkeys(pair, "replicate"),
            )
            return None
        for names, value, kind in ((_N_HEADS, n_heads, "heads"), (_N_KV, n_kv, "k/v heads")):
            first = next(((lb, h) for lb, obj in srcs if (h := _lookup(obj, names))), None)
            if first and first[1][1] != value:
                self.problem(
                    f"{where} has {value} {kind} by its widths but {first[0]}.{first[1][0]}={first[1][1]}", pair
                )
                return None
        local = {}
        for names, kind, value in ((_N_HEADS, "n_heads", n_heads), (_N_KV, "n_kv_heads", n_kv), (_WIDTH, "q_width", q)):
            local.update({a_: kind for a_ in names if vars(pmod).get(a_) == value})
        projs = tuple(self.pat(n) for n in (*qkv, o))
        return _Region(parent, tuple(ins), o, q, HeadInfo(n_heads, n_kv, hd, src, local, fused, projs))

    def pair(self) -> list[_Region]:
        """Megatron pairs: each Linear back to E with the Linears it alone reads, in call order."""
        lin, tr = self.lin, self.tr
        called = sorted((n for n in lin if n in tr.producers or n in self.idx), key=lambda n: self.idx.get(n, 0))
        readers: dict[str, set[str]] = {n: set() for n in lin}
        for o in lin:
            for p in tr.producers.get(o, ()):
                readers[p].add(o)
        regions: list[_Region] = []
        taken_in: set[str] = set()
        taken_out: set[str] = set()
        for o in called:
            # Width-1 outputs (a per-token gate) broadcast over the shards and stay replicated.
            ins = sorted((p for p in tr.producers.get(o, ()) if lin[p].out_features > 1), key=lambda n: self.idx[n])
            if lin[o].out_features != tr.hidden or not ins or o in taken_in or taken_out.intersection(ins):
                continue  # no input projection, or it reads an earlier pair's output (the residual stream)
            others = set().union(*(readers[p] for p in ins)) - {o}
            if others:
                rivals = sorted(others | {o}, key=lambda n: self.idx.get(n, 0))
                if all(lin[r].out_features == tr.hidden for r in others):
                    msg, hint = "could each be the output projection", "rowwise"
                else:
                    msg, hint = "all read them, so they cannot be split by columns", "replicate"
                self.problem(
                    f"{self.desc(ins)}: {' and '.join(map(self.pat, rivals))} {msg}",
                    {**dict.fromkeys(ins, "colwise" if hint == "rowwise" else hint), **dict.fromkeys(rivals, hint)},
                )
                continue
            region = self.classify(o, ins)
            if region is not None:
                regions.append(region)
                taken_in.update(ins)
                taken_out.add(o)
        return regions


def _signature(block: nn.Module) -> list[tuple[str, str, list[tuple[int, ...]]]]:
    return [
        (n, type(m).__name__, [tuple(p.shape) for p in m.parameters(recurse=False)]) for n, m in block.named_modules()
    ]


def _glob(name: str, pattern: str) -> bool:
    a, b = name.split("."), pattern.split(".")
    return len(a) == len(b) and all(fnmatch.fnmatchcase(x, y) for x, y in zip(a, b))


def infer_tp_plan(model: nn.Module, *, overrides: dict[str, str] | None = None) -> TPPlan:
    """Infer which Linears of the model's blocks to split by columns or rows, and the head counts tp must divide.

    Args:
        model: the user's module; it is only inspected (one forward pass on a (1, 8) batch of token 0, in eval
            mode, with hooks that are removed afterwards).
        overrides: the user's ``tp_plan``: module-name patterns (``*`` for the block index, globs allowed) to
            styles; they replace inferred styles, and silence inference errors about the modules they cover.

    Raises:
        TPPlanError: no trunk, blocks that differ, ambiguous or unsplittable projections (naming the modules and
            showing a ``tp_plan``), or a bad override.
    """
    trunk = find_trunk(model)
    if trunk is None:
        raise TPPlanError("found no trunk of >= 2 same-class blocks in a ModuleList/Sequential/ModuleDict")
    ref = _signature(trunk.blocks[0])
    for name, block in zip(trunk.names[1:], trunk.blocks[1:]):
        sig = _signature(block)
        if sig != ref:
            i = next((i for i, (x, y) in enumerate(zip(ref, sig)) if x != y), min(len(ref), len(sig)))
            a, b = (ref[i] if i < len(ref) else "nothing"), (sig[i] if i < len(sig) else "nothing")
            raise TPPlanError(
                f"blocks differ: {trunk.names[0]} has {a} where {name} has {b}; one tp plan covers all blocks of "
                f"{trunk.path or 'the model'}, so give them one structure"
            )
    inner = {n: m for n, m in trunk.blocks[0].named_modules() if n and (isinstance(m, nn.Linear) or _is_norm(m))}
    in_blocks = set(trunk.names)
    outer: dict[str, nn.Module] = {}
    marker = -1
    for n, m in model.named_modules():
        if n == trunk.path and marker < 0:
            marker = len(outer)
        parts = n.split(".")
        if not any(".".join(parts[:j]) in in_blocks for j in range(1, len(parts) + 1)) and _shape(m) is not None:
            outer[n] = m
    notes: list[str] = []
    got = _trace(model, trunk.blocks[0], inner, outer)
    traced = not isinstance(got, str)
    if isinstance(got, str):
        notes.append(f"forward on a (1, 8) token batch failed ({got}); pairs guessed from registration order")
        got = _registration_order(inner, list(outer), max(marker, 0))
    inf = _Inference(model, trunk, got, dict(trunk.blocks[0].named_modules()))
    if not inf.lin:
        raise TPPlanError(f"{trunk.names[0]} holds no nn.Linear, so tensor parallelism has nothing to split")
    styles, regions = _block_styles(inf, traced, notes)
    heads: dict[str, HeadInfo] = {}
    mlps: dict[str, MLPInfo] = {}
    for r in regions:
        key = inf.pat(r.parent)
        if r.head is not None:
            heads[key if key not in heads else inf.pat(r.out)] = r.head
        else:
            projs = tuple(inf.pat(n) for n in (*r.ins, r.out))
            mlps[key if key not in mlps else inf.pat(r.out)] = MLPInfo(r.hidden, len(r.ins) == 2, projs)
    shapes = {inf.pat(n): s for n, m in inf.mods.items() if n and (s := _shape(m)) is not None}
    shapes.update({n: s for n, m in outer.items() if (s := _shape(m)) is not None})
    covered = _override(styles, shapes, {k for h in heads.values() for k in h.fused_split}, overrides or {})
    errors = []
    for msg, mods in inf.problems.items():
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
    )


def _block_styles(inf: _Inference, traced: bool, notes: list[str]) -> tuple[dict[str, str], list[_Region]]:
    tr, lin, pat = inf.tr, inf.lin, inf.pat
    regions = inf.pair()
    colwise = {p: r for r in regions for p in r.ins}
    rowwise = {r.out for r in regions}
    fused = {k for r in regions if r.head for k in r.head.fused_split}
    styles: dict[str, str] = {}
    for n, m in inf.mods.items():
        if n in lin:
            style = "colwise_fused_qkv" if pat(n) in fused else "colwise" if n in colwise else "replicate"
            styles[pat(n)] = "rowwise" if n in rowwise else style
        elif n and _is_norm(m):
            size = tr.in_width.get(n) or _norm_size(m)
            src = sorted(tr.producers.get(n, set()) & colwise.keys())
            if src and size not in {h.head_dim for p in src if (h := colwise[p].head)}:
                inf.problem(
                    f"norm {pat(n)} normalizes width {size} of the column-split {inf.desc(src)}; each rank would "
                    "normalize only its shard",
                    dict.fromkeys([n, *src], "replicate"),
                )
            # Norms on the residual stream, outside every pair, can run on a sequence shard.
            on_stream = size == tr.hidden and not src and (n in inf.idx if traced else "." not in n)
            styles[pat(n)] = "sequence_parallel" if on_stream else "replicate"
    if not regions and not inf.problems:
        inf.problem(
            f"found no attention or MLP in {inf.trunk.names[0]}: no Linear back to the hidden width {tr.hidden} is "
            f"the only reader of other Linears ({inf.desc(lin)})",
            dict.fromkeys(lin, "replicate"),
        )
    spare = [pat(n) for n in lin if n not in colwise and n not in rowwise]
    if spare and regions:
        notes.append(f"replicated, not in a column/row pair: {', '.join(spare)}")
    if fused:
        notes.append(
            f"colwise_fused_qkv ({', '.join(sorted(fused))}) assumes a [q | k | v] output; for a head-by-head "
            "interleaved one (GPT-NeoX query_key_value) override it with 'colwise'"
        )
    return styles, regions


def _outer_roles(tr: _Trace, sh: dict[str, ModuleShape]) -> tuple[int | None, str | None, str | None, str | None]:
    """Vocabulary size, token embedding, output head and final norm, by their place around the trunk."""
    before, after = tr.outer[: tr.marker], tr.outer[tr.marker :]
    heads = [n for n in after if sh[n].kind == "linear" and sh[n].in_dim == tr.hidden]
    output = heads[-1] if heads else None
    vocab = sh[output].out_dim if output else None
    embeds = [n for n in before if sh[n].kind == "embedding" and sh[n].in_dim == (vocab or sh[n].in_dim)]
    vocab = vocab or (sh[embeds[0]].in_dim if embeds else None)
    norms = [n for n in after[: after.index(output) if output else None] if sh[n].kind == "norm"]
    norms = [n for n in norms if sh[n].in_dim == tr.hidden]
    return vocab, embeds[0] if embeds else None, output, norms[-1] if norms else None


def _override(
    styles: dict[str, str], shapes: dict[str, ModuleShape], fused: set[str], overrides: dict[str, str]
) -> set[str]:
    """Apply the user's ``tp_plan`` to ``styles`` in place; return the patterns it set."""
    covered: set[str] = set()
    for pattern, style in overrides.items():
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
            if style == "colwise_fused_qkv" and k not in fused:
                raise TPPlanError(
                    f"tp_plan[{pattern!r}] = 'colwise_fused_qkv' but {k} has no known q/k/v split; use 'colwise' if "
                    "its output is laid out head by head"
                )
            styles[k] = style
            covered.add(k)
    return covered
