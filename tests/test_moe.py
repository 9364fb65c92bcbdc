"""`lightning_par.nn.MoE` on one device (no process group): routing math, capacity, auxiliary losses, validation;
and the up-front rejection of MoE strategy combinations that are not implemented."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lightning_par.config import ParallelConfig, ParallelConfigError
from lightning_par.nn import MoE, moe_loss
from lightning_par.strategies.registry import strategy_kwargs


def _layer(top_k: int = 2, capacity_factor: float | None = None, gated: bool = False, **kw) -> MoE:
    torch.manual_seed(0)
    m = MoE(8, 16, 4, top_k=top_k, capacity_factor=capacity_factor, gated=gated, activation="silu", **kw)
    with torch.no_grad():
        m.router.weight.mul_(20)  # sharper routing than the default init: distinct, unbalanced choices
    return m


def _expert(m: MoE, e: int, x: torch.Tensor) -> torch.Tensor:
    w = m.experts
    h = F.silu(x @ w.w1[e])
    if w.w3 is not None:
        h = h * (x @ w.w3[e])
    return h @ w.w2[e]


def _naive(m: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Token by token: sum over the chosen experts of gate * expert(x), skipping dropped assignments."""
    probs = m.router(x).softmax(-1)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        top = probs[t].topk(m.top_k)
        gates = top.values / top.values.sum() if m.normalize_gates else top.values
        for j, e in enumerate(top.indices.tolist()):
            if keep is None or keep[t, j]:
                out[t] += gates[j] * _expert(m, e, x[t])
    return out


@pytest.mark.parametrize(("top_k", "gated"), [(1, False), (2, True), (4, False)])
def test_dropless_is_the_dense_mixture(top_k, gated):
    m = _layer(top_k, None, gated)
    x = torch.randn(3, 7, 8)
    y = m(x)
    assert y.shape == x.shape
    torch.testing.assert_close(y.reshape(-1, 8), _naive(m, x.reshape(-1, 8)), rtol=1e-5, atol=1e-6)
    assert m.stats["kept"].all() and float(m.stats["dropped_fraction"]) == 0.0
    if top_k == 4:  # every expert, gates renormalised over all of them: the full softmax mixture
        probs = m.router(x.reshape(-1, 8)).softmax(-1)
        dense = sum(probs[:, e : e + 1] * _expert(m, e, x.reshape(-1, 8)) for e in range(4))
        torch.testing.assert_close(y.reshape(-1, 8), dense, rtol=1e-5, atol=1e-6)


def _reference_keep(priority: torch.Tensor, chosen: torch.Tensor, cap: int) -> torch.Tensor:
    """Per expert, keep the assignments whose priority beats the (C+1)-th best (ties at the cut dropped)."""
    keep = torch.ones_like(chosen, dtype=torch.bool)
    for e in range(int(chosen.max()) + 1):
        mask = chosen == e
        scores = sorted(priority[mask].tolist(), reverse=True)
        if len(scores) > cap:
            keep[mask] = priority[mask] > scores[cap]
    return keep


@pytest.mark.parametrize("top_k", [1, 2])
def test_capacity_drops_the_lowest_priority_assignments(top_k):
    m = _layer(top_k, capacity_factor=0.75)
    x = torch.randn(64, 8)
    y = m(x)
    n, cap = 64, m.capacity(64)
    assert cap == math.ceil(0.75 * n * top_k / 4)
    probs = m.router(x).softmax(-1)
    chosen = m.stats["expert_index"]
    keep = _reference_keep(probs.gather(1, chosen), chosen, cap)
    assert torch.equal(m.stats["kept"], keep)
    counts = torch.bincount(chosen[keep], minlength=4)
    assert counts.max() <= cap and not keep.all()  # the test routes unevenly enough to drop
    assert float(m.stats["dropped_fraction"]) == pytest.approx(1 - keep.sum().item() / (n * top_k))
    assert torch.equal(m.stats["tokens_per_expert"], torch.bincount(chosen.reshape(-1), minlength=4).float())
    torch.testing.assert_close(y, _naive(m, x, keep), rtol=1e-5, atol=1e-6)
    # Dropping depends on the set of tokens, not their order: shuffled tokens drop the same assignments.
    perm = torch.randperm(n)
    y_perm = m(x[perm])
    assert torch.equal(m.stats["kept"], keep[perm])
    torch.testing.assert_close(y_perm, y[perm], rtol=1e-6, atol=1e-7)


def test_tied_priorities_at_the_capacity_cut_are_all_dropped():
    m = _layer(1, capacity_factor=1.0)
    with torch.no_grad():
        m.router.weight.zero_()
        m.router.weight[0] = 1.0  # logits (sum(x), 0, 0, 0): positive inputs all pick expert 0, priority ~ sum(x)
    x = torch.rand(8, 8) * 0.1
    x[3] += 2.0  # the unique best token
    x[1] = x[5] = x[6] = x[0] = x[0] + 1.0  # four identical tokens, next best: the cut (C=2) falls inside them
    m(x)
    assert m.capacity(8) == 2 and (m.stats["expert_index"] == 0).all()
    # Keeping 2 of the 4 twins would depend on their order in the batch (and so on how ranks split it): the rule
    # keeps only assignments strictly above the (C+1)-th priority, so all twins are dropped.
    assert m.stats["kept"][:, 0].nonzero().flatten().tolist() == [3]


def test_auxiliary_losses_match_their_formulas():
    m = _layer(2, aux_loss_coef=0.01, z_loss_coef=0.001)
    x = torch.randn(40, 8)
    m(x)
    logits = m.router(x)
    probs = logits.softmax(-1)
    f = torch.bincount(probs.topk(2).indices.reshape(-1), minlength=4) / (40 * 2)
    torch.testing.assert_close(m.aux_loss, 4 * (f * probs.mean(0)).sum())
    torch.testing.assert_close(m.z_loss, logits.logsumexp(-1).pow(2).mean())
    torch.testing.assert_close(moe_loss(torch.nn.Sequential(m)), 0.01 * m.aux_loss + 0.001 * m.z_loss)
    # Uniform routing gives aux_loss == 1 for any k.
    with torch.no_grad():
        m.router.weight.zero_()
    m(x)
    assert float(m.aux_loss.detach()) == pytest.approx(1.0)
    # The balancing loss trains the router only (the counts f are constants).
    m.zero_grad()
    m(x)
    m.aux_loss.backward()
    assert m.router.weight.grad is not None and m.experts.w1.grad is None


def test_expert_bias_steers_selection_not_gates_and_jitter_only_in_training():
    m = _layer(1, expert_bias=True)
    x = torch.randn(32, 8)
    y0 = m(x)
    assert m.expert_bias is not None
    m.expert_bias[2] = 10.0  # everyone picks expert 2; its gate is still its softmax probability
    y = m(x)
    assert (m.stats["expert_index"] == 2).all()
    probs = m.router(x).softmax(-1)
    torch.testing.assert_close(y, probs[:, 2:3] * _expert(m, 2, x), rtol=1e-5, atol=1e-6)
    m.update_expert_bias(torch.tensor([0.0, 0.0, 32.0, 0.0]), rate=0.5)
    assert m.expert_bias.tolist() == [0.5, 0.5, 9.5, 0.5]
    j = _layer(1, router_jitter=0.1)
    j.eval()
    torch.testing.assert_close(j(x), j(x))
    torch.testing.assert_close(j(x), y0)  # same seed/init as m: no jitter in eval
    j.train()
    torch.manual_seed(1)
    a = j(x)
    assert not torch.equal(a, j(x))  # jitter noise differs per call in training


def test_layer_validation_names_the_fix():
    with pytest.raises(ValueError, match=r"top_k=5 must be in 1..n_experts=4"):
        MoE(8, 16, 4, top_k=5)
    with pytest.raises(ValueError, match=r"capacity_factor=0 must be > 0"):
        MoE(8, 16, 4, capacity_factor=0)
    with pytest.raises(ValueError, match=r"capacity_factor=-1.0 must be > 0"):
        MoE(8, 16, 4, capacity_factor=-1.0)


def test_strategy_names_and_rejected_combinations():
    assert strategy_kwargs("moe") == {"zero_stage": 0, "offload": False, "auto_dims": ("ep",)}
    assert strategy_kwargs("moe_zero2")["auto_dims"] == ("ep", "dp")
    assert strategy_kwargs("moe_zero1")["zero_stage"] == 1
    assert strategy_kwargs("pipe_tp_moe_zero1")["auto_dims"] == ("pp", "tp", "ep", "dp")  # tests/test_pipe_moe.py
    assert strategy_kwargs("pipe_moe_zero1")["auto_dims"] == ("pp", "ep", "dp")  # trains: tests/test_pipe_moe.py
    assert strategy_kwargs("tp_moe_zero3") == {"zero_stage": 3, "offload": False, "auto_dims": ("tp", "ep", "dp")}
    assert strategy_kwargs("moe_zero3")["zero_stage"] == 3
    ParallelConfig(ep=2, tp=2).check_supported()  # tp x ep: tests/test_tp_moe.py
    ParallelConfig(ep=2, zero_stage=3).check_supported()
    ParallelConfig(ep=2, zero_stage=2).check_supported()
    with pytest.raises(
        ParallelConfigError, match=r"ep=3 does not divide the data-parallel size 4; choose ep in \{1, 2, 4\}"
    ):
        ParallelConfig(ep=3).resolve(4)


def test_moe_layers_are_found_in_our_model_and_in_hugging_face_mixtral():
    from transformers import MixtralConfig, MixtralForCausalLM

    from lightning_par.models import MoEGPT
    from lightning_par.parallel.experts.finder import find_moe_layers

    ours = find_moe_layers(MoEGPT(n_layer=2, n_embd=32, n_experts=4, top_k=1))
    assert [(x.name, x.kind, x.n_experts, x.top_k) for x in ours] == [
        (f"transformer.h.{i}.moe", "lightning_par", 4, 1) for i in range(2)
    ]
    config = MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, num_local_experts=6,
                           num_experts_per_tok=2)  # fmt: skip
    hf = find_moe_layers(MixtralForCausalLM(config))
    assert [(x.name, x.kind, x.n_experts, x.top_k) for x in hf] == [
        (f"model.layers.{i}.mlp", "stacked", 6, 2) for i in range(2)
    ]
    assert all(x.experts is x.module.experts for x in hf)
    assert find_moe_layers(torch.nn.Sequential(torch.nn.Linear(4, 4))) == []


@pytest.mark.parametrize(
    "model, layers, n_experts",
    [("hf_qwen2_moe", [0, 1], 4), ("hf_qwen3_moe", [0, 1], 4), ("hf_olmoe", [0, 1], 4),
     ("hf_deepseek_v3", [1], 4), ("hf_gpt_oss", [0, 1], 4)],
)  # fmt: skip
def test_moe_families_are_recognised_by_structure(model, layers, n_experts):
    from _job_models import MODELS

    from lightning_par.parallel.experts.finder import find_moe_layers, unrecognised_experts

    lm = MODELS[model]()
    found = find_moe_layers(lm)
    assert [(x.name, x.kind, x.n_experts, x.top_k) for x in found] == [
        (f"model.model.layers.{i}.mlp", "stacked", n_experts, 2) for i in layers
    ]
    for x in found:
        assert x.experts is x.module.experts and x.router is getattr(x.module, "gate", getattr(x.module, "router", 0))
        # Shared experts (Qwen2-MoE shared_expert, DeepSeek-V3 shared_experts) are not part of the experts container.
        assert not any("shared" in n for n, _ in x.experts.named_parameters())
    assert unrecognised_experts(lm, found) == []


def test_module_list_experts_are_recognised_and_mismatched_ones_refused():
    from _job_models import MODELS

    from lightning_par.parallel.experts.finder import find_moe_layers, unrecognised_experts

    found = find_moe_layers(MODELS["user_moe_list"]())
    assert [(x.name, x.kind, x.n_experts, x.top_k) for x in found] == [
        (f"blocks.{i}.moe", "module_list", 4, 2) for i in range(2)
    ]
    assert all(x.router is x.module.router and x.experts is x.module.experts for x in found)
    # A stack of identical decoder blocks is not a ModuleList of experts, although a head could have E outputs.
    assert find_moe_layers(MODELS["gpt"]()) == []

    uneven = MODELS["user_moe_uneven"]()  # expert 0 is wider than the others
    assert find_moe_layers(uneven) == []
    problems = unrecognised_experts(uneven)
    assert [p.split(" ", 1)[0] for p in problems] == ["blocks.0.moe", "blocks.1.moe"]
    assert "experts: ModuleList of 4" in problems[0] and "router: Linear (weight [4, 32])" in problems[0]
    assert "expected a router (a module with weight [E, d]" in problems[0]


def test_a_module_list_holding_none_is_a_dense_model_not_a_crash():
    # x-transformers keeps optional per-layer modules as None entries of ModuleLists; the finder crashed on them
    # (issue 37). Its decoder trains under zero3 in tests/test_families.py.
    from lightning_par.parallel.experts.finder import find_moe_layers, unrecognised_experts

    model = torch.nn.Sequential(torch.nn.ModuleList([None, None]), torch.nn.ModuleList([torch.nn.Linear(4, 4), None]))
    assert find_moe_layers(model) == [] and unrecognised_experts(model) == []


def test_unrecognised_experts_are_refused_before_any_exchange():
    from _job_models import MODELS

    from lightning_par.parallel.experts.apply import apply_expert_parallel

    class _Mesh:  # apply_expert_parallel reads the ep size only before refusing
        class ep:
            @staticmethod
            def size() -> int:
                return 2

    with pytest.raises(ValueError, match=r"ep=2: UserMoEList has experts that expert parallelism does not recognise, "
                       r"in blocks\.0\.moe .*'zero3'"):  # fmt: skip
        apply_expert_parallel(MODELS["user_moe_uneven"](), _Mesh(), None)  # type: ignore[arg-type]
