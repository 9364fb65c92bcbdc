"""The planner's per-rank state and communication (`lightning_par.planner.params`, `state`, `comm`).

Unit tier: the two sources of parameter lists agree on the Hugging Face classes, the conventions (precision, ZeRO
padding, optimizer state, pipeline stages, Megatron's 18 bytes per parameter) and the errors. Distributed tier: one
spawn of 4 CPU ranks trains every strategy family and checks, rank by rank, that the predicted parameter, gradient
and optimizer-state bytes and the bytes of every collective of a step equal what the strategies hold and send.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_par.planner.comm import comm_bytes, comm_terms
from lightning_par.planner.fp8 import mark_fp8
from lightning_par.planner.layout import SCHEDULES, Layout, LayoutError
from lightning_par.planner.model import from_hf_config
from lightning_par.planner.params import ParamSpec, specs_from_desc, specs_from_module
from lightning_par.planner.state import held, local_stages, stage_ranges, state_bytes

WORKER = Path(__file__).with_name("_plan_state_worker.py")

# Tiny configs with dims 4 ranks do not divide (vocab 250: ZeRO and FSDP2 padding shows), GQA (2 key/value heads).
LLAMA = dict(model_type="llama", vocab_size=250, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             attn_implementation="eager")  # fmt: skip
MIXTRAL = dict(LLAMA, model_type="mixtral", num_local_experts=4, num_experts_per_tok=2, output_router_logits=True,
               router_aux_loss_coef=0.1)  # fmt: skip
GPT2 = dict(model_type="gpt2", vocab_size=250, n_positions=66, n_embd=32, n_layer=4, n_head=4, resid_pdrop=0.0,
            embd_pdrop=0.0, attn_pdrop=0.0, attn_implementation="eager")  # fmt: skip
QWEN3 = dict(LLAMA, model_type="qwen3", head_dim=8, tie_word_embeddings=True)
# peft LoRA on the attention's q and v and the MLP's up and down projections: the base frozen.
LLAMA_LORA = dict(LLAMA, lora=dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))


def _meta(config: dict[str, Any]) -> torch.nn.Module:
    from _plan_state_worker import build

    with torch.device("meta"):
        return build(config)


def _desc_specs(config: dict[str, Any]) -> list[ParamSpec]:
    return specs_from_desc(from_hf_config(config))


# ---- unit tier -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("config", [LLAMA, MIXTRAL, GPT2, QWEN3], ids=["llama", "mixtral", "gpt2_tied", "qwen3_tied"])
def test_specs_from_desc_equal_specs_from_the_hugging_face_module(config: dict[str, Any]) -> None:
    from_module = specs_from_module(_meta(config))  # the suite's introspection, on the meta device
    from_desc = _desc_specs(config)
    assert {s.name: s for s in from_desc} == {s.name: s for s in from_module}
    assert sum(s.numel for s in from_desc) == from_hf_config(config).total_params


def _toy(rows: int = 10, outer: bool = True) -> list[ParamSpec]:
    """Two blocks of one [rows, 4] weight each, and an embedding [rows, 4] before the trunk."""
    specs = [ParamSpec(f"b.{i}.w", (rows, 4), block=i) for i in range(2)]
    return specs + ([ParamSpec("emb", (rows, 4), end="first", lookup=True)] if outer else [])


def test_zero_padding_rows_per_rank_and_optimizer_state() -> None:
    specs = _toy(rows=10)  # 3 tensors of 40 elements; 4 ranks: ceil(10/4) = 3 rows each, rank 3 holds 1 row
    for rank, rows in enumerate((3, 3, 3, 1)):
        z1 = state_bytes(specs, Layout(dp_shard=4, zero_stage=1, precision="32-true"), rank=rank, accumulation=2)
        assert z1.parameters == 3 * 40 * 4 and z1.gradients == 3 * 40 * 4  # full weights, full gradients
        # Without accumulation the step's backward reduce-scatters and frees them: the padded shard, as ZeRO-2.
        once = state_bytes(specs, Layout(dp_shard=4, zero_stage=1, precision="32-true"), rank=rank)
        assert once.gradients == 3 * 12 * 4
        assert z1.optimizer == 3 * (rows * 4 * 4 * 2 + 4)  # Adam's two moments of its rows, one fp32 step each
        z2 = state_bytes(specs, Layout(dp_shard=4, zero_stage=2, precision="32-true"), rank=rank)
        assert z2.gradients == 3 * 12 * 4  # the padded bucket shard, 3 rows on every rank
        z3 = state_bytes(specs, Layout(dp_shard=4, zero_stage=3, precision="bf16-true"), rank=rank, optimizer="sgd")
        assert (z3.parameters, z3.gradients) == (3 * 12 * 2, 3 * 12 * 2)  # FSDP2's padded shards, bf16
        assert z3.optimizer == 3 * rows * 4 * 2  # one momentum buffer of the real rows
    assert state_bytes(specs, Layout(dp_shard=4, zero_stage=1, precision="32-true")).optimizer == 3 * (96 + 4)
    mixed = state_bytes(specs, Layout(dp_shard=2, zero_stage=0, precision="bf16-mixed"))
    assert mixed == state_bytes(specs, Layout(dp_shard=2, zero_stage=0, precision="32-true"))  # no second copy


def test_megatron_counts_18_bytes_per_parameter_and_shards_12_with_the_distributed_optimizer() -> None:
    desc = from_hf_config(dict(LLAMA, hidden_size=64, intermediate_size=96, vocab_size=256, num_hidden_layers=4))
    specs, n = specs_from_desc(desc), desc.total_params
    plain = state_bytes(specs, Layout(dp_shard=8, precision="bf16-mixed"), framework="megatron")
    assert (plain.parameters, plain.gradients, plain.optimizer) == (2 * n, 4 * n, 12 * n) and plain.total == 18 * n
    dist_opt = state_bytes(specs, Layout(dp_shard=8, zero_stage=1, precision="bf16-mixed"), framework="megatron")
    assert dist_opt.optimizer == 12 * math.ceil(n / 8) and dist_opt.parameters == 2 * n
    fp32 = state_bytes(specs, Layout(dp_shard=2, precision="32-true"), framework="megatron")
    assert fp32.total == 16 * n
    # tp x pp: the ranks of one data-parallel replica together hold each parameter once (the ends split by the
    # vocabulary), except the norms, whole on both tp ranks.
    layout = Layout(tp=2, pp=2, dp_shard=2, precision="bf16-mixed")
    per_replica = sum(state_bytes(specs, layout, rank=r, framework="megatron").parameters for r in (0, 1, 4, 5))
    assert per_replica == 2 * (n + sum(s.numel for s in specs if len(s.shape) == 1))


def test_pipeline_stages_follow_the_suite() -> None:
    from lightning_par.parallel.pipeline.schedule import SCHEDULES as SUITE
    from lightning_par.parallel.pipeline.schedule import local_stages as suite_stages

    for schedule in SCHEDULES:
        for pp in (2, 4):
            layout = Layout(pp=pp, pp_schedule=schedule, vpp=SUITE[schedule].virtual)
            assert [local_stages(layout, r) for r in range(pp)] == [suite_stages(schedule, pp, r) for r in range(pp)]
    specs = _desc_specs(dict(LLAMA, num_hidden_layers=4))
    ranges = stage_ranges(specs, Layout(pp=2))
    assert ranges[0][0] == 0 and ranges[-1][1] == 4
    first = {t.spec.name for t in held(specs, Layout(pp=2), pp_rank=0)}
    last = {t.spec.name for t in held(specs, Layout(pp=2), pp_rank=1)}
    assert "model.embed_tokens.weight" in first - last and {"model.norm.weight", "lm_head.weight"} <= last - first
    tied = _desc_specs(dict(GPT2))
    assert all("transformer.wte.weight" in {t.spec.name for t in held(tied, Layout(pp=2), r)} for r in (0, 1))


def test_experts_divide_over_ep_and_stay_out_of_zero() -> None:
    specs = _desc_specs(MIXTRAL)
    layout = Layout(dp_shard=4, ep=2, zero_stage=3, precision="32-true")
    experts = [t for t in held(specs, layout) if t.spec.expert_axis is not None]
    assert experts and all(t.shape[0] == 2 and not t.in_zero for t in experts)  # 4 experts over ep=2
    assert all(t.in_zero for t in held(specs, Layout(dp_shard=4, zero_stage=3)))  # ep=1: ZeRO shards them too


def test_zero_traffic_is_the_papers_when_nothing_pads() -> None:
    specs = _toy(rows=8, outer=False)  # only blocks: FSDP2 re-gathers all of it for backward
    psi, n = 2 * 8 * 4 * 4, 4
    for stage, factor in ((0, 2), (1, 2), (2, 2), (3, 3)):
        got = comm_bytes(specs, Layout(dp_shard=n, zero_stage=stage, precision="32-true"), 4, 8, 4)
        assert sum(got.values()) == pytest.approx(factor * psi * (n - 1) / n)
    tp = comm_terms(specs, Layout(tp=2, precision="32-true"), 2, 8, hidden=4)
    assert tp == []  # no row-parallel projection, nothing tp reduces


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_a_0_dim_parameter_is_whole_on_every_rank_under_every_zero_stage(zero: int) -> None:
    # lightning_par.parallel.zero.scalars: not sharded (a 4-byte value), its gradient averaged apart.
    specs = [ParamSpec("w", (8, 4), block=0), ParamSpec("s", (), block=0)]
    layout = Layout(dp_shard=4, zero_stage=zero, precision="32-true")
    both = state_bytes(specs, layout, optimizer="sgd")
    alone = state_bytes(specs[:1], layout, optimizer="sgd")
    assert (both.parameters - alone.parameters, both.gradients - alone.gradients) == (4, 4)
    assert both.optimizer - alone.optimizer == 4  # its momentum, whole
    traffic = {t[0]: t[2] for t in comm_terms(specs, layout, 8, 4, 4)}
    assert traffic["scalars"] == 2 * 8 * 3 / 4  # its value and a flag, fp32, a ring all-reduce over 4 ranks


@pytest.mark.parametrize(("precision", "zero"), [("bf16-mixed", 0), ("bf16-mixed", 1), ("bf16-true", 1)])
def test_2bw_keeps_one_more_weight_version_and_gradient_buffer_per_stage(precision: str, zero: int) -> None:
    # PipeDream-2BW (arXiv 2006.09503): each rank holds, besides what 1F1B holds, its stage's trainable weights once
    # more (not the last stage) and one more gradient buffer. A frozen embedding (no gradient, never updated) has
    # no second version.
    specs = [dataclasses.replace(s, trainable=False) if s.name == "model.embed_tokens.weight" else s
             for s in _desc_specs(dict(LLAMA, num_hidden_layers=4))]  # fmt: skip
    kw = dict(pp=2, dp_shard=2, zero_stage=zero, microbatches=4, precision=precision)
    one_f_one_b, two_bw = Layout(pp_schedule="1f1b", **kw), Layout(pp_schedule="2bw", **kw)
    per_element = {"bf16-mixed": 4, "bf16-true": 2}[precision]  # stored parameter = gradient dtype (fp32 masters)
    for rank in range(two_bw.world):
        pp_rank = rank // 2
        trainable = sum(t.numel for t in held(specs, two_bw, pp_rank) if t.spec.trainable)
        assert 0 < trainable < sum(s.numel for s in specs)  # a stage's share, without the frozen embedding
        base, double = state_bytes(specs, one_f_one_b, rank=rank), state_bytes(specs, two_bw, rank=rank)
        # weights + gradients; the last stage ends its micro-batches within the step: no second weight version
        versions = 2 if pp_rank < two_bw.pp - 1 else 1
        assert double.total - base.total == double.double_buffer == versions * trainable * per_element
        assert (double.parameters, double.gradients, double.optimizer) == (
            base.parameters, base.gradients, base.optimizer)  # fmt: skip
    # Megatron's convention: a 2-byte weight version and a 4-byte fp32 main gradient per parameter (stage 0).
    mega = [state_bytes(specs, Layout(pp_schedule=s, **dict(kw, zero_stage=0, precision="bf16-mixed")), rank=0,
                        framework="megatron") for s in ("1f1b", "2bw")]  # fmt: skip
    assert mega[1].total - mega[0].total == 6 * sum(t.numel for t in held(specs, two_bw, 0, "megatron"))
    # Without a pipeline there is no 2bw (the suite refuses it too).
    with pytest.raises(LayoutError, match=r"pp_schedule='2bw' is a pipeline schedule .*set pp >= 2"):
        Layout(pp_schedule="2bw", dp_shard=2)


def test_2bw_is_a_named_line_of_the_estimate(tmp_path: Path) -> None:
    from lightning_par import cli_plan
    from lightning_par.planner import device
    from lightning_par.planner.devices import GIB
    from lightning_par.planner.estimate import estimate

    config = dict(LLAMA, num_hidden_layers=4)
    desc, specs = from_hf_config(config), _desc_specs(config)
    est = {s: estimate(desc, Layout(pp=2, dp_shard=2, pp_schedule=s, microbatches=4), device("H100"), 8, 64)
           for s in ("1f1b", "2bw")}  # fmt: skip
    # The rank holding the most (stage 0 here): its trainable weights and gradients once more, fp32 under bf16-mixed.
    stage = sum(t.numel for t in held(specs, est["2bw"].layout, 0) if t.spec.trainable)
    assert state_bytes(specs, est["2bw"].layout).double_buffer == 2 * 4 * stage  # the heaviest rank is stage 0's
    assert est["2bw"].double_buffer == 2 * 4 * stage and est["1f1b"].double_buffer == 0
    assert est["2bw"].total - est["1f1b"].total == est["2bw"].double_buffer
    assert est["2bw"].activations == est["1f1b"].activations  # 1F1B's in-flight micro-batches (p - r)
    assert est["2bw"].time.total < est["1f1b"].time.total  # no flush
    # `lightning-par estimate --schedule 2bw` shows the line (JSON and text); other schedules do not in the text.
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    args = ["--model-config", str(path), "--gpu", "H100", "--pp", "2", "--dp", "2", "--global-batch-size", "8",
            "--seq-len", "64"]  # fmt: skip
    got = json.loads(cli_plan.run_estimate([*args, "--schedule", "2bw", "--json"]))
    assert got["memory_gib"]["double_buffer"] == pytest.approx(2 * 4 * stage / GIB)
    assert got["strategy"]["pp_schedule"] == "2bw"
    assert "double_buffer" in cli_plan.run_estimate([*args, "--schedule", "2bw"])
    assert "double_buffer" not in cli_plan.run_estimate(args)
    # Refused where the suite refuses it: fewer micro-batches than stages, no pipeline, tensor parallelism.
    with pytest.raises(LayoutError, match="microbatches=2 < pp=4"):
        Layout(pp=4, pp_schedule="2bw", microbatches=2).check(desc, 4, 2, 64)
    with pytest.raises(LayoutError, match="pp_schedule='2bw' is a pipeline schedule"):
        cli_plan.run_estimate([*args[:4], *args[6:], "--schedule", "2bw"])  # no --pp
    with pytest.raises(LayoutError, match="pp_schedule='2bw' with tp=2"):
        Layout(pp=2, tp=2, pp_schedule="2bw", microbatches=4).check(desc, 4, 4, 64)


def test_errors_name_the_fix() -> None:
    specs = _toy()
    with pytest.raises(ValueError, match="optimizer='lion' is not modelled; choose one of"):
        state_bytes(specs, Layout(), optimizer="lion")
    with pytest.raises(ValueError, match="framework='deepspeed' is unknown"):
        state_bytes(specs, Layout(), framework="deepspeed")
    with pytest.raises(ValueError, match="bf16-true has no Megatron counterpart"):
        state_bytes(specs, Layout(precision="bf16-true"), framework="megatron")
    with pytest.raises(ValueError, match=r"no zero_stage=3: 0 .* or 1"):
        state_bytes(specs, Layout(dp_shard=2, zero_stage=3), framework="megatron")
    with pytest.raises(LayoutError, match="tp=3 does not divide dim 0"):
        state_bytes([ParamSpec("w", (10, 4), tp_dim=0, block=0)], Layout(tp=3))
    with pytest.raises(ValueError, match="give exactly one of block="):
        ParamSpec("w", (4,), block=0, end="first")
    with pytest.raises(LayoutError, match="set vpp=2, or use a looped interleaved schedule"):
        state_bytes(_toy(), Layout(pp=2, vpp=3, pp_schedule="zbv"))
    with pytest.raises(LayoutError, match=r"2 blocks cannot fill 6 pipeline stages; lower pp \(or vpp\)"):
        state_bytes(_toy(), Layout(pp=2, vpp=3, pp_schedule="interleaved_1f1b"))
    with pytest.raises(LayoutError, match="context parallelism"):
        comm_bytes(specs, Layout(cp=2), 2, 8, 4)


# ---- distributed tier: against the strategies, measured ------------------------------------------------------------
BATCH, SEQ = 2, 16  # samples per data-parallel rank, tokens per sample
_ONE = dict(micro_batch_size=BATCH)  # no accumulation: the rank's batch in one micro-batch
# name -> (config, layout, optimizer, the model's own loss with its routers' aux term)
FAMILIES: dict[str, tuple[dict[str, Any], Layout, str, bool]] = {
    "zero1": (LLAMA, Layout(dp_shard=4, zero_stage=1, precision="32-true", **_ONE), "adamw", False),
    "zero2": (LLAMA, Layout(dp_shard=4, zero_stage=2, precision="bf16-true", **_ONE), "adamw", False),
    "zero3": (LLAMA, Layout(dp_shard=4, zero_stage=3, precision="bf16-mixed", **_ONE), "sgd", False),
    # GPT-2's Conv1D projections and fused [q | k | v], over two replicas (DDP's all-reduce across dp_replicate).
    "tp_gpt2": (GPT2, Layout(tp=2, dp_replicate=2, dp_shard=1, zero_stage=0, precision="32-true", **_ONE), "adamw",
                False),
    "tp_zero1_sp": (LLAMA, Layout(tp=2, dp_shard=2, zero_stage=1, sequence_parallel=True, precision="bf16-mixed",
                                  **_ONE), "adamw", False),
    "tp_zero3_sp": (LLAMA, Layout(tp=2, dp_shard=2, zero_stage=3, sequence_parallel=True, precision="bf16-mixed",
                                  **_ONE), "adamw", False),
    "pipe_zero1": (dict(LLAMA, num_hidden_layers=4), Layout(pp=2, dp_shard=2, zero_stage=1, microbatches=2,
                                                            precision="32-true"), "adamw", False),
    "pipe_zero3_tied_gpt2": (GPT2, Layout(pp=2, dp_shard=2, zero_stage=3, microbatches=2, precision="bf16-mixed"),
                             "adamw", False),
    "moe_zero1": (MIXTRAL, Layout(dp_shard=4, ep=2, zero_stage=1, precision="32-true", **_ONE), "adamw", True),
    "moe_zero3": (MIXTRAL, Layout(dp_shard=4, ep=4, zero_stage=3, precision="bf16-mixed", **_ONE), "adamw", False),
    # PowerSGD at rank 2: the P, Q and uncompressed all-reduce, the error and factors each rank keeps.
    "zero1_powersgd": (LLAMA, Layout(dp_shard=4, zero_stage=1, powersgd_rank=2, precision="32-true", **_ONE), "adamw",
                       False),
    # ZeRO-3's weights gathered as int8 codes with a scale per 256 elements, in units of a Llama and of GPT-2's stages.
    "zero3_int8_gather": (LLAMA, Layout(dp_shard=4, zero_stage=3, zero_quantized_weights=True, precision="bf16-mixed",
                                        **_ONE), "adamw", False),
    "pipe_zero3_int8_gather_gpt2": (GPT2, Layout(pp=2, dp_shard=2, zero_stage=3, microbatches=2,
                                                 zero_quantized_weights=True, precision="32-true"), "adamw", False),
    # ... over hybrid sharding's 2 replicas of 2 ZeRO-1 ranks (the mean over all 4, the gather inside a replica) ...
    "hybrid_zero1_powersgd": (LLAMA, Layout(dp_replicate=2, dp_shard=2, zero_stage=1, powersgd_rank=2,
                                            precision="32-true", **_ONE), "adamw", False),
    # ... and under a pipeline: GPT-2's tied embedding, a copy on each end stage, is averaged exactly.
    "pipe_zero1_powersgd_tied_gpt2": (GPT2, Layout(pp=2, dp_shard=2, zero_stage=1, microbatches=2, powersgd_rank=2,
                                                   precision="32-true"), "adamw", False),
    # Sequence parallelism inside pipeline stages: each stage's regions, the trunk's ends on the end stages.
    "pipe_tp_sp": (dict(LLAMA, num_hidden_layers=4), Layout(pp=2, tp=2, dp_shard=1, zero_stage=0, microbatches=2,
                                                            sequence_parallel=True, precision="32-true"),
                   "adamw", False),
    # Interleaved 1F1B with 3 stages per rank (vpp): each rank holds the blocks of its 3 stages.
    "pipe_zero1_vpp3": (dict(LLAMA, num_hidden_layers=6), Layout(pp=2, vpp=3, dp_shard=2, zero_stage=1, microbatches=2,
                                                                 pp_schedule="interleaved_1f1b", precision="32-true"),
                        "adamw", False),
    # LoRA: the frozen base gathered by ZeRO-3 but never reduced; only the adapters' gradients travel (and under tp
    # each adapter follows its base's split: lora_A's gradient summed over tp for a column-split base).
    "zero1_lora": (LLAMA_LORA, Layout(dp_shard=4, zero_stage=1, precision="32-true", **_ONE), "adamw", False),
    "zero3_lora": (LLAMA_LORA, Layout(dp_shard=4, zero_stage=3, precision="bf16-mixed", **_ONE), "adamw", False),
    "tp_zero1_lora_sp": (LLAMA_LORA, Layout(tp=2, dp_shard=2, zero_stage=1, sequence_parallel=True,
                                            precision="32-true", **_ONE), "adamw", False),
    # fp8: the projections' weights gathered at one byte each, the scales all-reduced before every forward.
    "zero3_fp8": (LLAMA, Layout(dp_shard=4, zero_stage=3, fp8=True, precision="bf16-mixed", **_ONE), "adamw", False),
    "pipe_zero3_fp8": (dict(LLAMA, num_hidden_layers=4), Layout(pp=2, dp_shard=2, zero_stage=3, microbatches=2,
                                                                fp8=True, precision="32-true"), "adamw", False),
    # ... and under sequence parallelism each region's input gathered at one byte a value, after its amax's all-reduce.
    "tp_zero1_sp_fp8": (LLAMA, Layout(tp=2, dp_shard=2, zero_stage=1, sequence_parallel=True, fp8=True,
                                      precision="32-true", **_ONE), "adamw", False),
}  # fmt: skip
# Jobs measured past their first steps: PowerSGD compresses from its third (compression_start=2), and holds its
# error from then on, so its fourth is the steady state the planner prices.
LATER: dict[str, dict[str, Any]] = {name: {"measured": 3, "strategy": {"compression_start": 2}}
                                     for name in ("zero1_powersgd", "hybrid_zero1_powersgd",
                                                  "pipe_zero1_powersgd_tied_gpt2")}  # fmt: skip


def _spawn(tmp: Path, nproc: int = 4) -> list[list[dict[str, Any]]]:
    from launch import run_forked

    jobs = []
    for name, (c, layout, opt, aux) in FAMILIES.items():
        later = LATER.get(name, {})
        emulated = {"fp8": "emulate"} if layout.fp8 else {}  # a CPU has no fp8 matmul: the same casts, emulated
        jobs.append(dict(config=c, strategy={**layout.strategy_kwargs(), **later.get("strategy", {}), **emulated},
                         precision=layout.precision, optimizer=opt, aux=aux, batch=BATCH, seq=SEQ,
                         measured=later.get("measured", 1)))  # fmt: skip
    out = tmp / "measured.pt"
    spec = tmp / "spec.json"
    spec.write_text(json.dumps({"out": str(out), "jobs": jobs}))
    proc = run_forked(WORKER, [str(spec)], nproc, timeout=240, cwd=tmp)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-9000:]
    return torch.load(out, weights_only=False)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_predicted_state_and_traffic_equal_the_strategies_on_4_ranks(tmp_path: Path) -> None:
    measured = _spawn(tmp_path)
    failures = []
    for (name, (config, layout, opt, aux)), ranks in zip(FAMILIES.items(), measured, strict=True):
        hidden = config.get("hidden_size") or config["n_embd"]
        meta = _meta(config)
        sources = {"module": specs_from_module(meta)}
        if "lora" not in config:  # a config.json describes no adapters
            sources["desc"] = _desc_specs(config)
        if layout.fp8:  # which weights are fp8: the strategies' rule on the module, the specs' rule on the desc
            sources = {k: mark_fp8(v, meta if k == "module" else None, layout.tp) for k, v in sources.items()}
            assert all(sum(s.fp8 for s in v) == 7 * config["num_hidden_layers"] for v in sources.values())
        for source, specs in sources.items():
            for rank, got in enumerate(ranks):
                want = state_bytes(specs, layout, rank=rank, optimizer=opt)
                have = (got["parameters"], got["gradients"], got["optimizer"])
                if (want.parameters, want.gradients, want.optimizer) != have:
                    failures.append(f"{name} ({source}) rank {rank}: predicted {want}, measured {have}")
                traffic = comm_bytes(specs, layout, BATCH * layout.dp, SEQ, hidden, rank=rank, router_aux=aux)
                counted = {k: v for k, v in got["comm"].items() if k not in ("all_to_all", "object")}
                if traffic.keys() != counted.keys() or any(abs(traffic[k] - counted[k]) > 1e-6 for k in counted):
                    failures.append(f"{name} ({source}) rank {rank}: predicted {traffic}, counted {counted}")
        # The expert all-to-alls depend on the routing; the pipeline's object broadcasts are control data.
        assert all(set(r["comm"]) <= {"all_reduce", "reduce_scatter", "all_gather", "all_to_all", "object"}
                   for r in ranks), (name, ranks[0]["comm"])  # fmt: skip
    assert not failures, "\n".join(failures)
