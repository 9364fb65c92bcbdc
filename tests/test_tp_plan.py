"""Tensor-parallel plan inference: block styles from structure and shapes, error messages, overrides, tp checks."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from lightning_par.models.gpt import GPT
from lightning_par.models.llama import Llama
from lightning_par.parallel.tensor import MLPInfo, TPPlanError, format_plan, infer_tp_plan, validate_tp

E = 64


def attend(q: Tensor, k: Tensor, v: Tensor, head_dim: int) -> Tensor:
    B, T, _ = q.shape
    q, k, v = (t.view(B, T, -1, head_dim).transpose(1, 2) for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, -1)


class SepAttn(nn.Module):
    """Separate q/k/v/o; the head size lives in `head_dim`, or only in `_hd` (invisible) when head_attr=False."""

    def __init__(self, n_heads: int = 4, n_kv: int = 4, bias: bool = False, head_attr: bool = True) -> None:
        super().__init__()
        self._hd = E // n_heads
        if head_attr:
            self.head_dim = self._hd
        self.q = nn.Linear(E, n_heads * self._hd, bias=bias)
        self.k = nn.Linear(E, n_kv * self._hd, bias=bias)
        self.v = nn.Linear(E, n_kv * self._hd, bias=bias)
        self.o = nn.Linear(n_heads * self._hd, E, bias=bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.o(attend(self.q(x), self.k(x), self.v(x), self._hd))


class FusedAttn(nn.Module):
    """One fused E -> Q + 2K projection laid out [q | k | v] (Falcon / GPT-NeoX widths), then the output one."""

    def __init__(self, n_heads: int = 4, n_kv: int = 2, kv_width: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = n_heads, n_kv, E // n_heads
        self.kw = kv_width or n_kv * self.head_dim
        self.query_key_value = nn.Linear(E, E + 2 * self.kw)
        self.dense = nn.Linear(E, E)

    def forward(self, x: Tensor) -> Tensor:
        q, k, v = self.query_key_value(x).split([E, self.kw, self.kw], dim=-1)
        return self.dense(attend(q, k[..., : self.kw // 16 * 16], v[..., : self.kw // 16 * 16], self.head_dim))


class MLP(nn.Module):
    def __init__(self, hidden: int = 4 * E, gated: bool = False, bias: bool = True, gate_1: bool = False) -> None:
        super().__init__()
        self.fc = nn.Linear(E, hidden, bias=bias)
        self.up = nn.Linear(E, hidden, bias=bias) if gated else None
        self.proj = nn.Linear(hidden, E, bias=bias)
        # A per-token scalar gate (E -> 1): its output broadcasts over the shards, so it must stay replicated.
        self.gate = nn.Linear(E, 1) if gate_1 else None

    def forward(self, x: Tensor) -> Tensor:
        h = F.gelu(self.fc(x))
        if self.up is not None:
            h = h * self.up(x)
        if self.gate is not None:
            h = h * torch.sigmoid(self.gate(x))
        return self.proj(h)


class Block(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, adapter: bool = False) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2, self.mlp = nn.LayerNorm(E), attn, nn.LayerNorm(E), mlp
        # E -> E on the residual stream, after attention: it reads the output projection and must not pair with it.
        self.adapter = nn.Linear(E, E) if adapter else None

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln1(x))
        if self.adapter is not None:
            x = x + self.adapter(x)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    def __init__(self, blocks: list[nn.Module], vocab: int = 50, **config: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, E)
        self.blocks = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(E)
        self.head = nn.Linear(E, vocab, bias=False)
        if config:
            self.config = SimpleNamespace(**config)

    def forward(self, idx: Tensor) -> Tensor:
        h = self.embed(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(self.norm(h))


# --- Hugging Face Llama look-alike (old-style count attributes, tuple outputs, config on the root) -------------
class HFAttention(nn.Module):
    def __init__(self, config: SimpleNamespace, layer_idx: int) -> None:
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.num_heads, self.num_key_value_heads = config.num_attention_heads, config.num_key_value_heads
        self.hidden_size = config.hidden_size
        self.num_key_value_groups = self.num_heads // self.num_key_value_heads
        self.q_proj = nn.Linear(E, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(E, self.num_key_value_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(E, self.num_key_value_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, E, bias=False)

    def forward(self, hidden_states: Tensor) -> Tensor:
        B, T, _ = hidden_states.shape
        q = self.q_proj(hidden_states).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(hidden_states).view(B, T, self.num_key_value_heads, self.head_dim)
        v = self.v_proj(hidden_states).view(B, T, self.num_key_value_heads, self.head_dim)
        y = attend(q.flatten(2), k.flatten(2), v.flatten(2), self.head_dim)
        return self.o_proj(y.reshape(B, T, self.hidden_size))


class HFMLP(nn.Module):
    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.gate_proj = nn.Linear(E, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(E, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, E, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class HFDecoderLayer(nn.Module):
    def __init__(self, config: SimpleNamespace, layer_idx: int) -> None:
        super().__init__()
        self.self_attn, self.mlp = HFAttention(config, layer_idx), HFMLP(config)
        self.input_layernorm, self.post_attention_layernorm = nn.RMSNorm(E), nn.RMSNorm(E)

    def forward(self, hidden_states: Tensor, attention_mask: Tensor | None = None) -> tuple[Tensor]:
        h = hidden_states + self.self_attn(self.input_layernorm(hidden_states))
        return (h + self.mlp(self.post_attention_layernorm(h)),)


class HFModel(nn.Module):
    def __init__(self, config: SimpleNamespace) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, E)
        self.layers = nn.ModuleList(HFDecoderLayer(config, i) for i in range(2))
        self.norm = nn.RMSNorm(E)


class HFLlamaForCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = SimpleNamespace(
            hidden_size=E, num_attention_heads=4, num_key_value_heads=2, intermediate_size=96, vocab_size=100
        )
        self.model = HFModel(self.config)
        self.lm_head = nn.Linear(E, self.config.vocab_size, bias=False)

    def forward(self, input_ids: Tensor) -> Tensor:
        h = self.model.embed_tokens(input_ids)
        for layer in self.model.layers:
            h = layer(h, attention_mask=None)[0]
        return self.lm_head(self.model.norm(h))


# --- OPT look-alike: MLP Linears directly on the block, head count only in model.config ------------------------
class OPTAttention(nn.Module):
    HEADS = 8  # a class constant under a name inference does not know: the count must come from model.config

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)
        self.out_proj = nn.Linear(E, E)

    def forward(self, x: Tensor) -> Tensor:
        return self.out_proj(attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), E // self.HEADS))


class OPTLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn_layer_norm, self.self_attn = nn.LayerNorm(E), OPTAttention()
        self.final_layer_norm, self.fc1, self.fc2 = nn.LayerNorm(E), nn.Linear(E, 128), nn.Linear(128, E)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.relu(self.fc1(self.final_layer_norm(x))))


class FalconLayer(nn.Module):
    """Parallel attention and MLP off one norm (Falcon): `x + attn(ln(x)) + mlp(ln(x))`."""

    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.self_attention = nn.LayerNorm(E), FusedAttn(n_heads=4, n_kv=2)
        self.mlp = nn.ModuleDict({"dense_h_to_4h": nn.Linear(E, 4 * E), "dense_4h_to_h": nn.Linear(4 * E, E)})

    def forward(self, x: Tensor) -> Tensor:
        h = self.input_layernorm(x)
        mlp = self.mlp["dense_4h_to_h"](F.gelu(self.mlp["dense_h_to_4h"](h)))
        return x + self.self_attention(h) + mlp


def two(make: object) -> list[nn.Module]:
    return [make(), make()]  # type: ignore[operator]


# ------------------------------------------------------------------------------------------------------------------
def test_gpt_fused_qkv_with_bias() -> None:
    plan = infer_tp_plan(GPT(n_layer=2, n_head=4, n_embd=64))
    p = "transformer.h.*."
    assert plan.styles == {
        p + "ln_1": "sequence_parallel",
        p + "attn.c_attn": "colwise_fused",
        p + "attn.c_proj": "rowwise",
        p + "ln_2": "sequence_parallel",
        p + "mlp.c_fc": "colwise",
        p + "mlp.c_proj": "rowwise",
    }
    head = plan.heads["transformer.h.*.attn"]
    assert (head.n_heads, head.n_kv_heads, head.head_dim) == (4, 4, 16)
    assert head.source == "transformer.h.0.attn.head_dim"
    assert head.fused_split == {p + "attn.c_attn": (64, 64, 64)}
    assert head.local_attrs == {}  # the reference model reads head counts from shapes
    assert plan.mlp_hidden == {"transformer.h.*.mlp": 256}
    assert not plan.mlps["transformer.h.*.mlp"].gated
    assert (plan.trunk, plan.n_blocks, plan.hidden_size, plan.traced) == ("transformer.h", 2, 64, True)
    assert (plan.vocab_size, plan.embedding, plan.output, plan.final_norm) == (
        256,
        "transformer.wte",
        "lm_head",
        "transformer.ln_f",
    )
    assert plan.sequence_parallel == (p + "ln_1", p + "ln_2")


def test_llama_gqa_separate_qkv_gated_mlp_no_bias() -> None:
    plan = infer_tp_plan(Llama(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=172))
    p = "layers.*."
    assert plan.styles == {
        p + "attention_norm": "sequence_parallel",
        p + "attention.wq": "colwise",
        p + "attention.wk": "colwise",
        p + "attention.wv": "colwise",
        p + "attention.wo": "rowwise",
        p + "ffn_norm": "sequence_parallel",
        p + "feed_forward.w1": "colwise",
        p + "feed_forward.w3": "colwise",
        p + "feed_forward.w2": "rowwise",
    }
    head = plan.heads["layers.*.attention"]
    assert (head.n_heads, head.n_kv_heads, head.head_dim, head.fused_split) == (4, 2, 16, {})
    assert head.projections == tuple(p + f"attention.{n}" for n in ("wq", "wk", "wv", "wo"))
    assert plan.mlps["layers.*.feed_forward"].hidden == 172 and plan.mlps["layers.*.feed_forward"].gated
    assert (plan.embedding, plan.final_norm, plan.output, plan.vocab_size) == ("tok_embeddings", "norm", "output", 256)


def test_hf_llama_lookalike_records_count_attributes() -> None:
    plan = infer_tp_plan(HFLlamaForCausalLM())
    p = "model.layers.*."
    assert plan.styles == {
        p + "self_attn.q_proj": "colwise",
        p + "self_attn.k_proj": "colwise",
        p + "self_attn.v_proj": "colwise",
        p + "self_attn.o_proj": "rowwise",
        p + "mlp.gate_proj": "colwise",
        p + "mlp.up_proj": "colwise",
        p + "mlp.down_proj": "rowwise",
        p + "input_layernorm": "sequence_parallel",
        p + "post_attention_layernorm": "sequence_parallel",
    }
    head = plan.heads["model.layers.*.self_attn"]
    assert (head.n_heads, head.n_kv_heads, head.head_dim) == (4, 2, 16)
    # These attributes feed view()/reshape() in forward, so tp must rewrite them to per-rank counts.
    assert head.local_attrs == {"num_heads": "n_heads", "num_key_value_heads": "n_kv_heads", "hidden_size": "q_width",
                                "num_key_value_groups": "kv_groups"}  # fmt: skip
    assert plan.mlp_hidden == {"model.layers.*.mlp": 96}
    assert (plan.embedding, plan.final_norm, plan.output, plan.vocab_size) == (
        "model.embed_tokens",
        "model.norm",
        "lm_head",
        100,
    )


def test_opt_lookalike_flat_mlp_and_heads_from_model_config() -> None:
    plan = infer_tp_plan(TinyLM(two(OPTLayer), num_attention_heads=8))
    p = "blocks.*."
    assert plan.styles == {
        p + "self_attn_layer_norm": "sequence_parallel",
        p + "self_attn.q_proj": "colwise",
        p + "self_attn.k_proj": "colwise",
        p + "self_attn.v_proj": "colwise",
        p + "self_attn.out_proj": "rowwise",
        p + "final_layer_norm": "sequence_parallel",
        p + "fc1": "colwise",
        p + "fc2": "rowwise",
    }
    head = plan.heads["blocks.*.self_attn"]
    assert (head.n_heads, head.n_kv_heads, head.head_dim, head.source) == (8, 8, 8, "model.config.num_attention_heads")
    assert plan.mlps["blocks.*"].hidden == 128  # Linears directly on the block: the MLP is the block itself


def test_falcon_fused_gqa_parallel_block() -> None:
    plan = infer_tp_plan(TinyLM(two(FalconLayer)))
    p = "blocks.*."
    assert plan.styles == {
        p + "input_layernorm": "sequence_parallel",
        p + "self_attention.query_key_value": "colwise_fused",
        p + "self_attention.dense": "rowwise",
        p + "mlp.dense_h_to_4h": "colwise",
        p + "mlp.dense_4h_to_h": "rowwise",
    }
    head = plan.heads["blocks.*.self_attention"]
    assert (head.n_heads, head.n_kv_heads, head.head_dim) == (4, 2, 16)
    assert head.fused_split == {p + "self_attention.query_key_value": (64, 32, 32)}
    # `kw` sizes the split after the fused projection (split([E, kw, kw])): a per-rank width under tp.
    assert head.local_attrs == {"num_heads": "n_heads", "num_kv_heads": "n_kv_heads", "kw": "split_width"}


@pytest.mark.parametrize("bias", [True, False])
def test_gated_and_plain_mlp_with_and_without_bias(bias: bool) -> None:
    plan = infer_tp_plan(TinyLM([Block(SepAttn(bias=bias), MLP(96, gated=True, bias=bias)) for _ in range(3)]))
    assert [plan.styles[f"blocks.*.mlp.{n}"] for n in ("fc", "up", "proj")] == ["colwise", "colwise", "rowwise"]
    assert plan.mlps["blocks.*.mlp"].gated and plan.mlp_hidden == {"blocks.*.mlp": 96}
    assert plan.n_blocks == 3
    plain = infer_tp_plan(TinyLM([Block(SepAttn(bias=bias), MLP(80, bias=bias)) for _ in range(2)]))
    assert not plain.mlps["blocks.*.mlp"].gated and plain.mlp_hidden == {"blocks.*.mlp": 80}
    assert [plain.styles[f"blocks.*.attn.{n}"] for n in "qkvo"] == ["colwise"] * 3 + ["rowwise"]


def test_extra_unrelated_linears_stay_replicated() -> None:
    plan = infer_tp_plan(TinyLM([Block(SepAttn(), MLP(gate_1=True), adapter=True) for _ in range(2)]))
    assert plan.styles["blocks.*.adapter"] == "replicate"  # E -> E reading the attention output: not a pair
    assert plan.styles["blocks.*.mlp.gate"] == "replicate"  # E -> 1 read by nothing row-wise
    assert [plan.styles[f"blocks.*.attn.{n}"] for n in "qkvo"] == ["colwise"] * 3 + ["rowwise"]
    assert (plan.styles["blocks.*.mlp.fc"], plan.styles["blocks.*.mlp.proj"]) == ("colwise", "rowwise")
    assert any("blocks.*.adapter" in n and "blocks.*.mlp.gate" in n for n in plan.notes)


class Broken(GPT):
    def forward(self, idx: Tensor) -> Tensor:
        raise RuntimeError("this model wants a dict batch")


class BrokenLlama(Llama):
    def forward(self, tokens: Tensor) -> Tensor:
        raise RuntimeError("this model wants a dict batch")


@pytest.mark.parametrize(("broken", "working"), [(Broken, GPT), (BrokenLlama, Llama)])
def test_registration_order_fallback_when_forward_fails(broken: type, working: type) -> None:
    plan, ref = infer_tp_plan(broken()), infer_tp_plan(working())
    assert not plan.traced and any("RuntimeError: this model wants a dict batch" in n for n in plan.notes)
    assert plan.styles == ref.styles
    assert plan.heads == ref.heads and plan.mlps == ref.mlps
    assert (plan.output, plan.vocab_size, plan.embedding) == (ref.output, ref.vocab_size, ref.embedding)


def test_a_lightning_module_without_a_forward_is_probed_through_the_model_it_wraps() -> None:
    # Its training_step calls self.model(...): the probes call the module it wraps (blocks._probe.probe_target).
    # peft's default LoRA targets for Llama (q and v): by registration order alone the attention was not seen and
    # stayed whole, and under sequence parallelism it crashed in the first step (tests/test_plan_state.py measures
    # that layout's traffic).
    import lightning as L

    class Wrapper(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = Llama()

    plan, ref = infer_tp_plan(Wrapper()), infer_tp_plan(Llama())
    assert plan.traced and not plan.notes
    assert plan.styles == {f"model.{k}": v for k, v in ref.styles.items()}


def test_meta_device_model_traces_like_a_real_one() -> None:
    with torch.device("meta"):
        meta = Llama()
    plan, ref = infer_tp_plan(meta), infer_tp_plan(Llama())
    assert plan.traced and plan.styles == ref.styles and plan.heads == ref.heads and plan.mlps == ref.mlps


def test_inference_leaves_modes_and_rng_alone() -> None:
    model = GPT(dropout=0.1)
    model.train()
    model.transformer["h"][1].eval()
    state = torch.get_rng_state()
    infer_tp_plan(model)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training and not model.transformer["h"][1].training and model.transformer["h"][0].training
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# --- errors ---------------------------------------------------------------------------------------------------------
class TwoOutAttn(SepAttn):
    def __init__(self) -> None:
        super().__init__()
        self.o2 = nn.Linear(E, E)

    def forward(self, x: Tensor) -> Tensor:
        y = attend(self.q(x), self.k(x), self.v(x), self._hd)
        return self.o(y) + self.o2(y)


class QAndFusedKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.n_heads = 4
        self.q, self.kv, self.o = nn.Linear(E, E), nn.Linear(E, E), nn.Linear(E, E)

    def forward(self, x: Tensor) -> Tensor:
        k, v = self.kv(x).chunk(2, dim=-1)
        return self.o(attend(self.q(x), k, v, 16))


class FusedGateUp(nn.Module):
    """Phi-3 style [gate | up] in one Linear, split in two halves as wide as ``down`` reads: a fused gated MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.gate_up, self.down = nn.Linear(E, 192), nn.Linear(96, E)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class FullWidthQNorm(SepAttn):
    def __init__(self) -> None:
        super().__init__()
        self.q_norm = nn.LayerNorm(E)  # over all heads at once: split like q's output, statistics over tp

    def forward(self, x: Tensor) -> Tensor:
        return self.o(attend(self.q_norm(self.q(x)), self.k(x), self.v(x), self._hd))


class PerHeadQKNorm(SepAttn):
    """Qwen3's q/k norms: one RMSNorm over head_dim applied to every head."""

    def __init__(self) -> None:
        super().__init__()
        self.q_norm, self.k_norm = nn.RMSNorm(self._hd), nn.RMSNorm(self._hd)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q(x).view(B, T, -1, self._hd)).flatten(2)
        k = self.k_norm(self.k(x).view(B, T, -1, self._hd)).flatten(2)
        return self.o(attend(q, k, self.v(x), self._hd))


class PairQNorm(SepAttn):
    """A norm over pairs of heads: neither one head nor the whole output, so no split style is exact."""

    def __init__(self) -> None:
        super().__init__()
        self.q_norm = nn.LayerNorm(2 * self._hd)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        q = self.q_norm(self.q(x).view(B, T, -1, 2 * self._hd)).flatten(2)
        return self.o(attend(q, self.k(x), self.v(x), self._hd))


class AdapterOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.proj = nn.LayerNorm(E), nn.Linear(E, E)

    def forward(self, x: Tensor) -> Tensor:
        return x + self.proj(self.norm(x))


AMBIGUOUS = [
    (
        lambda: TinyLM([Block(TwoOutAttn(), MLP()) for _ in range(2)]),
        r"blocks\.\*\.attn\.o and blocks\.\*\.attn\.o2 could each be the output projection.*"
        r'tp_plan=\{"blocks\.\*\.attn\.q": "colwise", .*"blocks\.\*\.attn\.o2": "rowwise"\}',
    ),
    (
        lambda: TinyLM([Block(FusedAttn(kv_width=40), MLP()) for _ in range(2)]),
        r"attention blocks\.\*\.attn \(blocks\.\*\.attn\.query_key_value \(64->144\) into blocks\.\*\.attn\.dense\): "
        r"q=64, blocks\.\*\.attn\.query_key_value=\(64, 40, 40\) does not split into whole heads of head_dim=16 "
        r"\(from blocks\.0\.attn\.head_dim\).*tp_plan=\{",
    ),
    (
        lambda: TinyLM([Block(QAndFusedKV(), MLP()) for _ in range(2)]),
        r"blocks\.\*\.attn\.o \(64->64\) reads .*: an MLP or attention with fused projections\?; "
        r'pass e\.g\. tp_plan=\{"blocks\.\*\.attn\.kv": "replicate", .*"blocks\.\*\.attn\.o": "replicate"\}',
    ),
    (
        lambda: TinyLM([Block(SepAttn(head_attr=False), MLP()) for _ in range(2)]),
        r"attention blocks\.\*\.attn .* has no head count: give it a head_dim or n_heads attribute",
    ),
    (
        lambda: TinyLM([Block(PairQNorm(), MLP()) for _ in range(2)]),
        r"norm blocks\.\*\.attn\.q_norm normalizes width 32 of the column-split blocks\.\*\.attn\.q \(64->64\); "
        r'each rank would normalize only its shard; pass e\.g\. tp_plan=\{"blocks\.\*\.attn\.q_norm": "replicate", '
        r'"blocks\.\*\.attn\.q": "replicate"\}',
    ),
    (
        lambda: TinyLM(two(AdapterOnly)),
        r"found no attention or MLP in blocks\.0: .*blocks\.\*\.proj \(64->64\).*"
        r'tp_plan=\{"blocks\.\*\.proj": "replicate"\}',
    ),
]


@pytest.mark.parametrize(("make", "message"), AMBIGUOUS)
def test_ambiguous_or_impossible_blocks_name_modules_and_a_plan(make: object, message: str) -> None:
    with pytest.raises(TPPlanError, match=message):
        infer_tp_plan(make())  # type: ignore[operator]


def test_norms_of_split_heads_follow_their_projections() -> None:
    per_head = infer_tp_plan(TinyLM([Block(PerHeadQKNorm(), MLP()) for _ in range(2)]))
    assert [per_head.styles[f"blocks.*.attn.{n}"] for n in ("q", "k", "q_norm", "k_norm")] == [
        "colwise", "colwise", "head_norm", "head_norm"
    ]  # fmt: skip
    full = infer_tp_plan(TinyLM([Block(FullWidthQNorm(), MLP()) for _ in range(2)]))
    assert full.styles["blocks.*.attn.q_norm"] == "colwise_norm"
    # A tp_plan that keeps the projection whole keeps its norm whole too.
    kept = infer_tp_plan(TinyLM([Block(PerHeadQKNorm(), MLP()) for _ in range(2)]),
                         overrides={"blocks.*.attn.q": "replicate"})  # fmt: skip
    assert kept.styles["blocks.*.attn.q_norm"] == "replicate" and kept.styles["blocks.*.attn.k_norm"] == "head_norm"


@pytest.mark.parametrize(
    ("make", "overrides", "message"),
    [
        # A per-head norm kept plain while its heads are split: its weight's gradient would cover this rank's heads.
        (PerHeadQKNorm, {"blocks.*.attn.q_norm": "replicate"},
         r"tp_plan\['blocks\.\*\.attn\.q_norm'\] = 'replicate', but blocks\.\*\.attn\.q_norm reads the column-split "
         r"blocks\.\*\.attn\.q: .* map it to 'head_norm', or keep it and blocks\.\*\.attn\.q 'replicate'"),
        (FullWidthQNorm, {"blocks.*.attn.q_norm": "head_norm"}, r"map it to 'colwise_norm'"),
        (PerHeadQKNorm, {"blocks.*.attn.q": "replicate", "blocks.*.attn.q_norm": "head_norm"},
         r"reads blocks\.\*\.attn\.q, kept whole: .* map it to 'replicate'"),
        (SepAttn, {"blocks.*.ln1": "head_norm"},
         r"'head_norm' applies only to a norm that reads a column-split projection, which blocks\.\*\.ln1 does not"),
    ],
)  # fmt: skip
def test_overrides_of_split_norms_that_would_train_another_model(
    make: type, overrides: dict[str, str], message: str
) -> None:
    with pytest.raises(TPPlanError, match=message):
        infer_tp_plan(TinyLM([Block(make(), MLP()) for _ in range(2)]), overrides=overrides)


def test_overrides_settle_an_ambiguous_block() -> None:
    model = TinyLM([Block(TwoOutAttn(), MLP()) for _ in range(2)])
    plan = infer_tp_plan(model, overrides={"blocks.*.attn.[qkv]": "colwise", "blocks.*.attn.o*": "rowwise"})
    assert [plan.styles[f"blocks.*.attn.{n}"] for n in ("q", "k", "v", "o", "o2")] == ["colwise"] * 3 + ["rowwise"] * 2
    assert any(n.startswith("tp_plan decides where inference could not") for n in plan.notes)
    with pytest.raises(TPPlanError, match="could each be the output projection"):
        infer_tp_plan(model, overrides={"blocks.*.attn.o": "rowwise"})  # o2 still undecided


def test_blocks_that_differ_are_planned_per_structure() -> None:
    # Once refused ("blocks differ"): each structure now gets its own patterns, naming exactly its blocks.
    model = TinyLM([Block(SepAttn(), MLP(256)), Block(SepAttn(), MLP(256)), Block(SepAttn(), MLP(128))])
    plan = infer_tp_plan(model)
    assert plan.groups == {"blocks.{0,1}": ("blocks.0", "blocks.1"), "blocks.2": ("blocks.2",)}
    assert {k: m.hidden for k, m in plan.mlps.items()} == {"blocks.{0,1}.mlp": 256, "blocks.2.mlp": 128}
    assert plan.styles["blocks.{0,1}.mlp.fc"] == plan.styles["blocks.2.mlp.fc"] == "colwise"
    assert not any("*" in k for k in plan.styles)
    with pytest.raises(TPPlanError, match=r"tp=3 does not divide .* in blocks\.0"):
        validate_tp(plan, 3)


def test_no_trunk() -> None:
    with pytest.raises(TPPlanError, match="found no trunk of >= 2 same-class blocks"):
        infer_tp_plan(nn.Sequential(nn.Linear(4, 8), nn.ReLU()))


def test_overrides_replace_and_add_styles() -> None:
    whole_attention = {"transformer.h.*.attn.c_attn": "replicate", "transformer.h.*.attn.c_proj": "replicate"}
    plan = infer_tp_plan(GPT(), overrides={**whole_attention, "lm_head": "colwise", "transformer.wte": "rowwise"})
    assert plan.styles["transformer.h.*.attn.c_attn"] == plan.styles["transformer.h.*.attn.c_proj"] == "replicate"
    assert (plan.styles["lm_head"], plan.styles["transformer.wte"]) == ("colwise", "rowwise")
    assert plan.styles["transformer.h.*.mlp.c_fc"] == "colwise"  # untouched


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"transformer.h.*.attn.c_attn": "column"}, r"'column' is not a style; choose one of colwise, rowwise, "),
        ({"transformer.h.0.attn.c_attn": "colwise"}, r"matches no Linear.*\(use \* for the block index\).*transformer"),
        ({"transformer.h.*.ln_1": "colwise"}, r"cannot apply to norm transformer\.h\.\*\.ln_1; choose one of seq"),
        ({"transformer.h.*.mlp.c_fc": "colwise_fused"}, r"transformer\.h\.\*\.mlp\.c_fc has no known split into parts"),
        # GPT splits c_attn's output into q, k and v: a plain column split would put all of q on rank 0.
        ({"transformer.h.*.attn.c_attn": "colwise"}, r"splits transformer\.h\.\*\.attn\.c_attn's output across its"),
    ],
)
def test_bad_overrides(overrides: dict[str, str], message: str) -> None:
    with pytest.raises(TPPlanError, match=message):
        infer_tp_plan(GPT(), overrides=overrides)


# --- validate_tp ------------------------------------------------------------------------------------------------------
def six_heads(mlp_hidden: int = 192) -> TinyLM:
    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_head = 6
            self.c_attn, self.c_proj = nn.Linear(48, 144), nn.Linear(48, 48)

        def forward(self, x: Tensor) -> Tensor:
            return self.c_proj(attend(*self.c_attn(x).chunk(3, dim=-1), 8))

    class Blk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln, self.attn = nn.LayerNorm(48), Attn()
            self.mlp = nn.Sequential(nn.Linear(48, mlp_hidden), nn.GELU(), nn.Linear(mlp_hidden, 48))

        def forward(self, x: Tensor) -> Tensor:
            return x + self.mlp(x + self.attn(self.ln(x)))

    class LM(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.wte, self.blocks, self.head = nn.Embedding(100, 48), nn.ModuleList([Blk(), Blk()]), nn.Linear(48, 100)

        def forward(self, idx: Tensor) -> Tensor:
            h = self.wte(idx)
            for b in self.blocks:
                h = b(h)
            return self.head(h)

    return LM()


def test_validate_tp_lists_the_valid_degrees() -> None:
    plan = infer_tp_plan(six_heads())
    for tp in (1, 2, 3, 6):
        validate_tp(plan, tp)
    with pytest.raises(
        TPPlanError, match=re.escape("tp=4 does not divide n_heads=6 in blocks.0.attn; choose tp in {1, 2, 3, 6}")
    ):
        validate_tp(plan, 4)
    with pytest.raises(TPPlanError, match=re.escape("tp=3 does not divide vocab_size=100; choose tp in {1, 2}")):
        validate_tp(plan, 3, shard_vocab=True)
    with pytest.raises(TPPlanError, match=re.escape("tp=2 does not divide vocab_size=99; choose tp in {1, 3}")):
        validate_tp(plan, 2, shard_vocab=True, vocab_size=99)
    with pytest.raises(TPPlanError, match=r"tp=0 must be a positive int"):
        validate_tp(plan, 0)


def test_validate_tp_kv_heads_and_mlp_hidden() -> None:
    llama = infer_tp_plan(Llama(dim=64, n_heads=4, n_kv_heads=2, ffn_hidden=172))
    validate_tp(llama, 2)
    validate_tp(llama, 4)  # fewer k/v heads than ranks: each replicated over the 2 ranks that read it
    with pytest.raises(TPPlanError, match=re.escape("tp=8 does not divide n_heads=4 in layers.0.attention")):
        validate_tp(llama, 8)
    # 12 query heads over 4 ranks, 3 query heads each, but 3 k/v heads: no rank's heads all read one of them.
    odd = infer_tp_plan(Llama(dim=96, n_heads=12, n_kv_heads=3, ffn_hidden=172))
    with pytest.raises(TPPlanError, match=r"layers\.0\.attention: tp=4 with n_heads=12, n_kv_heads=3: .*choose tp "
                       r"in \{1, 3, 6, 12\}"):  # fmt: skip
        validate_tp(odd, 4)
    plan = infer_tp_plan(six_heads(mlp_hidden=100))
    msg = "tp=6 does not divide the MLP hidden size 100 in blocks.0.mlp; choose tp in {1, 2}"
    with pytest.raises(TPPlanError, match=re.escape(msg)):
        validate_tp(plan, 6)
    # An MLP the user keeps replicated no longer constrains tp.
    validate_tp(infer_tp_plan(six_heads(mlp_hidden=100), overrides={"blocks.*.mlp.*": "replicate"}), 6)


def test_format_plan_and_as_dict() -> None:
    plan = infer_tp_plan(Llama())
    text = format_plan(plan)
    for pattern, style in plan.styles.items():
        assert re.search(rf"^{re.escape(pattern)}\s+{style}\s", text, re.M), pattern
    assert "attention layers.*.attention: n_heads=4 n_kv_heads=2 head_dim=16" in text
    assert "mlp layers.*.feed_forward: hidden=172 gated" in text
    data = json.loads(json.dumps(plan.as_dict()))
    assert data["styles"] == plan.styles and data["heads"]["layers.*.attention"]["n_kv_heads"] == 2
    overridden = format_plan(infer_tp_plan(Llama(), overrides={"tok_embeddings": "rowwise"}))
    assert re.search(r"^tok_embeddings\s+rowwise\s+embedding\(256, 64\)$", overridden, re.M)


def test_fused_gate_up_is_split_by_halves() -> None:
    # A plain column split would give rank 0 all of the gate and rank 1 all of the up half.
    plan = infer_tp_plan(TinyLM([Block(SepAttn(), FusedGateUp()) for _ in range(2)]))
    assert plan.styles["blocks.*.mlp.gate_up"] == "colwise_fused" and plan.styles["blocks.*.mlp.down"] == "rowwise"
    assert plan.mlps["blocks.*.mlp"] == MLPInfo(96, True, ("blocks.*.mlp.gate_up", "blocks.*.mlp.down"), "blocks.*.mlp",
                                                {"blocks.*.mlp.gate_up": (96, 96)})  # fmt: skip
    assert plan.fused_split["blocks.*.mlp.gate_up"] == (96, 96)


@pytest.mark.parametrize("alias", ["colwise_fused", "colwise_fused_qkv"])
def test_fused_style_keeps_its_older_name(alias: str) -> None:
    model = TinyLM([Block(SepAttn(), FusedGateUp()) for _ in range(2)])
    plan = infer_tp_plan(model, overrides={"blocks.*.mlp.gate_up": alias})
    assert plan.styles["blocks.*.mlp.gate_up"] == "colwise_fused"


def test_plain_column_split_of_a_fused_output_is_refused() -> None:
    # Followed as written, such a plan trains without an error and drifts from one process (Phi-3: 1.4e-3 in 5 steps).
    model = TinyLM([Block(SepAttn(), FusedGateUp()) for _ in range(2)])
    with pytest.raises(TPPlanError, match=r"'colwise' splits blocks\.\*\.mlp\.gate_up's output across its parts: .*"
                       r"widths \(96, 96\).*map it to 'colwise_fused'"):  # fmt: skip
        infer_tp_plan(model, overrides={"blocks.*.mlp.gate_up": "colwise"})


def test_norm_inside_a_region_runs_whole_not_on_the_stream() -> None:
    # A norm inside the attention / MLP module, before the projections, reads the region's gathered input: not a
    # sequence shard (parallel/tensor/sequence.py, WholeInRegion). The block's own pre-norm stays on the stream.
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from _tp_mixed_models import AlternatingLM

    inner, outer = infer_tp_plan(AlternatingLM(inner=True)), infer_tp_plan(AlternatingLM())
    # Attention and feed-forward layers alternate: two structures, planned apart.
    assert {k: s for k, s in inner.styles.items() if k.endswith("norm")} == {
        "layers.{0,2}.fn.norm": "replicate", "layers.{1,3}.fn.norm": "replicate"}  # fmt: skip
    assert {k: s for k, s in outer.styles.items() if k.endswith("norm")} == {
        "layers.{0,2}.norm": "sequence_parallel", "layers.{1,3}.norm": "sequence_parallel"}  # fmt: skip


def test_a_region_whose_code_goes_on_after_its_output_projection_keeps_its_input_and_blocks_sp() -> None:
    # ALBERT's attention (and a user's post-norm attention) adds its input back to its output projection's output
    # and normalises, inside the module: made one replicated DTensor, that input would meet the plain output there.
    from _families import HFAlbert
    from _tp_mixed_models import PostNormLM

    from lightning_par.blocks.trunk import find_trunk
    from lightning_par.parallel.tensor.apply import sequence_parallel_blocker

    albert = HFAlbert()
    trunk = find_trunk(albert)  # one layer's weights at every depth: a trunk of one block
    assert trunk is not None and trunk.names == ("model.albert.encoder.albert_layer_groups.0.albert_layers.0",)
    plan = infer_tp_plan(albert)
    assert plan.tails == ("model.albert.encoder.albert_layer_groups.0.albert_layers.*.attention",)
    user = infer_tp_plan(PostNormLM())
    assert user.tails == ("layers.*.attn",)
    why = sequence_parallel_blocker(user, PostNormLM().layers[0])
    assert why is not None and "layers.*.attn adds its own input back after its output projection" in why
    # A pre-norm attention (the norm before the projections, or on the stream) has no tail.
    assert infer_tp_plan(GPT()).tails == ()


class _NormedRegroupAttn(nn.Module):
    """A full-width q norm (as OLMoE's, split 'colwise_norm' under tp) and code that regroups its heads by a constant
    of its own (as CodeGen's ``mp_num``): each rank's shapes are consistent, its values are not."""

    def __init__(self, dim: int = 32, n_heads: int = 4) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.q_norm = nn.RMSNorm(dim)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_norm(self.q(x)).view(b, t, 2, self.n_heads // 2, -1).transpose(2, 3).reshape(b, t, self.n_heads, -1)
        k, v = (p(x).view(b, t, self.n_heads, -1) for p in (self.k, self.v))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class _NormedBlock(nn.Module):
    def __init__(self, regroup: bool) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(32)
        self.attn = _NormedRegroupAttn()
        if not regroup:
            self.attn.forward = self._plain  # type: ignore[method-assign]

    def _plain(self, x: Tensor) -> Tensor:
        a, (b, t, _) = self.attn, x.shape
        q, k, v = (t_.view(b, t, a.n_heads, -1).transpose(1, 2) for t_ in (a.q_norm(a.q(x)), a.k(x), a.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return a.o(y.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x: Tensor) -> Tensor:
        return x + self.attn(self.ln(x))


class _NormedLM(nn.Module):
    def __init__(self, regroup: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(256, 32), nn.Linear(32, 256)
        self.blocks = nn.ModuleList(_NormedBlock(regroup) for _ in range(2))

    def forward(self, idx: Tensor) -> Tensor:
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def test_the_value_check_runs_on_plans_with_a_full_width_norm() -> None:
    # Once skipped for any plan with a 'colwise_norm' (a rank's copy cannot reduce the norm's statistics over tp):
    # a head regrouping by a constant, beside such a norm, trained silently wrong. Each rank's copy now takes its
    # slice of the whole norm's output and the rest of the block is checked on real values.
    from lightning_par.parallel.tensor.check import check_local_shapes

    plain = _NormedLM(regroup=False)
    plan = infer_tp_plan(plain)
    assert plan.styles["blocks.*.attn.q_norm"] == "colwise_norm"
    assert check_local_shapes(plain, plan, 2).gathered == ()  # exact: no refusal, no fallback
    wrong = _NormedLM(regroup=True)
    plan = infer_tp_plan(wrong)
    assert plan.styles["blocks.*.attn.q_norm"] == "colwise_norm"
    with pytest.raises(TPPlanError, match=r"blocks\.0 .*differ|differ.*blocks\.0|blocks\.0\.attn"):
        check_local_shapes(wrong, plan, 2)


def test_other_stacks_of_blocks_get_plans_of_their_own_or_stay_whole_with_a_note() -> None:
    # T5's encoder is a second stack beside the decoder (the trunk): planned, checked and split like it. A stack tp
    # cannot plan (here: convolutions, no projection) stays whole, and the start-up log says why.
    from _families import HFT5

    from lightning_par.parallel.tensor.check import other_plans

    t5 = HFT5()
    main = infer_tp_plan(t5)
    assert main.trunk == "model.decoder.block"
    plans, notes = other_plans(t5, main, 2)
    assert [p.trunk for p in plans] == ["model.encoder.block"] and notes == []
    attn = "model.encoder.block.0.layer.0.SelfAttention"  # block 0 (with the bias table) a structure of its own
    assert plans[0].styles[f"{attn}.q"] == "colwise" and plans[0].styles[f"{attn}.o"] == "rowwise"

    class ConvStem(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv, self.norm = nn.Conv1d(32, 32, 9, padding=4), nn.LayerNorm(32)

        def forward(self, h: Tensor) -> Tensor:
            return self.norm(h + self.conv(h.transpose(1, 2)).transpose(1, 2))

    class Stemmed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(256, 32), nn.Linear(32, 256)
            self.stem = nn.ModuleList([ConvStem(), ConvStem()])
            self.blocks = nn.ModuleList(Block(SepAttn(), MLP(256)) for _ in range(2))

        def forward(self, idx: Tensor) -> Tensor:
            h = self.emb(idx)
            for layer in (*self.stem, *self.blocks):
                h = layer(h)
            return self.head(h)

    model = Stemmed()
    plans, notes = other_plans(model, infer_tp_plan(model), 2)
    assert plans == [] and len(notes) == 1
    assert notes[0].startswith("tensor parallel: stem kept whole on every rank (")
