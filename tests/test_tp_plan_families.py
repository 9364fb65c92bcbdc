"""Plan inference (no process group) on families lightning_par did not write, and the affine-projection probe."""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from _families import GroupedLM, HFViT, NanoLM, _BlocksLM
from _hf_models import HFLlama
from torch import Tensor, nn

from lightning_par.models.gpt import GPT
from lightning_par.parallel.tensor import TPPlanError, infer_tp_plan
from lightning_par.parallel.tensor.apply import _set_local_head_counts, sequence_parallel_blocker
from lightning_par.parallel.tensor.check import check_local_shapes
from lightning_par.parallel.tensor.kv_heads import part_rows
from lightning_par.parallel.tensor.plan_affine import Affine, affine

transformers = pytest.importorskip("transformers")
litgpt = pytest.importorskip("litgpt")
warnings.filterwarnings("ignore", message=".*token_id must be")


def _gpt2() -> nn.Module:
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=256, n_positions=64,
                                     attn_implementation="eager")  # fmt: skip
    return transformers.GPT2LMHeadModel(config)


def _litgpt() -> nn.Module:
    config = litgpt.Config.from_name(
        "Llama-3.2-1B", n_layer=2, n_embd=32, n_head=4, n_query_groups=2, intermediate_size=64,
        padded_vocab_size=256, block_size=64, head_size=8,
    )  # fmt: skip
    return litgpt.GPT(config)


class _MyLinear(nn.Module):
    """A user's own Linear class (not an nn.Linear): weight [out, in], F.linear."""

    def __init__(self, i: int, o: int) -> None:
        super().__init__()
        self.weight, self.bias = nn.Parameter(torch.randn(o, i)), nn.Parameter(torch.randn(o))

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class _Scale(nn.Module):
    """A 2-D weight whose forward is not affine in the probed way (elementwise): not a projection."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.weight.sum(0)


def test_affine_probe_decides_the_weight_layout() -> None:
    conv = transformers.pytorch_utils.Conv1D(96, 32)  # nf=96 outputs, nx=32 inputs: weight [32, 96]
    assert affine(conv) == Affine(32, 96, True)
    square = transformers.pytorch_utils.Conv1D(32, 32)  # [in, out] vs [out, in] only the forward tells apart
    assert affine(square) == Affine(32, 32, True)
    assert affine(_MyLinear(32, 32)) == Affine(32, 32, False)
    assert affine(nn.Linear(8, 16)) == Affine(8, 16, False)
    assert affine(_Scale()) is None and affine(nn.LayerNorm(8)) is None and affine(nn.Embedding(4, 8)) is None
    with torch.device("meta"):
        meta = transformers.pytorch_utils.Conv1D(96, 32)
    assert affine(meta) == Affine(32, 96, True)  # no numbers to probe: the nf attribute says [in, out]


def test_gpt2_conv1d_plan() -> None:
    plan = infer_tp_plan(_gpt2())
    p = "transformer.h.*."
    assert plan.traced
    assert {k: v for k, v in plan.styles.items() if "attn" in k or "mlp" in k} == {
        p + "attn.c_attn": "colwise_fused",
        p + "attn.c_proj": "rowwise",
        p + "mlp.c_fc": "colwise",
        p + "mlp.c_proj": "rowwise",
    }
    head = plan.heads[p + "attn"]
    assert head.fused_split == {p + "attn.c_attn": (32, 32, 32)}  # read from split(self.split_size) in forward
    # split_size sizes the split of the fused output: per-rank like the head count.
    assert head.local_attrs == {"num_heads": "n_heads", "embed_dim": "q_width", "split_size": "split_width"}
    assert not any("assumes a [q | k | v]" in n for n in plan.notes)  # the layout was observed, not guessed


def test_litgpt_grouped_fused_qkv_and_counts_on_the_shared_config() -> None:
    model = _litgpt()
    plan = infer_tp_plan(model)
    p = "transformer.h.*."
    head = plan.heads[p + "attn"]
    assert plan.styles[p + "attn.qkv"] == "colwise_fused" and plan.styles[p + "attn.proj"] == "rowwise"
    assert (head.n_heads, head.n_kv_heads, head.head_dim) == (4, 2, 8)
    assert head.fused_split == {p + "attn.qkv": (32, 16, 16)}  # q | k | v of unequal widths
    assert head.local_attrs == {"config.n_head": "n_heads", "config.n_query_groups": "n_kv_heads"}
    blocks = list(model.transformer.h)
    _set_local_head_counts(blocks, plan, "transformer.h.*", 2)
    # Each attention got its own copy with per-rank counts; the model's (and the blocks') config stays global.
    assert [(b.attn.config.n_head, b.attn.config.n_query_groups) for b in blocks] == [(2, 1), (2, 1)]
    assert blocks[0].attn.config is not blocks[1].attn.config
    assert model.config.n_head == 4 and blocks[0].config is model.config and model.config.n_query_groups == 2


def test_bert_region_is_the_module_of_its_input_projections() -> None:
    config = transformers.BertConfig(vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=64)  # fmt: skip
    model = transformers.BertForMaskedLM(config)
    plan = infer_tp_plan(model)
    p = "bert.encoder.layer.*."
    head = plan.heads[p + "attention.output"]
    assert head.region == p + "attention.self"  # q/k/v there; the output projection and a residual add elsewhere
    assert head.source.endswith("attention.self.attention_head_size")
    assert plan.mlps[p + "output"].region == p + "intermediate"
    assert sequence_parallel_blocker(plan, model.bert.encoder.layer[0]) is None


def test_replicated_attention_turns_sequence_parallelism_off() -> None:
    model = _gpt2()
    p = "transformer.h.*.attn."
    plan = infer_tp_plan(model, overrides={p + "c_attn": "replicate", p + "c_proj": "replicate"})
    why = sequence_parallel_blocker(plan, model.transformer.h[0])
    assert why is not None and "attention transformer.h.*.attn is replicated" in why


def test_part_rows_give_each_rank_its_slice_of_every_part() -> None:
    # q of 4 heads, k and v of 2 (head size 1): rank 0 gets q heads 0-1, k head 0, v head 0.
    qkv = (False, True, True)
    assert part_rows((4, 2, 2), qkv, 2, 1, 0).tolist() == [0, 1, 4, 6]
    assert part_rows((4, 2, 2), qkv, 2, 1, 1).tolist() == [2, 3, 5, 7]
    # tp 4 over 2 k/v heads: ranks 0-1 read k/v head 0, ranks 2-3 head 1 (each k/v head on 2 ranks).
    assert [part_rows((4, 2, 2), qkv, 4, 2, r).tolist() for r in range(4)] == [
        [0, 4, 6], [1, 4, 6], [2, 5, 7], [3, 5, 7]
    ]  # fmt: skip
    # A separate k projection of one head (multi-query), tp 2: both ranks compute all of it.
    assert part_rows((8,), (True,), 2, 2, 1).tolist() == list(range(8))


def test_full_width_split_runs_on_gathered_outputs_and_the_override_keeps_it_whole() -> None:
    model = NanoLM()
    plan = infer_tp_plan(model)  # widths alone look fine: fused [q | k | v], split into 3 by the probe
    assert plan.styles["h.*.attn.c_attn"] == "colwise_fused"
    # Its code fails on a rank's slices (split(C) with C = x.size(-1)): the attention runs on gathered outputs.
    checked = check_local_shapes(model, plan, 2)
    assert checked.gathered == ("h.*.attn",) and checked.styles["h.*.attn.c_attn"] == "colwise_fused"
    # Kept whole by an override instead, nothing is gathered (the MLP is still split), and the model is untouched.
    kept = infer_tp_plan(model, overrides={"h.*.attn.c_attn": "replicate", "h.*.attn.c_proj": "replicate"})
    assert check_local_shapes(model, kept, 2).gathered == ()
    assert model.h[0].attn.c_attn.weight.shape == (96, 32) and model.h[0].attn.n_head == 4


@pytest.mark.parametrize("make", [_gpt2, _litgpt, HFLlama, lambda: GPT(vocab_size=256, block_size=32, n_layer=2,
                                                                        n_head=4, n_embd=32)])  # fmt: skip
def test_models_that_shard_pass_the_local_shape_check(make: object) -> None:
    model = make()  # type: ignore[operator]
    check_local_shapes(model, infer_tp_plan(model), 2)
    heads = [m for m in model.modules() if hasattr(m, "config") and hasattr(m.config, "n_head")]
    assert all(m.config.n_head == 4 for m in heads)  # the check ran on a copy


class _ViewedAttn(nn.Module):
    """A fused qkv first viewed as (B, T, heads, 3 * head_dim) (GPT-NeoX) or (B, T, 3, heads, head_dim)."""

    def __init__(self, per_head: bool) -> None:
        super().__init__()
        self.num_heads, self.head_size, self.per_head = 4, 8, per_head
        self.query_key_value, self.dense = nn.Linear(32, 96), nn.Linear(32, 32)

    def forward(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        if self.per_head:
            q, k, v = self.query_key_value(x).view(B, T, self.num_heads, 3 * self.head_size).chunk(3, dim=-1)
        else:
            q, k, v = self.query_key_value(x).view(B, T, 3, self.num_heads, self.head_size).unbind(2)
        y = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=True)
        return self.dense(y.transpose(1, 2).reshape(B, T, -1))


class _ViewedLM(nn.Module):
    def __init__(self, per_head: bool) -> None:
        super().__init__()
        self.wte, self.head = nn.Embedding(256, 32), nn.Linear(32, 256)
        self.h = nn.ModuleList([_ViewedAttn(per_head) for _ in range(2)])

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = x + block(x)
        return self.head(x)


@pytest.mark.parametrize(("make", "style", "split"), [
    (GroupedLM, "colwise", {}),  # view(B, T, n_kv, q_per_kv + 2, hd): whole groups per rank
    (lambda: _ViewedLM(per_head=True), "colwise", {}),  # view(B, T, n_heads, 3 * hd): whole heads per rank
    (lambda: _ViewedLM(per_head=False), "colwise_fused", {"h.*.query_key_value": (32, 32, 32)}),
])  # fmt: skip
def test_fused_layout_read_from_the_view_after_it(make: object, style: str, split: dict) -> None:
    plan = infer_tp_plan(make())  # type: ignore[operator]
    name = next(k for k in plan.styles if k.endswith(("attn.attn", "query_key_value")))
    assert plan.styles[name] == style
    head = next(iter(plan.heads.values()))
    assert head.fused_split == split
    assert not any("assumes a [q | k | v]" in n for n in plan.notes)


def test_vit_is_probed_with_its_example_input_array() -> None:
    model = HFViT()  # forward takes pixels: the probe uses example_input_array, not token ids
    plan = infer_tp_plan(model)
    p = "model.vit.layers.*."
    assert plan.traced and not plan.notes
    assert plan.styles[p + "attention.q_proj"] == "colwise" and plan.styles[p + "mlp.fc2"] == "rowwise"
    assert sequence_parallel_blocker(plan, model.model.vit.layers[0]) is None  # SP on, with 17 tokens padded
    check_local_shapes(model, plan, 2)


class _PReLUMLP(nn.Module):
    """An MLP whose activation learns its slope (``nn.PReLU``): a parameter no tp style covers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.proj = nn.Linear(32, 64), nn.PReLU(), nn.Linear(64, 32)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(self.act(self.fc(x)))


class _PReLUBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(32), _PReLUMLP()

    def forward(self, x: Tensor) -> Tensor:
        return x + self.mlp(self.norm(x))


class _PReLULM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte, self.head = nn.Embedding(256, 32), nn.Linear(32, 256)
        self.h = nn.ModuleList(_PReLUBlock() for _ in range(2))

    def forward(self, idx: Tensor) -> Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.head(x)


def test_parameters_no_style_covers_inside_a_split_region_are_refused() -> None:
    # Each rank would train the PReLU slope on its own half of the hidden units (Apertus's xIELU: the zoo sweep found
    # its loss drifting from one process under tp): refused before training, with the plan that keeps it exact.
    model = _PReLULM()
    plan = infer_tp_plan(model)
    with pytest.raises(TPPlanError, match=r"h\.0\.mlp\.act \(PReLU\) owns parameters \(weight\) inside a region .*"
                       r'tp_plan=\{"h\.\*\.mlp\.fc": "replicate", "h\.\*\.mlp\.proj": "replicate"\}'):  # fmt: skip
        check_local_shapes(model, plan, 2)
    whole = infer_tp_plan(model, overrides={"h.*.mlp.fc": "replicate", "h.*.mlp.proj": "replicate"})
    check_local_shapes(model, whole, 2)


class _ConstGroupAttn(nn.Module):
    """CodeGen's attention as a user might write it: the fused qkv is regrouped by a constant of the code (4 groups,
    CodeGen's ``mp_num``), which tp cannot rewrite. On each rank's slice the shapes still agree (the head count is
    rewritten), but the rank reads other columns than its heads': it would train silently wrong."""

    def __init__(self) -> None:
        super().__init__()
        self.n_head, self.head_dim = 4, 8
        self.qkv, self.out = nn.Linear(32, 96, bias=False), nn.Linear(32, 32)

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x).reshape(b, t, 4, -1)
        q, v, k = qkv.split(qkv.shape[-1] // 3, dim=-1)
        q, k, v = (z.reshape(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


def _codegen() -> nn.Module:
    from _zoo import build

    return build("codegen")


@pytest.mark.parametrize("make", [lambda: _BlocksLM(_ConstGroupAttn), _codegen])
def test_ranks_computing_other_values_than_the_whole_run_on_gathered_outputs(make: Any) -> None:
    # Shapes agree on every rank, values do not: the ranks' copies of block 0, run on its real input and summed at
    # the row-split projection, differ from the whole block (parallel/tensor/simulate.py). That attention runs on
    # the gathered outputs of its split projections instead (parallel/tensor/full_width.py), where its code sees
    # exactly what the whole projections compute; the rest of the block stays split by heads / hidden units.
    model = make()
    plan = infer_tp_plan(model)
    attn = next(k for k in plan.heads)
    checked = check_local_shapes(model, plan, 2)
    assert checked.gathered == (attn,)
    assert any(s == "colwise" for k, s in checked.styles.items() if k not in plan.heads[attn].projections)
    # The region kept whole by an override instead: nothing to gather.
    whole = infer_tp_plan(model, overrides=dict.fromkeys(plan.heads[attn].projections, "replicate"))
    assert check_local_shapes(model, whole, 2).gathered == ()


def test_low_rank_adapters_are_found_by_structure_and_follow_their_base() -> None:
    # peft's lora.Linear (base_layer, lora_A.default, lora_B.default) and a user's wrapper (base, a, b): the plan
    # styles the base where the projection would be, the pairs follow it (parallel/tensor/adapters.py), and every
    # rank's copy of block 0 computes what the whole block computes (the value check runs on the adapters too).
    from _lora_models import PeftLlama, UserLoRALM

    from lightning_par.parallel.tensor.adapters import adapter_styles, find_adapters

    peft = PeftLlama()
    layer = peft.model.base_model.model.model.layers[0]
    found = find_adapters(layer)
    assert found["self_attn.q_proj.base_layer"] == (
        ("self_attn.q_proj.lora_A.default", "self_attn.q_proj.lora_B.default"),
    )
    assert len(found) == 7 and not find_adapters(_litgpt())  # plain attention and MLP modules are no wrappers
    plan = infer_tp_plan(peft)
    styles = {k.rpartition("layers.*.")[2]: s for k, s in plan.styles.items()}
    assert styles["self_attn.k_proj.base_layer"] == "colwise" and styles["mlp.down_proj.base_layer"] == "rowwise"
    follows = adapter_styles(styles, found)
    assert follows["self_attn.k_proj.lora_B.default"] == ("colwise", "self_attn.k_proj.base_layer")
    assert follows["mlp.down_proj.lora_A.default"] == ("rowwise", "mlp.down_proj.base_layer")
    assert "self_attn.k_proj.lora_A.default" not in follows  # whole: every rank's heads read all of it
    check_local_shapes(peft, plan, 2)
    user = UserLoRALM()
    check_local_shapes(user, infer_tp_plan(user), 2)
    assert find_adapters(user.layers[1])["fn.up.base"] == (("fn.up.a", "fn.up.b"),)


def test_a_norm_over_the_split_width_is_not_refused_by_the_value_check() -> None:
    # OLMoE's q_norm / k_norm over the whole projection width reduce their statistics over tp, which a rank's copy
    # alone cannot; on tokens that differ by position its copy's values differ from the whole block's (relative
    # error 0.07 measured), so the value check leaves such plans to the shape check and the parity tests.
    from _job_models import MODELS

    torch.manual_seed(0)
    model = MODELS["hf_olmoe"]()
    model.example_input_array = torch.randint(0, 256, (2, 8))
    plan = infer_tp_plan(model)
    assert "colwise_norm" in plan.styles.values()
    check_local_shapes(model, plan, 2)


def test_a_wrapped_fused_projection_is_read_through_the_adapters_sum() -> None:
    # peft's LoRA on Phi-3: its fused gate_up_proj is chunked after the wrapper adds the adapter's output. The plan
    # reads a wrapped projection's output through that sum (blocks/_probe.py `_see_through`), so the LoRA model gets
    # the plain model's plan (it was refused: "an MLP or attention with fused projections?").
    pytest.importorskip("peft")
    from _families import HFPhi3
    from _lora_models import peft_phi3

    from lightning_par.parallel.tensor.plan import infer_tp_plan

    def block_styles(model: Any) -> dict[str, str]:
        styles = infer_tp_plan(model).styles.items()
        return {k.split("layers.*.")[1].removesuffix(".base_layer"): v for k, v in styles if "layers.*." in k}

    wrapped, plain = block_styles(peft_phi3()), block_styles(HFPhi3())
    assert wrapped == plain and wrapped["mlp.gate_up_proj"] == "colwise_fused"
