"""Find the Megatron column/row pairs of block 0 and the head counts of each attention; no process groups.

Megatron-LM pairing (arXiv 1909.08053): a Linear is split by columns only when its output is read by exactly one
Linear, split by rows, that maps back to the hidden width E, so each pair costs one all-reduce (or reduce-scatter
plus all-gather under sequence parallelism, arXiv 2205.05198). Who reads whom comes from the autograd graph of one
forward pass on a (1, 8) token batch; widths say what a pair is, names only break ties: one or two E->H into H->E
is an MLP (plain or gated); E->Q, E->K, E->K (K < Q: grouped query) or one fused E->Q+2K into Q->E is attention.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from torch import nn

from lightning_par.blocks._probe import _Trace, writes_in_place
from lightning_par.blocks.trunk import Trunk
from lightning_par.parallel.tensor.adapters import adapter_leaves, find_adapters
from lightning_par.parallel.tensor.plan_affine import Affine
from lightning_par.parallel.tensor.plan_types import STYLES, HeadInfo, ModuleShape

_HEAD_DIM: tuple[str, ...] = ("head_dim", "head_size", "attention_head_size", "d_head")
_N_HEADS: tuple[str, ...] = ("n_heads", "n_head", "num_heads", "num_attention_heads", "heads")
_N_KV: tuple[str, ...] = (
    "n_kv_heads", "num_key_value_heads", "n_kv_head", "num_kv_heads", "n_head_kv", "n_query_groups", "kv_heads",
)  # fmt: skip
_SPLITS = ("split", "split_with_sizes", "chunk", "tensor_split", "unsafe_split")
_WIDTH: tuple[str, ...] = ("n_embd", "hidden_size", "embed_dim", "all_head_size")
# Query heads per key/value head (Hugging Face's num_key_value_groups): changes only when k/v heads are replicated.
_GROUPS: tuple[str, ...] = ("num_key_value_groups", "n_rep", "num_queries_per_kv", "q_per_kv")
_QKV_HINTS = (("q", "wq", "q_proj", "query"), ("k", "wk", "k_proj", "key"), ("v", "wv", "v_proj", "value"))


def _lookup(obj: Any, names: tuple[str, ...]) -> tuple[str, int] | None:
    for name in names:
        v = obj.get(name) if isinstance(obj, Mapping) else getattr(obj, name, None)
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return name, v
    return None


def _common_parent(names: list[str]) -> str:
    """The deepest module that holds every one of ``names`` (block-relative; ``""`` is the block)."""
    paths = [n.split(".")[:-1] for n in names]
    common = []
    for level in zip(*paths):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


@dataclasses.dataclass
class _Region:
    parent: str
    ins: tuple[str, ...]
    out: str
    hidden: int
    head: HeadInfo | None
    mlp_fused: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)  # [gate | up] -> widths

    @property
    def fused_split(self) -> dict[str, tuple[int, ...]]:
        return self.head.fused_split if self.head else self.mlp_fused

    @property
    def module(self) -> str:
        """The block-relative module whose input tp gathers for the region: the deepest one holding the input
        projections (``""``: the block)."""
        return _common_parent(list(self.ins))


def _in(name: str, regions: list[_Region]) -> bool:
    """Whether block-relative ``name`` lies inside one of ``regions``' modules (it reads the gathered input)."""
    return any(r.module and name.startswith(f"{r.module}.") for r in regions)


class _Inference:
    def __init__(
        self,
        model: nn.Module,
        trunk: Trunk,
        tr: _Trace,
        mods: dict[str, nn.Module],
        lin: dict[str, Affine],
        block: int = 0,
        prefix: str | None = None,
    ) -> None:
        self.model, self.trunk, self.tr, self.mods = model, trunk, tr, mods
        # Low-rank adapters (peft's lora_A / lora_B) follow their base projection (parallel/tensor/adapters.py): the
        # probe traced them, so that no walk back from a projection's input passes through them, but they pair with
        # nothing.
        leaves = adapter_leaves(trunk.blocks[block])
        tr.producers = {n: found - leaves for n, found in tr.producers.items() if n not in leaves}
        self.lin = {n: a for n, a in lin.items() if n not in leaves}  # block projections (Linears, affine leaves)
        self.idx = {n: i for i, n in enumerate(tr.order)}
        # The probed block (the first of its structure) and the pattern prefix naming that structure's blocks.
        self.block_name, self.block = trunk.names[block], trunk.blocks[block]
        self.prefix = prefix if prefix is not None else f"{trunk.path}.*" if trunk.path else "*"
        self.guessed: set[str] = set()  # fused projections whose [q | k | v] layout no split confirmed
        # A projection wrapped by a low-rank adapter (peft's lora.Linear): the wrapper stands where it would.
        self.wrappers = {base: base.rpartition(".")[0] for base in find_adapters(self.block)}
        self.problems: dict[str, tuple[str, ...]] = {}  # message -> patterns an override must cover to silence it

    def parent(self, name: str) -> str:
        """The module holding projection ``name`` in the block's code: its parent, or its adapter wrapper's."""
        return self.wrappers.get(name, name).rpartition(".")[0]

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

    def sources(self, parent: str, ins: tuple[str, ...] = ()) -> list[tuple[str, Any]]:
        """Where head counts may live: the output projection's module, those of the input projections (BERT's
        ``attention.self``), each one's config, the block, the model, its config and hparams."""
        block, model = self.block_name, self.model
        got: list[tuple[str, Any]] = []
        for rel in dict.fromkeys([parent, *(self.parent(p) for p in ins)]):
            here, mod = (f"{block}.{rel}" if rel else block), self.mods[rel]
            got += [(here, mod), (f"{here}.config", getattr(mod, "config", None))]
        got.append((block, self.block))
        got += [(f"model{a}", getattr(model, a[1:], None) if a else model) for a in ("", ".config", ".hparams")]
        return [(label, obj) for label, obj in got if obj is not None]

    def classify(self, o: str, ins: list[str], latent: list[str] | None = None) -> _Region | None:
        lin, e = self.lin, self.tr.hidden
        if latent:
            return self.latent_attention(o, ins, latent)
        q, parent = lin[o].in_features, self.parent(o)
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
        found = self.parts(b[0], bw[0]) if len(b) == 1 else None
        if not own and not a and found == (q, q):
            # One E->2H split in two halves, each as wide as the output projection reads: a fused [gate | up] (Phi-3's
            # gate_up_proj, GLU MLPs). A plain column split would give rank 0 all of the gate and rank 1 all of the
            # up half; each rank must hold its slice of both halves (colwise_fused).
            return _Region(parent, tuple(ins), o, q, None, {self.pat(b[0]): found})
        # A split into (q, k, v) with k == v marks attention: a [gate | up] chunk(2) does not.
        parts = found if found and len(found) == 3 and found[0] == q and found[1] == found[2] else None
        # Or a view into (B, T, groups, ...) first: the output is laid out group by group (GPT-NeoX, older litgpt).
        groups = self.groups(b[0], bw[0]) if len(b) == 1 and not parts and bw[0] > q else None
        if (not own and len(b) == 1 and bw[0] != 3 * q and not parts and not groups) or (own and not b and len(a) == 2):
            # E->2H may be a fused gate+up, E->H twice a gate and up; only a head attribute marks attention.
            # Only 'replicate' is safe to suggest: a plain column split of a fused output splits across its parts.
            self.problem(f"{what}: an MLP or attention with fused projections?", dict.fromkeys(pair, "replicate"))
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
            # The split after it gives the parts; without one, [q | k | v] by widths (a note says so).
            fused[self.pat(b[0])] = parts or (q, kw, bw[0] - q - kw)
            if not parts and not groups:
                self.guessed.add(self.pat(b[0]))
        else:
            self.problem(f"{what}: neither an MLP (E->H, H->E) nor attention (E->Q, E->K, E->K or E->Q+2K, Q->E)", pair)
            return None
        srcs, hd, src = self.sources(parent, qkv), 0, ""
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
        if groups and not parts:
            if groups == n_kv:  # whole k/v groups, each with its q heads: a plain column split gives each rank some
                del fused[self.pat(qkv[0])]
            elif not (groups == 3 and q == kw) and not (n_kv < n_heads and groups == n_heads + 2 * n_kv):
                # view(B, T, 3, n_heads, head_dim) is [q | k | v] again, and so is a view into its heads (Falcon's
                # multi-query view(B, T, n_heads + 2, head_dim): n_heads query heads, then the k and the v head)
                self.problem(
                    f"{where}: its output is viewed as {groups} groups, neither its {n_kv} k/v heads nor [q | k | v]",
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
        cfg = getattr(pmod, "config", None)
        counts = ((_N_HEADS, "n_heads", n_heads), (_N_KV, "n_kv_heads", n_kv), (_WIDTH, "q_width", q),
                  (_GROUPS, "kv_groups", n_heads // n_kv))  # fmt: skip
        for names, kind, value in counts:
            mine = {a_: kind for a_ in names if vars(pmod).get(a_) == value}
            local.update(mine)
            if kind in ("n_heads", "n_kv_heads") and not mine and hasattr(cfg, "__dict__"):
                # No count of this kind of its own: it may read it from the config it keeps (litgpt's
                # self.config.n_head, Phi-3's self.config.num_attention_heads). tp gives the module its own copy with
                # per-rank counts (the shared original stays global for other readers).
                local.update({f"config.{a_}": kind for a_ in names if vars(cfg).get(a_) == value})
        for w in {w for p in qkv if (ws := fused.get(self.pat(p))) and p not in self.guessed for w in ws}:
            # The width a fused output is split by (GPT-2's split_size): rewritten like a head count.
            for a_, v in vars(pmod).items():
                if type(v) is int and v == w and v > 1 and a_ not in _HEAD_DIM:  # a head's width stays
                    local.setdefault(a_, "split_width")
        projs = tuple(self.pat(n) for n in (*qkv, o))
        head = HeadInfo(n_heads, n_kv, hd, src, local, fused, projs, self.pat(_common_parent(list(ins))))
        return _Region(parent, tuple(ins), o, q, head)

    def latent_attention(self, o: str, ins: list[str], latent: list[str]) -> _Region | None:
        """Multi-head latent attention: the latents whole, ``ins`` (queries; keys and values from the latent)
        column-split by heads, ``o`` row-split. Heads come from the module's head count; every split output must
        be viewed head-major, (B, T, n_heads, ...), as the probe saw it."""
        lin, e, tr = self.lin, self.tr.hidden, self.tr
        q, parent = lin[o].in_features, self.parent(o)
        # Without a head count (or views that show heads) the latent split cannot be made: whole is always safe.
        pair = dict.fromkeys([*ins, *latent, o], "replicate")
        where = f"latent attention {self.pat(parent)} ({self.desc(ins)} into {self.pat(o)}"
        where += f"; latents {self.desc(latent)})"
        bad = [p for p in ins if lin[p].in_features != e and not tr.producers.get(p, set()).issubset(latent)]
        srcs = self.sources(parent, tuple(ins))
        hit = next(((lb, h) for lb, obj in srcs if (h := _lookup(obj, _N_HEADS))), None)
        if bad or hit is None:
            why = f"{self.desc(bad)} read neither the hidden width nor a latent" if bad else "it has no head count"
            self.problem(f"{where}: {why}; give the attention an n_heads / num_heads attribute", pair)
            return None
        n_heads, src = hit[1][1], f"{hit[0]}.{hit[1][0]}"
        unviewed = [p for p in ins if self.groups(p, lin[p].out_features) != n_heads]
        if q % n_heads or unviewed:
            self.problem(
                f"{where}: {self.desc(unviewed) or f'q={q}'} not seen split into {n_heads} heads (from {src}) by a "
                "(B, T, n_heads, head_dim) view; tensor parallelism would split across heads",
                pair,
            )
            return None
        pmod, local = self.mods[parent], {}
        local.update({a_: "n_heads" for a_ in _N_HEADS if vars(pmod).get(a_) == n_heads})
        inside = f"{parent}." if parent else ""
        # The latents' norms (kv_a_layernorm, q_a_layernorm): they read nothing but a latent.
        norms = [n for n, s in tr.producers.items() if n not in lin and n.startswith(inside) and s and s <= set(latent)]
        readers = [p for p in ins if tr.producers.get(p, set()) & set(latent)]
        projs = tuple(self.pat(n) for n in (*ins, o))
        head = HeadInfo(n_heads, n_heads, q // n_heads, src, local, {}, projs,
                        self.pat(_common_parent([*ins, *latent])), (),
                        tuple(self.pat(n) for n in (*latent, *norms)), tuple(self.pat(n) for n in readers))  # fmt: skip
        return _Region(parent, tuple(ins), o, q, head)

    def parts(self, name: str, width: int) -> tuple[int, ...] | None:
        """Widths of a fused output's concatenated parts, from the split (or chunk) that first reads it."""
        op, shapes = self.tr.consumers.get(name, ("", []))
        if op not in _SPLITS or len(shapes) < 2 or any(s[:-1] != shapes[0][:-1] for s in shapes):
            return None
        widths = tuple(s[-1] for s in shapes)
        return widths if sum(widths) == width else None

    def output_uses(self) -> tuple[dict[str, tuple[int, ...]], tuple[str, ...]]:
        """Projections whose output the probe saw split into parts (-> their widths), and those whose output the
        code then changes in place (Falcon's ``mlp_output += attention_output``): a split projection's local output
        is a view autograd forbids changing in place, so those get a copy of their own (`apply`)."""
        chunked = {self.pat(n): w for n, a in self.lin.items() if (w := self.parts(n, a.out_features))}
        first = {n: self.tr.consumers.get(n, ("", []))[0] for n in self.lin}
        inplace = tuple(self.pat(n) for n, op in first.items() if writes_in_place(op))
        return chunked, inplace

    def groups(self, name: str, width: int) -> int | None:
        """The leading group count of a (B, T, groups, ...) view that first reads a fused output, if any."""
        op, shapes = self.tr.consumers.get(name, ("", []))
        if op not in ("view", "reshape", "unflatten") or len(shapes) != 1 or len(shapes[0]) < 4:
            return None
        trailing = shapes[0][2:]
        return trailing[0] if trailing[0] > 1 and math.prod(trailing) == width else None

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
            latent = self.latents(o, ins, readers)
            ins = [p for p in ins if p not in latent]
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
            region = self.classify(o, ins, latent) if ins else None
            if region is not None:
                regions.append(region)
                taken_in.update([*ins, *latent])
                taken_out.add(o)
        return regions

    def latents(self, o: str, ins: list[str], readers: dict[str, set[str]]) -> list[str]:
        """Low-rank projections of a multi-head latent attention (DeepSeek-V2/V3's ``kv_a_proj_with_mqa``,
        ``q_a_proj``): read the hidden width, narrower than it, and read by other input projections of ``o``'s
        region (and by ``o``, through a part shared by all heads). Their outputs are not head-structured, so they
        stay whole on every rank and the projections reading them are split by heads."""
        e, lin, tr = self.tr.hidden, self.lin, self.tr
        cands = dict.fromkeys([*ins, *(q for p in ins for q in sorted(tr.producers.get(p, ())))])
        return [
            p
            for p in cands
            if p != o
            and lin[p].in_features == e
            and lin[p].out_features < e
            and (r := readers[p] - {o})
            and r.issubset(ins)
        ]


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


def head_params(inf: _Inference, regions: list[_Region], heads: dict[str, HeadInfo]) -> None:
    """Record each attention's own per-head parameters (leading dim = its query heads: GPT-OSS's ``sinks``) and its
    per-head tables (an ``nn.Embedding`` child with one column per query head: T5's relative position bias)."""
    for key, head in list(heads.items()):
        r = next((r for r in regions if r.head is head), None)
        if r is None:
            continue
        attn = inf.mods[r.parent]
        own = attn.named_parameters(recurse=False)
        at = f"{r.parent}." if r.parent else ""
        found = tuple(inf.pat(at + n) for n, p in own if p.dim() and p.shape[0] == head.n_heads)
        tables = tuple(
            inf.pat(at + n)
            for n, m in attn.named_children()
            if isinstance(m, nn.Embedding) and m.embedding_dim == head.n_heads != head.head_dim
        )
        if found or tables:
            heads[key] = dataclasses.replace(head, head_params=found, head_tables=tables)
