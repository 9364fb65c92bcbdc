"""Check an inferred tensor-parallel plan against a tp degree, and print it; no process groups."""

from __future__ import annotations

import math

from lightning_par.parallel.tensor.kv_heads import kv_replicas
from lightning_par.parallel.tensor.plan_types import _SHARDED, TPPlan, TPPlanError


def _concrete(plan: TPPlan, pattern: str) -> str:
    star = f"{plan.trunk}.*" if plan.trunk else "*"
    for prefix, names in {star: (plan.first_block,), **plan.groups}.items():
        if pattern == prefix or pattern.startswith(prefix + "."):
            return names[0] + pattern[len(prefix) :]
    return pattern


def validate_tp(plan: TPPlan, tp: int, *, shard_vocab: bool = False, vocab_size: int | None = None) -> None:
    """Check that tp splits every sharded head count and width evenly, before any process group exists.

    Args:
        plan: from `infer_tp_plan`.
        tp: tensor-parallel degree.
        shard_vocab: whether the embedding and output head are split over the vocabulary.
        vocab_size: overrides ``plan.vocab_size``.

    Raises:
        TPPlanError: naming the first value tp does not divide and every tp that divides them all.
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise TPPlanError(f"tp={tp!r} must be a positive int")
    checks: list[tuple[int, str]] = []
    for key, h in plan.heads.items():
        if any(plan.styles.get(p) in _SHARDED for p in h.projections):
            where = _concrete(plan, key)
            checks.append((h.n_heads, f"n_heads={h.n_heads} in {where}"))
            if h.n_heads % tp == 0:  # fewer k/v heads than ranks: each replicated over the ranks that read it
                try:
                    kv_replicas(h, tp)
                except TPPlanError as err:
                    raise TPPlanError(f"{where}: {err}") from None
    for key, m in plan.mlps.items():
        if any(plan.styles.get(p) in _SHARDED for p in m.projections):
            checks.append((m.hidden, f"the MLP hidden size {m.hidden} in {_concrete(plan, key)}"))
    for key, style in plan.styles.items():
        if style not in _SHARDED:
            continue  # nothing to divide (a replicated norm inside a kept-whole MoE layer has no shape entry)
        s = plan.shapes[key]
        if style in ("colwise", "colwise_fused"):
            checks.append((s.out_dim, f"the output width {s.out_dim} of {_concrete(plan, key)}"))
        else:
            checks.append((s.in_dim, f"the input width {s.in_dim} of {_concrete(plan, key)}"))
    if shard_vocab:
        vocab = vocab_size if vocab_size is not None else plan.vocab_size
        if vocab is None:
            raise TPPlanError("shard_vocab=True but the plan found no output head; pass vocab_size=")
        checks.append((vocab, f"vocab_size={vocab}"))
    g = math.gcd(*(v for v, _ in checks)) if checks else 0
    for value, what in checks:
        if value % tp:
            valid = ", ".join(str(d) for d in range(1, g + 1) if g % d == 0)
            raise TPPlanError(f"tp={tp} does not divide {what}; choose tp in {{{valid}}}")


def format_plan(plan: TPPlan) -> str:
    """Render the plan as a table: one row per module pattern, then head counts, MLP widths and notes."""
    fused = plan.fused_split

    def shape(key: str) -> str:
        s = plan.shapes[key]
        if key in fused:
            return f"{s.in_dim} -> [{' | '.join(map(str, fused[key]))}]"
        if s.kind == "embedding":
            return f"embedding({s.in_dim}, {s.out_dim})"
        return f"{s.in_dim} -> {s.out_dim}" if s.kind == "linear" else f"norm({s.in_dim})"

    width = max(len(k) for k in plan.styles)
    how = "traced forward" if plan.traced else "registration order"
    lines = [f"tp plan for {plan.n_blocks} blocks of {plan.trunk or '<root>'} (hidden {plan.hidden_size}, {how})"]
    if plan.groups:
        lines.append("blocks of different structures: " + "; ".join(f"{p} ({len(n)})" for p, n in plan.groups.items()))
    lines += [f"{k:<{width}}  {s:<17}  {shape(k)}" for k, s in plan.styles.items()]
    for k, h in plan.heads.items():
        attrs = ", ".join(f"{a}: {kind}" for a, kind in h.local_attrs.items()) or "none"
        with_heads = (*h.head_params, *h.head_tables)
        split = f"; split with the heads: {', '.join(with_heads)}" if with_heads else ""
        split += f"; latent, whole on every rank: {', '.join(h.latent)}" if h.latent else ""
        lines.append(
            f"attention {k}: n_heads={h.n_heads} n_kv_heads={h.n_kv_heads} head_dim={h.head_dim} (from {h.source}); "
            f"per-rank attributes: {attrs}{split}"
        )
    lines += [f"mlp {k}: hidden={m.hidden} {'gated' if m.gated else 'plain'}" for k, m in plan.mlps.items()]
    lines.append(
        f"vocab {plan.vocab_size}: embedding {plan.embedding}, final norm {plan.final_norm}, output {plan.output}"
    )
    return "\n".join(lines + [f"note: {n}" for n in plan.notes])
