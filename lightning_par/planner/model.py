"""The planner's description of a transformer: the shapes that decide memory and FLOPs, from a Hugging Face
``config.json`` (GPT-2, Llama-style and Mixtral-style keys).

Pure data and arithmetic: no torch module is built. Parameter counts are derived term by term from the shapes
(embedding, attention projections with grouped key/value heads, a GELU or gated (SwiGLU) MLP or a mixture of
experts with its router, norms, the head unless tied) and equal what the Hugging Face classes build
(`tests/test_plan_model.py` builds each on the meta device and counts).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Union

# model_type -> how its config names the shapes. Llama-style: every family whose decoder layer is Llama's (q, k, v,
# o projections; gate / up / down MLP; two RMSNorms); Mixtral-style adds a router and per-expert gated MLPs.
_LLAMA_STYLE = ("llama", "mistral", "qwen3")
_MIXTRAL_STYLE = ("mixtral",)
_GPT2_STYLE = ("gpt2",)
KNOWN_TYPES = _GPT2_STYLE + _LLAMA_STYLE + _MIXTRAL_STYLE
ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
# Hugging Face activation names -> the planner's; a saved config.json omits values equal to the class default, so the
# defaults below are the classes' own (GPT2Config: gelu_new, 0.1 dropouts; LlamaConfig: silu, no dropout).
_HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                   "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh"}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class ModelDesc:
    """A decoder-only transformer's shapes.

    Args:
        layers: transformer blocks.
        hidden: model width h.
        heads: query heads; ``kv_heads``: key/value heads (GQA; = heads without it); ``head_dim``: per head.
        ffn: MLP hidden width (per expert under MoE).
        vocab: vocabulary size.
        gated_mlp: SwiGLU-style (gate, up, down: 3 matrices) rather than GELU (2).
        experts: experts per MoE layer (0: dense); ``top_k``: experts per token.
        tied_embeddings: the head shares the input embedding.
        layernorm: LayerNorm with bias (2h per norm) rather than RMSNorm (h).
        bias: linear layers carry biases (GPT-2).
        learned_positions: rows of a learned position embedding (0 under rotary).
        qk_norm: a per-head RMSNorm on queries and keys (Qwen3).
        dropout: the residual and attention dropout probability (GPT-2's ``resid_pdrop`` / ``attn_pdrop``, Llama's
            ``attention_dropout``): it keeps masks and sends PyTorch's attention to its unfused path.
        activation: the MLP's activation, ``"silu"``, ``"gelu"`` (one fused kernel) or ``"gelu_tanh"`` (GPT-2's
            ``gelu_new``, eight element-wise kernels in eager PyTorch).
    """

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    gated_mlp: bool = True
    experts: int = 0
    top_k: int = 0
    tied_embeddings: bool = False
    layernorm: bool = False
    bias: bool = False
    learned_positions: int = 0
    qk_norm: bool = False
    dropout: float = 0.0
    activation: str = "silu"

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "kv_heads", "head_dim", "ffn", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads={self.kv_heads} must divide heads={self.heads} (grouped-query attention)")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation={self.activation!r} is not one of {ACTIVATIONS}")
        if self.experts and not 1 <= self.top_k <= self.experts:
            raise ValueError(f"top_k={self.top_k} must be in [1, experts={self.experts}]")

    # ---- parameter counts, term by term ------------------------------------------------------------------------
    def _linear(self, n_in: int, n_out: int) -> int:
        return n_in * n_out + (n_out if self.bias else 0)

    def _norm(self, width: int) -> int:
        return 2 * width if self.layernorm else width

    @property
    def attention_params(self) -> int:
        """One block's attention: q, k, v and output projections (and per-head q/k norms)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        norms = 2 * self.head_dim if self.qk_norm else 0
        return self._linear(self.hidden, q) + 2 * self._linear(self.hidden, kv) + self._linear(q, self.hidden) + norms

    @property
    def expert_params(self) -> int:
        """One expert's (or the dense MLP's) parameters."""
        mats = 3 if self.gated_mlp else 2
        biases = (self.ffn * (mats - 1) + self.hidden) if self.bias else 0
        return mats * self.hidden * self.ffn + biases

    @property
    def mlp_params(self) -> int:
        """One block's MLP: the dense MLP, or every expert plus the router."""
        if not self.experts:
            return self.expert_params
        return self.experts * self.expert_params + self.hidden * self.experts

    @property
    def block_params(self) -> int:
        """One transformer block: attention, MLP and its two norms."""
        return self.attention_params + self.mlp_params + 2 * self._norm(self.hidden)

    @property
    def embedding_params(self) -> int:
        """Token embedding, learned positions, and the head when it is not tied."""
        head = 0 if self.tied_embeddings else self.vocab * self.hidden
        return (self.vocab + self.learned_positions) * self.hidden + head

    @property
    def total_params(self) -> int:
        """Every parameter (a tied head counted once)."""
        return self.layers * self.block_params + self.embedding_params + self._norm(self.hidden)

    @property
    def active_params(self) -> int:
        """Parameters a token passes through: ``top_k`` of each MoE layer's experts."""
        if not self.experts:
            return self.total_params
        idle = self.layers * (self.experts - self.top_k) * self.expert_params
        return self.total_params - idle


def from_hf_config(config: Union[str, Path, Mapping[str, Any]]) -> ModelDesc:
    """The shapes of a Hugging Face causal LM from its ``config.json`` (a path, a folder holding one, or the dict).

    Raises:
        ValueError: an unknown ``model_type`` (listing the known ones) or missing keys (naming them and the file).
    """
    where = "the config"
    if isinstance(config, Mapping):
        cfg: Mapping[str, Any] = config
    else:
        path = Path(config)
        path = path / "config.json" if path.is_dir() else path
        where = str(path)
        cfg = json.loads(path.read_text())
    return _from_dict(cfg, where)


def _from_dict(config: Mapping[str, Any], where: str) -> ModelDesc:
    kind = config.get("model_type")
    if kind not in KNOWN_TYPES:
        raise ValueError(
            f"{where}: model_type={kind!r} is not one the planner reads; known: {', '.join(KNOWN_TYPES)}. Describe "
            "the model with lightning_par.planner.ModelDesc(...) instead"
        )

    def need(*keys: str) -> list[Any]:
        missing = [k for k in keys if config.get(k) is None]
        if missing:
            raise ValueError(f"{where} ({kind}) lacks {missing}; add them to the config")
        return [config[k] for k in keys]

    if kind in _GPT2_STYLE:
        layers, hidden, heads, vocab, positions = need("n_layer", "n_embd", "n_head", "vocab_size", "n_positions")
        return ModelDesc(
            layers=layers, hidden=hidden, heads=heads, kv_heads=heads, head_dim=hidden // heads,
            ffn=config.get("n_inner") or 4 * hidden, vocab=vocab, gated_mlp=False,
            tied_embeddings=config.get("tie_word_embeddings", True), layernorm=True, bias=True,
            learned_positions=positions, activation=_activation(config.get("activation_function", "gelu_new"), where),
            dropout=max(config.get("resid_pdrop", 0.1), config.get("attn_pdrop", 0.1)),
        )  # fmt: skip
    layers, hidden, heads, ffn, vocab = need(
        "num_hidden_layers", "hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"
    )
    if config.get("attention_bias") or config.get("mlp_bias"):
        raise ValueError(f"{where}: attention_bias / mlp_bias are not modelled yet; describe it with ModelDesc")
    experts, top_k = need("num_local_experts", "num_experts_per_tok") if kind in _MIXTRAL_STYLE else (0, 0)
    return ModelDesc(
        layers=layers, hidden=hidden, heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or hidden // heads, ffn=ffn, vocab=vocab, experts=experts, top_k=top_k,
        tied_embeddings=bool(config.get("tie_word_embeddings", False)), qk_norm=kind == "qwen3",
        activation=_activation(config.get("hidden_act", "silu"), where), dropout=config.get("attention_dropout", 0.0),
    )  # fmt: skip


def _activation(name: str, where: str) -> str:
    if name not in _HF_ACTIVATIONS:
        raise ValueError(f"{where}: activation {name!r} is not modelled; known: {', '.join(_HF_ACTIVATIONS)}")
    return _HF_ACTIVATIONS[name]
