"""The data of a tensor-parallel plan: styles, module shapes, head counts and the plan itself; no torch needed."""

from __future__ import annotations

import dataclasses
from typing import Any

STYLES = ("colwise", "rowwise", "colwise_fused", "sequence_parallel", "head_norm", "colwise_norm", "replicate")
# Earlier names a tp_plan may still use: "colwise_fused" covers any fused projection ([q | k | v], [gate | up]).
ALIASES = {"colwise_fused_qkv": "colwise_fused"}
# Norms that read a column-split projection: per head (each rank normalises its own heads; the weight's gradient is
# summed over tp), or over the projection's whole output (the weight split like it; the mean of squares over tp).
_SPLIT_NORMS = ("head_norm", "colwise_norm")
_SHARDED = ("colwise", "rowwise", "colwise_fused")
_ALLOWED = {
    "linear": ("colwise", "rowwise", "colwise_fused", "replicate"),
    "embedding": ("colwise", "rowwise", "replicate"),
    "norm": ("sequence_parallel", *_SPLIT_NORMS, "replicate"),
    "attention": ("colwise_fused", "replicate"),  # torch's nn.MultiheadAttention: its packed q/k/v
}
_SPARE = "replicated, not in a column/row pair: "  # the note naming block projections no pair took


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
            "q_width", "split_width": a width the fused output is split by): code that uses them in ``view`` or
            ``split`` needs them rewritten to per-rank values. ``config.<name>`` is on the config object the module
            keeps (tp gives the module its own copy).
        fused_split: fused projection pattern -> widths of its output's parts, ``(q, k, v)`` or ``(k, v)``.
        projections: q, k, v (or the fused one), then the output projection.
        region: the smallest module holding the input projections (Hugging Face's BERT keeps q/k/v in
            ``attention.self``, the output one and a residual add in ``attention.output``): its input becomes one
            replicated DTensor for all of them (gathered along the sequence under SP).
        head_params: patterns of the attention module's own parameters with one entry per query head along dim
            0 (GPT-OSS's ``sinks``): split with the heads, so each rank holds its heads' entries.
        latent: multi-head latent attention (DeepSeek-V2/V3): the low-rank projections (``kv_a_proj_with_mqa``,
            ``q_a_proj``) and the norms on their outputs, replicated on every rank inside the split region.
        latent_readers: the column-split projections that read a latent (``kv_b_proj``, ``q_b_proj``).
        head_tables: patterns of ``nn.Embedding``s inside the attention whose ``embedding_dim`` is its query head
            count (T5's ``relative_attention_bias``, one column per head): split by columns with the heads, so
            the bias they make, and that later blocks receive with the hidden state, holds this rank's heads.
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    source: str
    local_attrs: dict[str, str]
    fused_split: dict[str, tuple[int, ...]]
    projections: tuple[str, ...]
    region: str = ""
    head_params: tuple[str, ...] = ()
    latent: tuple[str, ...] = ()
    latent_readers: tuple[str, ...] = ()
    head_tables: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class MLPInfo:
    """One feed-forward: ``hidden`` inner width, ``gated`` for a gate and an up projection (two, or one fused
    ``[gate | up]``: Phi-3's ``gate_up_proj``, then ``fused_split`` maps it to ``(hidden, hidden)``), then the output
    one; ``region`` the smallest module holding the input projections (see `HeadInfo`)."""

    hidden: int
    gated: bool
    projections: tuple[str, ...]
    region: str = ""
    fused_split: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


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
        whole: block-relative names of mixture-of-experts layers kept whole on every tp rank (their router and
            experts are computed redundantly on the replicated hidden state; expert parallelism shards experts).
        groups: for a trunk whose blocks differ (DeepSeek-V3's dense first block), each structure's pattern prefix
            (``model.layers.0``, ``model.layers.{1,2,3}``: the block index explicit where ``*`` would be wrong) ->
            the names of the blocks it covers; empty when all blocks share one structure (patterns use ``*``).
        inplace: projections whose output the model changes in place (``+=``): split, they hand on a copy.
        gathered: attentions / MLPs (keys of ``heads`` / ``mlps``) whose code sizes its tensors from the full width
            (nanoGPT's ``split(C)``): their projections stay split, the code between them runs on the gathered
            outputs (`lightning_par.parallel.tensor.full_width`); set by the check before training.
        tails: attention / MLP modules whose own code continues after their output projection (ALBERT's attention
            adds its input back and normalises): their input is not made one replicated DTensor for the input
            projections (the residual add would meet it), each input projection reduces its own input gradient,
            and sequence parallelism is off.
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
    whole: tuple[str, ...] = ()
    groups: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    inplace: tuple[str, ...] = ()
    gathered: tuple[str, ...] = ()
    tails: tuple[str, ...] = ()

    @property
    def fused_split(self) -> dict[str, tuple[int, ...]]:
        """Every fused projection (attention's and MLPs') -> the widths of its output's parts."""
        infos: list[HeadInfo | MLPInfo] = [*self.heads.values(), *self.mlps.values()]
        return {k: w for info in infos for k, w in info.fused_split.items()}

    @property
    def mlp_hidden(self) -> dict[str, int]:
        return {k: m.hidden for k, m in self.mlps.items()}

    @property
    def sequence_parallel(self) -> tuple[str, ...]:
        return tuple(k for k, s in self.styles.items() if s == "sequence_parallel")

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def group_plans(self) -> list[TPPlan]:
        """One plan per block structure, each written with ``{trunk}.*`` patterns over the blocks it names in
        ``groups`` (as for a uniform trunk), so code that applies or checks a uniform plan handles each group; the
        plan itself when all blocks share one structure."""
        if not self.groups:
            return [self]
        return [_regroup(self, prefix, names) for prefix, names in self.groups.items()]


def _regroup(plan: TPPlan, prefix: str, names: tuple[str, ...]) -> TPPlan:
    star = f"{plan.trunk}.*" if plan.trunk else "*"
    others = tuple(p for p in plan.groups if p != prefix)

    def key(k: str) -> str:
        return star + k[len(prefix) :] if k == prefix or k.startswith(prefix + ".") else k

    def mine(k: str) -> bool:
        return not any(k == p or k.startswith(p + ".") for p in others)

    def keys(ks: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(key(k) for k in ks)

    heads = {
        key(k): dataclasses.replace(
            h, fused_split=_keyed(key, h.fused_split), projections=keys(h.projections),
            region=key(h.region), head_params=keys(h.head_params), latent=keys(h.latent),
            head_tables=keys(h.head_tables),
            latent_readers=keys(h.latent_readers),
        )
        for k, h in plan.heads.items() if mine(k)
    }  # fmt: skip
    mlps = {
        key(k): dataclasses.replace(
            m, projections=keys(m.projections), region=key(m.region), fused_split=_keyed(key, m.fused_split)
        )
        for k, m in plan.mlps.items()
        if mine(k)
    }
    return dataclasses.replace(
        plan, first_block=names[0], n_blocks=len(names), styles={key(k): s for k, s in plan.styles.items() if mine(k)},
        heads=heads, mlps=mlps, shapes={key(k): s for k, s in plan.shapes.items() if mine(k)}, groups={},
        inplace=tuple(key(k) for k in plan.inplace if mine(k)),
        gathered=tuple(key(k) for k in plan.gathered if mine(k)), tails=tuple(key(k) for k in plan.tails if mine(k)),
    )  # fmt: skip


def _keyed(key: Any, fused: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    return {key(f): w for f, w in fused.items()}
