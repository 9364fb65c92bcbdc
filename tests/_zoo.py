"""Any causal language model of the installed transformers, shrunk by one rule and wrapped as a user would wrap it.

The rule (`shrink`) is written once for every architecture, no per-model table: each size a config may name is set
under whichever of its usual names the config has (width 32, 2 layers, 4 query and 2 key/value heads of 8, MLP 64,
4 experts with 2 per token, rotary parts of 4 within a head, vocabulary 256, 64 positions), no KV cache, lists
with one entry per layer keep 2, dropout and router jitter are off (random draws no two layouts share).
`ZooLM` trains it on byte tokens with SGD + momentum (parameters comparable to 1e-5). Used by tools/zoo.py (the
sweep) through the job name ``zoo:<model_type>`` (tests/_job_models.py).
"""

from __future__ import annotations

from typing import Any

import torch
from _families import _CausalLM
from torch import Tensor

WIDTH, LAYERS, HEADS, KV_HEADS, HEAD_DIM, FFN, VOCAB = 32, 2, 4, 2, 8, 64, 256
_SIZES: tuple[tuple[tuple[str, ...], int], ...] = (
    (("hidden_size", "n_embd", "d_model", "embed_dim", "dim", "model_dim"), WIDTH),
    (("num_hidden_layers", "n_layer", "num_layers", "n_layers", "decoder_layers", "encoder_layers"), LAYERS),
    (("num_attention_heads", "n_head", "num_heads", "n_heads", "decoder_attention_heads"), HEADS),
    (("num_key_value_heads", "num_kv_heads", "n_kv_heads", "multi_query_group_num", "n_head_kv"), KV_HEADS),
    (("head_dim", "kv_channels", "qk_head_dim", "v_head_dim", "attention_head_size"), HEAD_DIM),
    (("intermediate_size", "n_inner", "ffn_dim", "d_ff", "ffn_hidden_size", "decoder_ffn_dim"), FFN),
    (("moe_intermediate_size", "expert_intermediate_size", "shared_expert_intermediate_size"), FFN // 2),
    (("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts"), 4),
    (("num_experts_per_tok", "moe_topk", "num_experts_per_token"), 2),
    (("rotary_dim", "rotary_emb_dim"), HEAD_DIM // 2),  # a rotary part within each head (GPT-J, CodeGen)
    (("vocab_size",), VOCAB),
    (("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len"), 64),
)
_TOKENS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id")


def shrink(config: Any, attn: str = "eager") -> Any:
    """``config`` made tiny in place by the one rule above; returned for chaining."""
    layers = next((getattr(config, n) for n in _SIZES[1][0] if isinstance(getattr(config, n, None), int)), None)
    for names, value in _SIZES:
        for name in names:
            if isinstance(getattr(config, name, None), int) and not isinstance(getattr(config, name), bool):
                try:
                    setattr(config, name, value)
                except AttributeError:  # a property derived from the others (Falcon's head_dim)
                    pass
    for name, value in list(vars(config).items()):
        if isinstance(value, list) and layers and len(value) == layers:  # one entry per layer (layer_types)
            setattr(config, name, value[:LAYERS])
        elif isinstance(value, float) and ("dropout" in name or "pdrop" in name or "jitter" in name):
            setattr(config, name, 0.0)
        elif name in _TOKENS and isinstance(value, int) and value >= VOCAB:
            setattr(config, name, 0)
    config._attn_implementation = attn
    config.use_cache = False  # training: no KV cache (hybrid models' caches need attention layers the 2 may lack)
    return config


MAX_PARAMS = 20_000_000  # a shrunk model is ~0.1 M; far more means the rule missed a size (a sub-config's)


def build(model_type: str, attn: str = "eager") -> Any:
    """The shrunk causal LM of ``model_type``, built from its config (nothing is downloaded).

    Raises:
        ValueError: the rule left it larger than `MAX_PARAMS` (counted on the meta device first, so a config the rule
            cannot shrink never allocates gigabytes).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    config = shrink(AutoConfig.for_model(model_type), attn)
    with torch.device("meta"):
        n = sum(p.numel() for p in AutoModelForCausalLM.from_config(config, attn_implementation=attn).parameters())
    if n > MAX_PARAMS:
        raise ValueError(f"{n / 1e6:.1f} M parameters after shrinking: a size the rule does not name")
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


class ZooLM(_CausalLM):
    """A user's LightningModule around `build`: next-byte loss on the model's logits, SGD + momentum (the families'
    `_families._CausalLM`)."""

    def __init__(self, model_type: str, attn: str = "eager") -> None:
        super().__init__()
        self.model = build(model_type, attn)

    def forward(self, idx: Tensor) -> Tensor:
        return self.model(input_ids=idx).logits
