"""`lightning-par check` and `lightning_par.analysis.compatibility.check_model`: which strategies a model can train
under, decided by the same checks set-up runs, with the reason for each refusal."""

from __future__ import annotations

import torch
from _job_models import MODELS

from lightning_par.analysis.compatibility import check_model, format_verdicts
from lightning_par.cli import check_recipe


def _verdicts(model_key: str, optimizer: torch.optim.Optimizer | None = None, **kwargs) -> dict:
    model = MODELS[model_key]()
    return {v.strategy: v for v in check_model(model, optimizer, **kwargs)}


def test_dense_gpt_trains_under_every_dense_strategy_and_moe_names_why_not():
    got = _verdicts("gpt")
    dense = [n for n in got if "moe" not in n]
    assert all(got[n].ok for n in dense), [(n, got[n].reason) for n in dense if not got[n].ok]
    assert not got["moe"].ok and "no mixture-of-experts layer" in got["moe"].reason
    assert "2 blocks of transformer.h" in got["zero3"].reason


def test_moe_model_passes_moe_and_refuses_an_ep_that_does_not_divide_its_experts():
    assert _verdicts("moe_gpt", strategies=["moe"])["moe"].ok
    bad = _verdicts("moe_gpt_3experts", strategies=["moe", "zero3"])
    assert not bad["moe"].ok and "3 experts" in bad["moe"].reason and bad["zero3"].ok


def test_tp_refusal_names_the_degrees_that_divide():
    got = _verdicts("gpt_3heads", strategies=["tp", "pipe_tp", "zero2"])
    assert not got["tp"].ok and not got["pipe_tp"].ok and got["zero2"].ok
    assert got["tp"].reason == got["pipe_tp"].reason
    assert "does not divide n_heads=3" in got["tp"].reason and "choose tp in {1, 3}" in got["tp"].reason


def test_optimizer_verdicts_follow_the_layout_that_steps_it():
    model = MODELS["gpt"]()
    got = {v.strategy: v for v in check_model(model, torch.optim.Adafactor(model.parameters()))}
    # ZeRO-1/2 step a non-element-wise optimizer on whole parameters, one owner rank each.
    for name in ("zero1", "zero2", "pipe_zero1"):
        assert got[name].ok and "each rank steps the whole parameters it owns" in got[name].reason, name
    assert got["pipe"].ok, got["pipe"].reason
    # Refused where no whole parameter is stepped (DeepSpeed's flat partitions, tensor-parallel shards) and where
    # torch's Adafactor would step DTensors (FSDP2's, or tp's at stage 0), which it cannot; each reason names the fix.
    for name, fix in [("deepspeed_zero2", "backend='native'"), ("deepspeed_zero3", "backend='native'"),
                      ("pipe_tp_zero1", "Use tp=1"), ("zero3", "Use zero_stage=1 or 2"),
                      ("tp_zero3", "Use zero_stage=1 or 2"), ("tp", "Use tp=1")]:  # fmt: skip
        assert not got[name].ok and "Adafactor" in got[name].reason and fix in got[name].reason, name
    lbfgs = {v.strategy: v for v in check_model(model, torch.optim.LBFGS(model.parameters()))}
    assert not lbfgs["zero2"].ok and "couples every parameter" in lbfgs["zero2"].reason
    assert "zero_stage=2" in lbfgs["zero2"].reason and "Use zero_stage=0" in lbfgs["zero2"].reason
    muon_model = MODELS["muon_lm"]()
    muon = {
        v.strategy: v for v in check_model(muon_model, torch.optim.Muon(muon_model.parameters()), strategies=["zero3"])
    }
    assert muon["zero3"].ok, muon["zero3"].reason


def test_check_recipe_builds_the_recipe_model_and_prints_one_line_per_strategy():
    text = check_recipe(["--config", "recipes/moe.yaml"])
    lines = {line.split()[0]: line.split()[1] for line in text.splitlines()}
    assert lines["moe"] == "ok" and lines["zero3"] == "ok"
    assert text == format_verdicts(check_model(*_recipe_model_and_optimizer()))


def _recipe_model_and_optimizer():
    from lightning_par.analysis.compatibility import first_optimizer
    from lightning_par.cli import build_cli

    cli = build_cli(["--config", "recipes/moe.yaml"], run=False)
    return cli.model, first_optimizer(cli.model.configure_optimizers())


def test_moe_families_pass_moe_and_unrecognised_experts_are_named():
    for key in (
        "hf_mixtral",
        "hf_qwen2_moe",
        "hf_qwen3_moe",
        "hf_olmoe",
        "hf_deepseek_v3",
        "hf_gpt_oss",
        "user_moe_list",
    ):
        got = _verdicts(key, strategies=["moe", "moe_zero3", "zero3"])
        assert all(v.ok for v in got.values()), (key, {n: v.reason for n, v in got.items()})
        assert "4 experts" in got["moe"].reason, key
    bad = _verdicts("user_moe_uneven", strategies=["moe", "zero3"])
    assert not bad["moe"].ok and "blocks.0.moe" in bad["moe"].reason and bad["zero3"].ok


def test_moe_layers_are_kept_whole_under_tp_and_an_aux_loss_is_carried_under_pipe():
    got = _verdicts("hf_qwen2_moe", strategies=["tp", "pipe", "moe"])
    assert got["tp"].ok, got["tp"].reason  # attention split over tp, the MoE layer kept whole on every tp rank
    # Blocks that differ are planned per structure: DeepSeek-V3's dense first block and its MoE blocks, each with
    # its latent attention split by heads (the low-rank projections kept whole).
    deepseek = _verdicts("hf_deepseek_v3", strategies=["tp"])["tp"]
    assert deepseek.ok, deepseek.reason
    assert "2 block structures (model.model.layers.0, model.model.layers.1)" in deepseek.reason
    assert "latent attention, kept whole: kv_a_proj_with_mqa, kv_a_layernorm" in deepseek.reason
    # Its loss adds the router's load-balancing term, computed after the trunk from every layer's router logits:
    # the stages carry them to the last stage with the hidden state (tests/test_pipeline_aux.py trains it).
    assert got["pipe"].ok and "2 side outputs carried to the last stage (model.model.layers.0.mlp.gate" in (
        got["pipe"].reason)  # fmt: skip
    assert got["moe"].ok
    assert _verdicts("hf_deepseek_v3", strategies=["pipe"])["pipe"].ok  # no aux term in its loss


def test_lightning_par_moe_aux_loss_is_carried_under_pipe():
    # moe_loss(model) in training_step sums every layer's aux loss: each layer's travels to the last stage with the
    # hidden state (tests/test_pipe_moe.py trains it).
    got = _verdicts("moe_gpt", strategies=["pipe", "moe"])
    assert got["pipe"].ok and "2 side outputs carried to the last stage (transformer.h.0.moe" in got["pipe"].reason
    assert got["moe"].ok


def test_compatibility_table_points_at_real_jobs():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    table = (root / "docs" / "compatibility.md").read_text()
    cited = re.findall(r"`(test_\w+\.py)::(\w+)`", table)
    assert len(cited) >= 50
    import test_families

    for module, job in cited:
        if module == "test_families.py":
            assert job in test_families.ALL, job
        else:  # the job's key (or model name) is spelled in its test module
            assert f'"{job}"' in (root / "tests" / module).read_text(), (module, job)


def test_moe_families_with_per_head_parts_train_under_tp_and_say_what_follows_the_heads():
    # GPT-OSS's sinks, OLMoE's full-width and Qwen3's per-head q/k norms are split with the heads
    # (parallel/tensor/heads.py; trained against one process in tests/test_tp_heads.py).
    gpt_oss = _verdicts("hf_gpt_oss", strategies=["tp"])["tp"]
    assert gpt_oss.ok and "split with the heads: sinks (per head)" in gpt_oss.reason, gpt_oss.reason
    olmoe = _verdicts("hf_olmoe", strategies=["tp"])["tp"]
    assert olmoe.ok and "q_norm (colwise_norm), k_norm (colwise_norm)" in olmoe.reason, olmoe.reason
    qwen3 = _verdicts("hf_qwen3_moe", strategies=["tp"])["tp"]
    assert qwen3.ok and "q_norm (head_norm), k_norm (head_norm)" in qwen3.reason, qwen3.reason
    for ok in ("hf_mixtral", "hf_qwen2_moe"):
        got = _verdicts(ok, strategies=["tp", "pipe_tp"])
        assert got["tp"].ok and "kept whole on every tp rank" in got["tp"].reason, (ok, got["tp"].reason)


def test_cp_needs_sdpa_attention_and_names_the_switch():
    # Hugging Face's eager attention is refused (as set-up refuses it at the first forward); its sdpa path passes.
    eager = _verdicts("hf_llama", strategies=["cp", "tp_cp_zero1"])
    assert not eager["cp"].ok and "attn_implementation='sdpa'" in eager["cp"].reason, eager["cp"].reason
    assert not eager["tp_cp_zero1"].ok
    sdpa = _verdicts("hf_llama_sdpa", strategies=["cp", "pipe_tp_cp_zero1", "cp_zero3"])
    assert all(v.ok for v in sdpa.values()), {k: v.reason for k, v in sdpa.items()}
    assert "sequence split over cp" in sdpa["cp"].reason and "sdpa attention" in sdpa["cp"].reason
    gpt = _verdicts("gpt", strategies=["cp"])["cp"]
    assert gpt.ok and "checked at the first forward" in gpt.reason


def test_pipelines_name_the_cuts_skip_connections_leave_and_refuse_when_none_is_left():
    groups = _verdicts("skip_groups", strategies=["pipe", "zero3"])
    assert groups["pipe"].ok and "cuts only before blocks [3]" in groups["pipe"].reason
    unet = _verdicts("skip_unet", strategies=["pipe", "pipe_zero1", "zero3"])
    assert not unet["pipe"].ok and unet["zero3"].ok and unet["pipe_zero1"].reason == unet["pipe"].reason
    assert "No cut of this trunk keeps the values: train without pipeline parallelism" in unet["pipe"].reason


def test_blocks_nested_in_lists_of_lists_are_the_trunk():
    # x-transformers: each depth is a list [norms, attention or feed-forward, residual]; the trunk is each depth's
    # one composite module. tp plans both structures (trained with parity: test_tp_families.py::xt_decoder), zero3
    # wraps each one, and a pipeline is refused: the norms and residual adds between them run in the decoder's loop.
    from lightning_par.blocks.trunk import find_trunk

    trunk = find_trunk(MODELS["xt_decoder"]())
    assert trunk is not None and trunk.path == "model.attn_layers.layers"
    assert trunk.names == tuple(f"model.attn_layers.layers.{i}.1" for i in range(4))
    got = _verdicts("xt_decoder", strategies=["tp", "pipe", "zero3"])
    assert got["tp"].ok and "over 2 block structures" in got["tp"].reason, got["tp"].reason
    assert got["zero3"].ok and "4 blocks of model.attn_layers.layers" in got["zero3"].reason
    assert not got["pipe"].ok and "No cut of this trunk keeps the values" in got["pipe"].reason
