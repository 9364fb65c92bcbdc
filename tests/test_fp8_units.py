"""Which linear layers fp8 training converts and which it keeps, and the refusals (no process group: one process).

The rule (`lightning_par.parallel.fp8.convert`): the ``nn.Linear``s inside the trunk's blocks whose dimensions are
multiples of 16; kept, each with its reason in the start-up lines: layers outside the trunk, MoE routers and
experts, layers wrapped by low-rank adapters (whose own layers are not listed at all), dimensions fp8 cannot
multiply, and under tp the projections tp splits with its own code. The parity of the layouts: tests/test_fp8.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lightning_par.blocks.trunk import find_trunk
from lightning_par.config import ParallelConfig, ParallelConfigError
from lightning_par.parallel.experts.finder import find_moe_layers
from lightning_par.parallel.fp8 import Fp8Error, check_fp8_device, convert_fp8, select_fp8
from lightning_par.parallel.tensor.plan import infer_tp_plan

LLAMA_LAYERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
                "mlp.up_proj", "mlp.down_proj")  # fmt: skip


def _llama() -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))  # fmt: skip


def _select(model: nn.Module, tp: int = 1):  # type: ignore[no-untyped-def]
    trunk = find_trunk(model)
    plans = [infer_tp_plan(model)] if tp > 1 else []
    return select_fp8(model, trunk, [layer.name for layer in find_moe_layers(model)], plans, tp)


def test_every_block_projection_of_llama_and_not_the_head() -> None:
    layers = _select(_llama())
    assert layers.converted == tuple(f"model.layers.{i}.{p}" for i in range(2) for p in LLAMA_LAYERS)
    assert layers.kept == {"lm_head": "outside the trunk's blocks"}
    notes = layers.notes()
    assert notes[0].startswith("fp8: 14 linear layer(s) in fp8: model.layers.*.self_attn.q_proj, ")
    assert notes[1] == "fp8: kept in the training precision (outside the trunk's blocks): lm_head"


def test_dimensions_that_fp8_cannot_multiply_are_kept() -> None:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.up, self.down = nn.Linear(32, 40), nn.Linear(40, 32)
            self.wide = nn.Linear(32, 32)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + self.wide(self.down(torch.relu(self.up(x))))

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([Block() for _ in range(2)])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for block in self.blocks:
                x = block(x)
            return x

    layers = _select(Net())
    assert layers.converted == ("blocks.0.wide", "blocks.1.wide")
    assert layers.kept == {f"blocks.{i}.{n}": "a dimension not a multiple of 16" for i in range(2)
                           for n in ("up", "down")}  # fmt: skip


def test_moe_routers_and_experts_are_kept() -> None:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    model = Qwen2MoeForCausalLM(Qwen2MoeConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
        shared_expert_intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_experts=4, num_experts_per_tok=2))  # fmt: skip
    layers = _select(model)
    assert layers.converted == tuple(f"model.layers.{i}.self_attn.{p}" for i in range(2)
                                     for p in ("q_proj", "k_proj", "v_proj", "o_proj"))  # fmt: skip
    # (transformers 5 keeps the experts stacked and its router is no nn.Linear: the shared expert is what is left)
    moe = {n for n, why in layers.kept.items() if why == "MoE router or experts"}
    assert {f"model.layers.{i}.mlp.shared_expert.up_proj" for i in range(2)} <= moe


def test_layers_wrapped_by_adapters_are_kept_and_the_adapters_not_listed() -> None:
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(_llama(), LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
    layers = _select(model)
    assert not any("lora_" in n for n in (*layers.converted, *layers.kept))  # an adapter's own layers: not listed
    wrapped = {n for n, why in layers.kept.items() if why == "wrapped by a low-rank adapter"}
    assert wrapped == {f"base_model.model.model.layers.{i}.self_attn.{p}.base_layer" for i in range(2)
                       for p in ("q_proj", "v_proj")}  # fmt: skip
    assert len(layers.converted) == 10


def test_under_tp_a_fused_projection_tp_splits_itself_is_kept() -> None:
    from lightning_par.models import GPT

    model = GPT(vocab_size=256, n_layer=2, n_head=4, n_embd=32, block_size=32)
    whole, split = _select(model), _select(model, tp=2)
    fused = {"transformer.h.0.attn.c_attn", "transformer.h.1.attn.c_attn"}
    assert fused <= set(whole.converted)
    assert set(split.converted) == set(whole.converted) - fused
    assert {split.kept[n] for n in fused} == {"split by tensor parallelism's own code (fused parts or shared "
                                              "key/value heads)"}  # fmt: skip


def test_convert_swaps_the_chosen_layers_keeping_their_parameters() -> None:
    model = _llama()
    weight = model.model.layers[0].mlp.up_proj.weight
    convert_fp8(model, _select(model), emulate=True, zero3=False)
    assert type(model.model.layers[0].mlp.up_proj).__name__ == "Float8Linear"
    assert model.model.layers[0].mlp.up_proj.weight is weight
    assert type(model.lm_head) is nn.Linear
    model(torch.randint(0, 256, (2, 16))).logits.sum().backward()
    assert weight.grad is not None


def test_hardware_fp8_needs_a_device_that_has_it() -> None:
    with pytest.raises(Fp8Error, match=r"CPU cannot.*fp8='emulate'"):
        check_fp8_device(True, torch.device("cpu"))
    check_fp8_device("emulate", torch.device("cpu"))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"fp8": "fast"}, r"fp8='fast' must be False, True \(fp8 matmuls\) or 'emulate'"),
        ({"fp8": 1}, r"fp8=1 must be"),
        ({"fp8": True, "zero_stage": 3, "zero_quantized_weights": True}, r"both replace ZeRO-3's weight all-gather"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(ParallelConfigError, match=match):
        ParallelConfig(**kwargs)


def test_the_deepspeed_backend_refuses_fp8() -> None:
    from lightning_par.strategies.deepspeed import DeepSpeedParallelStrategy

    with pytest.raises(ValueError, match=r"fp8 run on the native engines"):
        DeepSpeedParallelStrategy(zero_stage=3, fp8="emulate")


def test_a_projection_that_is_no_linear_is_listed_as_kept() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=256, n_positions=32, n_embd=32, n_layer=2, n_head=4))
    layers = _select(model)
    assert layers.converted == ()
    conv = {n for n, why in layers.kept.items() if why.startswith("not an nn.Linear (GPT-2's Conv1D")}
    assert conv == {f"transformer.h.{i}.{m}" for i in range(2) for m in ("attn.c_attn", "attn.c_proj", "mlp.c_fc",
                                                                          "mlp.c_proj")}  # fmt: skip
    assert any("not an nn.Linear" in line for line in layers.notes())


class _UserBlock(nn.Module):
    """A user's block whose code reads a layer's weight itself and changes another layer's output in place."""

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(32, 32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = torch.sigmoid(x @ self.gate.weight.t())  # the gate's weight, outside the gate's forward
        y = self.down(torch.relu(self.up(x)))
        y += x  # the down projection's output, changed in place
        return y * scale


class _UserNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(256, 32)
        self.blocks = nn.ModuleList([_UserBlock() for _ in range(2)])

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return x


def test_code_that_reads_a_weight_or_changes_an_output_in_place_keeps_the_layer() -> None:
    from lightning_par.parallel.fp8.probe import OUTPUT_IN_PLACE, WEIGHT_OUTSIDE

    layers = _select(_UserNet())
    assert layers.converted == ("blocks.0.up", "blocks.1.up")
    assert {n: w for n, w in layers.kept.items()} == {
        **{f"blocks.{i}.gate": WEIGHT_OUTSIDE for i in range(2)},
        **{f"blocks.{i}.down": OUTPUT_IN_PLACE for i in range(2)},
    }
    # Converted as selected, the model trains (it would fail in backward with the in-place add, or under ZeRO-3
    # hand the gate's fp8 weight to the matmul).
    model = _UserNet()
    convert_fp8(model, _select(model), emulate=True, zero3=False)
    model(torch.randint(0, 256, (2, 16))).sum().backward()
