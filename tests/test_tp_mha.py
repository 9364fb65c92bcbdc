"""torch's own ``nn.MultiheadAttention`` under tensor parallelism, without processes: the plan splits its packed
q/k/v by heads with its ``out_proj``, refuses overrides that would change the math, keeps whole the variants it cannot
split, and the value check before training compares every rank's copy (`parallel/tensor/mha.local_forward`) with
torch's own forward: a wrong rank computation is refused. Parity under tp, tp x ZeRO-3 and pipe x tp:
`test_tp_families.py`, `test_tp_mixed.py`."""

from __future__ import annotations

import types
from typing import Any

import pytest
import torch
from _job_models import TorchEncoderLM
from _mha_models import CrossDecoderLM, UserMHALM
from torch import nn

from lightning_par.parallel.tensor import TPPlanError, infer_tp_plan
from lightning_par.parallel.tensor import mha as mha_module
from lightning_par.parallel.tensor.check import check_local_shapes
from lightning_par.parallel.tensor.plan_validate import validate_tp
from lightning_par.parallel.tensor.simulate import rank_copy


def test_the_packed_attention_is_split_by_heads_with_its_out_proj() -> None:
    plan = infer_tp_plan(CrossDecoderLM())
    for attn in ("self_attn", "multihead_attn"):
        key = f"decoder.layers.*.{attn}"
        assert plan.styles[key] == "colwise_fused" and plan.styles[f"{key}.out_proj"] == "rowwise"
        assert plan.fused_split[key] == (32, 32, 32)
        head = plan.heads[key]
        assert (head.n_heads, head.head_dim, head.region, head.local_attrs) == (4, 8, key, {"num_heads": "n_heads"})
    assert not any("out_proj" in note for note in plan.notes)  # not "replicated, not in a pair" any more
    validate_tp(plan, 4)
    with pytest.raises(TPPlanError, match="tp=8 does not divide n_heads=4"):
        validate_tp(plan, 8)


@pytest.mark.parametrize(
    "override, match",
    [
        ({"encoder.layers.*.self_attn": "colwise"}, "choose one of colwise_fused, replicate"),
        ({"encoder.layers.*.self_attn": "rowwise"}, "cannot apply to attention"),
        ({"encoder.layers.*.self_attn": "replicate"}, "split only together"),  # out_proj still row-split
        ({"encoder.layers.*.self_attn.out_proj": "replicate"}, "split only together"),
    ],
)
def test_overrides_that_would_change_the_math_are_refused(override: dict[str, str], match: str) -> None:
    with pytest.raises(TPPlanError, match=match):
        infer_tp_plan(TorchEncoderLM(), overrides=override)


def test_both_kept_whole_by_an_override_is_a_plan() -> None:
    keep = {"encoder.layers.*.self_attn": "replicate", "encoder.layers.*.self_attn.out_proj": "replicate"}
    plan = infer_tp_plan(TorchEncoderLM(), overrides=keep)
    assert plan.styles["encoder.layers.*.linear1"] == "colwise"  # the MLP is still split


class _BiasKVBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(32, 4, add_bias_kv=True, batch_first=True)  # a learned extra key/value
        self.fc, self.proj = nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(x, x, x, need_weights=False)[0]
        return x + self.proj(torch.relu(self.fc(x)))


class _BiasKVLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 32), nn.Linear(32, 64)
        self.blocks = nn.ModuleList(_BiasKVBlock() for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


def test_variants_it_cannot_split_stay_whole() -> None:
    plan = infer_tp_plan(_BiasKVLM())
    assert "blocks.*.attn" not in plan.styles and "blocks.*.attn" not in plan.heads
    assert plan.styles["blocks.*.attn.out_proj"] == "replicate" and plan.styles["blocks.*.fc"] == "colwise"


@pytest.mark.parametrize("make", [TorchEncoderLM, UserMHALM, CrossDecoderLM])
@pytest.mark.parametrize("tp", [2, 4])
def test_every_rank_copy_sums_to_torchs_own_forward(make: Any, tp: int) -> None:
    torch.manual_seed(0)
    model = make()
    model.example_input_array = torch.randint(0, 256, (2, 8))
    check_local_shapes(model, infer_tp_plan(model), tp)  # shapes and values of every rank against the whole block


def test_the_value_check_fails_a_wrong_rank_computation(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each rank's attention scaled by 1 instead of 1/sqrt(head_dim): the shapes agree, the values do not.
    # No example_input_array: the check runs block 0 on tokens that differ by position (check.py), so this model,
    # which has no positional information, still meets attention that is not uniform.
    torch.manual_seed(0)
    model = TorchEncoderLM()
    plan = infer_tp_plan(model)
    f = torch.nn.functional  # torch's own forward, the whole block's, keeps the right scale

    def unscaled(*args: Any, **kwargs: Any) -> torch.Tensor:
        return f.scaled_dot_product_attention(*args, **kwargs, scale=1.0)

    wrong = types.SimpleNamespace(linear=f.linear, dropout=f.dropout, scaled_dot_product_attention=unscaled)
    monkeypatch.setattr(mha_module, "F", wrong)
    with pytest.raises(TPPlanError, match=r"encoder.layers.0.self_attn.out_proj's output \(summed over the ranks\)"):
        check_local_shapes(model, plan, 2)


def test_the_value_check_fails_wrong_attention_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    # The head-averaged weights a user's block adds to its output: each rank averaging only its own heads.
    torch.manual_seed(0)
    model = UserMHALM()
    model.example_input_array = torch.randint(0, 256, (2, 8))
    plan = infer_tp_plan(model)
    monkeypatch.setattr(mha_module, "_all_heads", lambda probs, *a: probs.mean(dim=1))
    with pytest.raises(TPPlanError, match="do not compute what the whole block computes"):
        check_local_shapes(model, plan, 2)


def test_a_rank_copy_keeps_its_heads_rows_and_names() -> None:
    model = TorchEncoderLM()
    plan = infer_tp_plan(model)
    block = model.encoder.layers[0]
    local = rank_copy(block, plan, 2, 1)
    attn = local.self_attn
    assert attn.num_heads == 2 and attn.in_proj_weight.shape == (48, 32)
    whole = block.self_attn.in_proj_weight
    for part in range(3):  # rank 1 holds rows 16..32 of each of q, k and v
        assert torch.equal(attn.in_proj_weight[16 * part : 16 * (part + 1)], whole[32 * part + 16 : 32 * (part + 1)])
    assert local.self_attn.out_proj.weight.shape == (32, 16)
    names = set(dict(rank_copy(block, plan, 2, 0).named_parameters()))
    assert names == set(dict(block.named_parameters()))  # rank 0 adds the row-split biases, once
