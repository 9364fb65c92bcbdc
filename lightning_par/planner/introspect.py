"""The planner's `ModelDesc` of a live module, found by the same introspection the strategies use: the trunk of
repeated blocks, the inferred tensor-parallel plan (head counts, MLP widths, vocabulary, embedding and head) and
the mixture-of-experts layers. No per-model table: any model the strategies can split, the planner can price.

The module may be on the meta device (built under ``torch.device("meta")``): only shapes are read, and the plan's
probe forward runs on meta tensors.
"""

from __future__ import annotations

from torch import nn

from lightning_par.parallel.experts.finder import find_moe_layers
from lightning_par.parallel.tensor import infer_tp_plan
from lightning_par.planner.model import ModelDesc


class DescError(ValueError):
    """The module is not a transformer the planner can describe; the message names what was not found."""


def desc_from_module(model: nn.Module) -> ModelDesc:
    """Describe ``model`` (a LightningModule or any module holding a decoder transformer) for the planner.

    Raises:
        DescError: no trunk of repeated blocks with attention was found (name the fix: describe the model with
            `ModelDesc` or `lightning_par.planner.from_hf_config`).
    """
    try:
        plan = infer_tp_plan(model)
    except ValueError as err:
        raise DescError(
            f"the planner could not read the model's structure ({err}); describe it with "
            "lightning_par.planner.ModelDesc(...) or pass its Hugging Face config.json (--model-config)"
        ) from err
    if not plan.heads:
        raise DescError("no attention module was found in the model's blocks; describe it with ModelDesc(...)")
    heads = next(iter(plan.heads.values()))
    mlp = next(iter(plan.mlps.values()), None)
    moe = find_moe_layers(model)
    params = dict(model.named_parameters())
    embedding = _weight(model, plan.embedding)
    output = _weight(model, plan.output)
    tied = embedding is not None and output is not None and embedding is output
    if mlp is not None:
        ffn, gated = mlp.hidden, mlp.gated
    else:
        ffn, gated = _expert_width(moe[0].experts, moe[0].n_experts, plan.hidden_size) if moe else (0, True)
    positions = max((p.shape[0] for n, p in params.items() if _is_positions(n, p, plan.hidden_size)), default=0)
    has_bias = any(n.endswith(".bias") and p.ndim == 1 and p.shape[0] != plan.hidden_size for n, p in params.items())
    norms = [m for m in model.modules() if isinstance(m, nn.LayerNorm)]
    return ModelDesc(
        layers=plan.n_blocks, hidden=plan.hidden_size, heads=heads.n_heads, kv_heads=heads.n_kv_heads,
        head_dim=heads.head_dim, ffn=ffn or 4 * plan.hidden_size, vocab=plan.vocab_size or 1, gated_mlp=gated,
        experts=moe[0].n_experts if moe else 0, top_k=(moe[0].top_k or 1) if moe else 0, tied_embeddings=tied,
        layernorm=bool(norms), bias=has_bias, learned_positions=positions, dropout=_dropout(model),
        activation=_activation(model, gated), qk_norm="head_norm" in plan.styles.values(),
    )  # fmt: skip


def _dropout(model: nn.Module) -> float:
    # Dropout modules (GPT-2's attn_dropout / resid_dropout) or a float the attention passes to SDPA (Llama's).
    probs = [m.p for m in model.modules() if isinstance(m, nn.Dropout)]
    probs += [float(v) for m in model.modules() for k, v in vars(m).items()
              if k in ("attention_dropout", "attn_dropout") and isinstance(v, float)]  # fmt: skip
    return max(probs, default=0.0)


def _activation(model: nn.Module, gated: bool) -> str:
    # Activation modules by what they compute: a tanh-approximated GeLU (HF's NewGELU / gelu_pytorch_tanh,
    # nn.GELU(approximate="tanh")), the exact GeLU, SiLU; else what the MLP's shape implies.
    for m in model.modules():
        name = type(m).__name__.lower()
        if "newgelu" in name or "tanh" in name or getattr(m, "approximate", "none") == "tanh":
            return "gelu_tanh"
        if isinstance(m, nn.SiLU) or "silu" in name:
            return "silu"
        if isinstance(m, nn.GELU) or "gelu" in name:
            return "gelu"
    return "silu" if gated else "gelu"


def _weight(model: nn.Module, name: str | None) -> nn.Parameter | None:
    if not name:
        return None
    try:
        weight = model.get_submodule(name).weight
    except AttributeError:
        return None
    return weight if isinstance(weight, nn.Parameter) else None


def _is_positions(name: str, p: nn.Parameter, hidden: int) -> bool:
    # A learned position table: an embedding weight whose rows are positions (GPT-2's wpe), found by its name.
    return p.ndim == 2 and p.shape[1] == hidden and any(k in name for k in ("wpe", "position_embeddings", "pos_emb"))


def _expert_width(experts: nn.Module, n_experts: int, hidden: int) -> tuple[int, bool]:
    """(inner width, gated) of one expert from its weights: a gated expert holds 3 h x f matrices (or a fused
    gate-up of width 2f and a down projection), a plain one 2; weights stacked over experts or one module each."""
    weights = [p for p in experts.parameters() if p.ndim >= 2]
    per_expert = sum(p.numel() for p in weights) // n_experts
    gated_width = per_expert // (3 * hidden)
    per_expert_mats = len(weights) // (1 if any(p.ndim == 3 for p in weights) else n_experts)
    fused = any(gated_width and 2 * gated_width in p.shape for p in weights)
    if per_expert % (3 * hidden) == 0 and (per_expert_mats == 3 or fused):
        return gated_width, True
    return per_expert // (2 * hidden), False
