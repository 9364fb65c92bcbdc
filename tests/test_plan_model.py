"""The planner's model description (`lightning_par.planner`): parameter counts derived from a Hugging Face config equal
what the Hugging Face class builds, at the published models' real sizes (built on the meta device: no memory); the
device table; bad input names the fix. No process group."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_par.parallel.flops import active_param_count
from lightning_par.planner import DEVICES, ModelDesc, device, from_hf_config


def _built(config: Any) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def _configs() -> dict[str, Any]:
    from transformers import GPT2Config, LlamaConfig, MistralConfig, MixtralConfig, Qwen3Config

    return {
        # The published models' shapes (their config.json values), so the counts are checked at real sizes.
        "gpt2": GPT2Config(),
        "gpt2_untied_inner": GPT2Config(n_layer=3, n_embd=64, n_head=4, n_inner=100, tie_word_embeddings=False),
        "llama2_7b": LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=32, vocab_size=32000),
        "llama3_8b": LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256),
        "llama_tied": LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=300, tie_word_embeddings=True),
        "mistral_7b": MistralConfig(),
        "mixtral_8x7b": MixtralConfig(),
        "qwen3_tiny": Qwen3Config(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=24, vocab_size=300, tie_word_embeddings=False),
    }  # fmt: skip


@pytest.mark.parametrize("name", list(_configs()))
def test_parameter_counts_equal_the_hugging_face_model(name: str, tmp_path: Path) -> None:
    config = _configs()[name]
    (tmp_path / "config.json").write_text(config.to_json_string())
    desc = from_hf_config(tmp_path)  # the folder, as a user passes it
    model = _built(config)
    assert desc.total_params == sum(p.numel() for p in model.parameters())
    # Active parameters: the model FLOPs' N (top-k of the experts), as the monitor counts it on the live module,
    # which leaves the embedding tables out.
    embeddings = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Embedding))
    assert desc.active_params - embeddings == active_param_count(model)


@pytest.mark.parametrize("name", ["gpt2_untied_inner", "llama_tied", "qwen3_tiny", "mixtral_8x7b"])
def test_a_live_module_is_described_as_its_config(name: str, tmp_path: Path) -> None:
    # The planner's view of the user's own module (the strategies' introspection, on the meta device) equals its
    # config's, dropout and activation included; a saved config.json omits defaults, which the reader restores.
    from lightning_par.planner.introspect import desc_from_module

    config = _configs()[name]
    (tmp_path / "config.json").write_text(config.to_json_string(use_diff=True))
    assert desc_from_module(_built(config)) == from_hf_config(tmp_path) == from_hf_config(config.to_dict())
    expected = ("gelu_tanh", 0.1) if name.startswith("gpt2") else ("silu", 0.0)
    assert (from_hf_config(tmp_path).activation, from_hf_config(tmp_path).dropout) == expected


def test_published_sizes() -> None:
    counts = {name: from_hf_config(c.to_dict()).total_params for name, c in _configs().items()}
    assert counts["gpt2"] == 124_439_808  # GPT-2 small (Radford et al. 2019 report "117M" for an older count)
    assert counts["llama2_7b"] == 6_738_415_616
    assert counts["mixtral_8x7b"] == 46_702_792_704
    assert from_hf_config(_configs()["mixtral_8x7b"].to_dict()).active_params == 12_879_925_248


def test_bad_configs_name_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"model_type='bert'.*known: gpt2"):
        from_hf_config({"model_type": "bert"})
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match=r"config.json \(llama\) lacks \['num_attention_heads', 'intermediate_size', "):
        from_hf_config(path)
    with pytest.raises(ValueError, match="kv_heads=3 must divide heads=4"):
        ModelDesc(layers=1, hidden=8, heads=4, kv_heads=3, head_dim=2, ffn=8, vocab=10)


def test_devices_are_known_by_name_and_alias_and_unknown_ones_are_listed() -> None:
    assert device("h100") is DEVICES["H100-SXM5-80GB"]
    assert device("H200-SXM-141GB").hbm_gib == pytest.approx(131.3, 0.01)
    assert device("A100").peak_flops["bf16"] == 312e12
    with pytest.raises(ValueError, match="unknown GPU 'V100'; known: A100-SXM4-40GB, A100-SXM4-80GB"):
        device("V100")
