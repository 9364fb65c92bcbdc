"""MoE load-balancing losses under pipeline parallelism: Hugging Face MoE models with ``output_router_logits=True``
(tests/_families_moe.py) compute their aux loss after the trunk from every layer's router logits, which the stages
carry down the pipeline with the hidden state and replay through the router modules on the stages that do not run
them (lightning_par/parallel/pipeline/sides.py).

Each microbatch's load-balancing loss is computed from its own router logits, as under gradient accumulation in one
process, and the loss is not linear in the tokens (a product of means): so a pipeline with m microbatches of its
batch B is compared with one process that accumulates m batches of B/m (the same samples, in the same order),
validation included (2 batches of B against 2m of B/m). fp32 losses and gradient norms to 1e-5 relative, SGD
parameters to 1e-5 relative / 1e-7 absolute (tests/test_pipeline_families.py); bf16-mixed against a bf16-mixed
reference to 1e-4 (measured: losses <= 9e-8 relative, parameters <= 1.2e-7 absolute). The aux term is checked to
count: the same model without it trains differently. Checked by hand: with the replay off, or the received logits
detached, the one-process chain and the jobs tried (1f1b, interleaved, zbv) fail (losses off by 9e-4 to 9e-3).
Under pp 2 x cp 2 (``mixtral_pipe_cp``) the logits carried are those gathered over cp (moe_router_stats); measured
losses 8.6e-8 relative; checked by hand that it fails with the gather off (each cp rank's aux from its own chunk:
losses 5.1e-5, gradient norms 3.5e-4 off, 33 of 39 parameter tensors) and with the received logits detached (4.5e-4,
6.8e-3, all 39).
Two spawns (2 and 4 ranks) and one reference process.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel

from lightning_par.blocks.trunk import find_trunk
from lightning_par.parallel.pipeline.owners import PipelineError, find_ownership

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# 2 ranks, pp 2 (dp 1).
JOBS_2: dict[str, dict[str, Any]] = {
    "qwen2_gpipe": {"model": "hf_qwen2_moe", "strategy": {"pp": 2, "pp_schedule": "gpipe", "microbatches": 2},
                    "validate": True},
    "qwen2_1f1b": {"model": "hf_qwen2_moe", "strategy": {"pp": 2}},  # 4 microbatches
    # Two stages per rank: router logits cross ranks twice, and pass through a rank's own pass-through block.
    "qwen3_interleaved": {"model": "hf_qwen3_moe_4", "strategy": {"pp": 2, "pp_schedule": "interleaved_1f1b"}},
    "qwen2_zb": {"model": "hf_qwen2_moe_4", "strategy": {"pp": 2, "pp_schedule": "interleaved_zb"}},
    # V: rank 0 runs stages 0 and 3, replaying its own blocks' routers on stage 3 (and validating forward only).
    "olmoe_zbv": {"model": "hf_olmoe_4", "strategy": {"pp": 2, "pp_schedule": "zbv"}, "validate": True},
    "gpt_oss_gpipe": {"model": "hf_gpt_oss", "strategy": {"pp": 2, "pp_schedule": "gpipe"}},
    # Checkpointed blocks: the recomputation in backward must not capture the logits again.
    "qwen2_ac_full": {"model": "hf_qwen2_moe", "strategy": {"pp": 2, "activation_checkpointing": "full"}},
    # bf16 router logits on the wire.
    "qwen2_bf16_mixed": {"model": "hf_qwen2_moe", "strategy": {"pp": 2}, "precision": "bf16-mixed"},
}  # fmt: skip

# 4 ranks: pp 4 (four blocks), pp 2 x tp 2 (attention split, the MoE layer whole on each tp rank), pp 2 x dp 2 and
# pp 2 x cp 2.
JOBS_4: dict[str, dict[str, Any]] = {
    "qwen2_pp4": {"model": "hf_qwen2_moe_4", "strategy": {"pp": 4, "microbatches": 4}, "dp": 1, "validate": True},
    "qwen2_pipe_tp": {"model": "hf_qwen2_moe", "strategy": {"pp": 2, "tp": 2}, "dp": 1},
    # Qwen3-MoE: per-head q/k norms split with the heads (their gradients summed over tp) on pipeline stages.
    "qwen3_pp4": {"model": "hf_qwen3_moe_4", "strategy": {"pp": 4, "microbatches": 4}, "dp": 1},
    "qwen3_pipe_tp": {"model": "hf_qwen3_moe", "strategy": {"pp": 2, "tp": 2}, "dp": 1},
    # pp 2 x dp 2 under ZeRO-3: each stage module is an FSDP2 root, also when the side outputs are measured.
    "qwen2_pipe_zero3": {"model": "hf_qwen2_moe", "strategy": {"pp": 2, "zero_stage": 3}, "dp": 2},
    # pp 2 x cp 2 (Mixtral on SDPA): the routers' logits are gathered over cp before they are carried, so each
    # microbatch's loss sees all its tokens; two stages per rank, and 29 tokens (cp ranks route 15 and 14 per sample).
    # Validation too: there the gather spans cp only (without it val_loss was 1.8e-5 relative off, measured).
    "mixtral_pipe_cp": {"model": "hf_mixtral_sdpa_aux_4", "seq_len": 29, "dp": 1, "validate": True,
                        "strategy": {"pp": 2, "cp": 2, "cp_uneven": True, "pp_schedule": "interleaved_1f1b"}},
}  # fmt: skip

ALL = {**JOBS_2, **JOBS_4}


def _microbatches(job: dict[str, Any]) -> int:
    strategy = job["strategy"]
    return strategy.get("microbatches") or 2 * strategy["pp"]


def _reference(name: str, job: dict[str, Any]) -> dict[str, Any]:
    ref = reference_job({k: v for k, v in job.items() if k not in ("strategy", "dp")})
    m = _microbatches(job)
    # m microbatches of the pipeline's batch = m accumulated batches of one process, in the same order; validation
    # too: 2 batches of B through the pipeline are 2m batches of B/m (validation batches are not shuffled). Over dp
    # ranks too: the routers' logits are gathered over dp (moe_router_stats), so microbatch i of every dp rank
    # together is batch i of B/m (rank r holds samples r, r + dp, ... of the global batch).
    return {**ref, "global_batch": 8 // m, "accumulate": m, "limit_val_batches": 2 * m}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, dict]]:
    tmp = tmp_path_factory.mktemp("pipeline_aux")
    noaux = _reference("qwen2_1f1b", {**ALL["qwen2_1f1b"], "model": "hf_qwen2_moe_noaux"})
    refs = run_jobs(tmp, [_reference(n, j) for n, j in ALL.items()] + [noaux], nproc=1, timeout=900)
    got = run_jobs(tmp, [{**j, "dp": 1} for j in JOBS_2.values()], nproc=2, timeout=900)
    got += run_jobs(tmp, list(JOBS_4.values()), nproc=4, timeout=900)
    out = dict(zip(ALL, zip(got, refs[: len(ALL)], strict=True), strict=True))
    out["noaux"] = (refs[-1], refs[-1])
    return out


def _step_means(losses: list[float], m: int) -> list[float]:
    return [sum(losses[i : i + m]) / m for i in range(0, len(losses), m)]


@pytest.mark.parametrize("name", list(ALL))
def test_aux_loss_matches_one_process(results, name):
    got, ref = results[name]
    job = ALL[name]
    m = _microbatches(job)
    want = _step_means(ref["losses"], m)  # the pipeline logs the mean over its microbatches
    assert len(got["losses"]) == len(want) >= 3
    # bf16-mixed against bf16-mixed: the same microbatch shapes, so the same kernels (measured 2.5e-8).
    tol = 1e-4 if job.get("precision") == "bf16-mixed" else 1e-5
    assert rel(got["losses"], want) < tol
    assert rel(got["grad_norms"], ref["grad_norms"]) < tol
    params_close(got["params"], ref["params"], rtol=tol, atol=1e-7)
    if job.get("validate"):
        assert abs(got["val"]["val_loss"] - ref["val"]["val_loss"]) <= 1e-5 * abs(ref["val"]["val_loss"])


def test_the_aux_term_is_in_the_loss(results):
    # Without output_router_logits the same model, seed and data train otherwise: the parity above is not vacuous.
    (noaux, _), (got, ref) = results["noaux"], results["qwen2_1f1b"]
    assert rel(noaux["losses"], ref["losses"]) > 1e-4 and rel(got["losses"], _step_means(noaux["losses"], 4)) > 1e-4


def _hf_qwen2_moe(**config: Any) -> torch.nn.Module:
    from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

    tiny = dict(vocab_size=64, hidden_size=16, intermediate_size=24, moe_intermediate_size=8, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=1, num_experts=4, num_experts_per_tok=2,
                shared_expert_intermediate_size=16, attn_implementation="eager")  # fmt: skip
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(**{**tiny, **config}))


class _Collecting(torch.nn.Module):
    """A trunk whose blocks' outputs (``blocks``) or values computed between blocks (``between``) are read after it."""

    def __init__(self, read: str) -> None:
        super().__init__()
        self.read = read
        self.emb = torch.nn.Embedding(16, 8)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        self.head = torch.nn.Linear(8, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        h, kept = self.emb(idx), []
        for block in self.blocks:
            h = block(h)
            kept.append(h if self.read == "blocks" else h.square().mean())
        return self.head(h) + sum(k.mean() for k in kept[:-1])


def test_router_logits_are_carried_and_other_side_outputs_rule_out_the_cuts_before_their_reader():
    model = _hf_qwen2_moe(output_router_logits=True)
    trunk = find_trunk(model)
    assert trunk is not None
    sides = find_ownership(model, trunk).sides
    # Index 0 of each router's output, layer by layer: what transformers' OutputRecorder records.
    assert [(s.name, s.leaf) for s in sides] == [(f"model.layers.{i}.mlp.gate", 0) for i in range(2)]
    plain = _hf_qwen2_moe(output_router_logits=False)
    assert find_ownership(plain, find_trunk(plain)).sides == ()
    # Every block's output (not a submodule's), or a value the forward computes between blocks: not carried, so
    # every cut before the reader is ruled out (tests/test_pipeline_units.py has the rule on its own).
    for read, what in (
        (
            "blocks",
            r"the code after the trunk reads, in mean\(\), a value blocks\.0 computed, which a stage starting "
            r"at blocks\.1 does not have",
        ),
        ("between", r"the code between blocks\.0 and blocks\.1 reads, in square\(\), a value blocks\.0 computed"),
    ):
        model = _Collecting(read)
        own = find_ownership(model, find_trunk(model))
        assert own.sides == () and sorted(own.cut_conflicts) == [1, 2]
        assert re.match(what, own.cut_conflicts[1]), own.cut_conflicts[1]


def test_stages_in_one_process_carry_replay_and_backpropagate_the_router_logits():
    # Each stage its own cut copy (as on its own rank), chained by hand: the loss, every layer's recorded logits (in
    # order) and every gradient are the whole model's; the middle stage passes block 0's logits on.
    import copy

    from lightning_par.parallel.pipeline.stages import PipelineModel

    torch.manual_seed(0)
    full = _hf_qwen2_moe(output_router_logits=True, num_hidden_layers=4, router_aux_loss_coef=0.1)
    idx = torch.randint(0, 64, (2, 8))
    ref = full(input_ids=idx, labels=idx)
    ref.loss.backward()
    ranges = [(0, 1), (1, 3), (3, 4)]
    cuts = [copy.deepcopy(full) for _ in ranges]
    pipes = [PipelineModel(m, find_trunk(m), ranges, [s], torch.device("cpu")) for s, m in enumerate(cuts)]
    seen: list[Any] = []

    def step(m: torch.nn.Module) -> torch.Tensor:
        out = m(input_ids=idx, labels=idx)
        seen.append(out.router_logits)
        return out.loss

    carry: tuple = ()
    for pipe, m in zip(pipes, cuts, strict=True):
        m.zero_grad(set_to_none=True)
        pipe.install()
        pipe.begin_step(lambda _mb, _spec, m=m: step(m))
        out = pipe.run_stage(pipe.specs[0], carry[0] if carry else None, 0, carry[1:])
        carry = out if isinstance(out, tuple) else (out,)
        assert len(carry) == (1 if pipe.specs[0].is_last else 1 + pipe.specs[0].end)  # hidden + each block's logits
    torch.testing.assert_close(carry[0], ref.loss, rtol=1e-6, atol=0)
    assert len(seen[0]) == 4 and all(torch.equal(a, b) for a, b in zip(seen[0], ref.router_logits, strict=True))
    carry[0].backward()
    got = {n: p.grad for m in cuts for n, p in m.named_parameters()}
    assert got.keys() == {n for n, _ in full.named_parameters()}
    for n, p in full.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=lambda msg, n=n: f"{n}: {msg}")
    # A microbatch whose side output has another shape than the one measured is refused, naming the router.
    pipes[0].sides.meta = {0: ((1, 4), torch.float32)}  # type: ignore[union-attr]
    with pytest.raises(PipelineError, match=r"model\.layers\.0\.mlp\.gate returned a side output of shape \(16, 4\)"):
        pipes[0].run_stage(pipes[0].specs[0], None, 0)
