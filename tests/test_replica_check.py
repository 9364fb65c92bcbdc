"""The replica check (`ParallelStrategy(check_replicas_every=N)`, `lightning_par.callbacks.ReplicaCheck`).

- No false alarm, and no vacuous pass: under every layout the check runs after each step and compares exactly the
  pieces several ranks hold: every parameter under ZeRO-0/1 and cp (whole copies on both ranks), none under
  ZeRO-3 over 2 ranks (every rank holds other shards), the unsplit parameters under tp, the tied embedding's two
  copies under a pipeline (named differently on the two stages), everything but the expert shards under ep, every
  parameter at local SGD's synchronisation steps; on 4 ranks every shard of a Hugging Face Llama under ZeRO-3
  with 2 replicas x 2 shards (58 pieces for 29 parameters); as a plain callback under Lightning's ``ddp`` and
  under ``deepspeed_zero1``.
- A drifting copy is caught at the end of the step it drifted in, naming the parameter and the ranks: one rank of
  two adds 1e-3 to one element of a layer norm under ZeRO-0, of a tp-replicated norm under tp; on 4 ranks the
  odd rank is named against the three that agree (ZeRO-0), and a shard's drift names its ``dp_shard``
  coordinate (ZeRO-3, 2 x 2).
- Bad settings are refused when the strategy is built, naming the fix.

Spawns: one 2-rank and one 4-rank torchrun.
"""

from __future__ import annotations

from typing import Any

import pytest
from launch import run_jobs

import lightning_par

C = {"check_replicas_every": 1}
B: dict[str, Any] = {"steps": 3, "global_batch": 8}
NORM = "transformer.h.0.ln_1.weight"
GPT_PARAMS = 29  # tests/_job_models.py "gpt": 2 blocks of 12 tensors, 2 embeddings, the final norm's 2, the head
TWO: dict[str, dict[str, Any]] = {
    "zero0": {**B, "model": "gpt", "strategy": {"zero_stage": 0, **C}},
    "zero1": {**B, "model": "gpt", "strategy": {"zero_stage": 1, **C}},
    "zero3": {**B, "model": "gpt", "strategy": {"zero_stage": 3, **C}},
    "tp": {**B, "model": "gpt", "strategy": {"tp": 2, **C}, "dp": 1},
    "pipe_tied": {**B, "model": "gpt_quiet", "strategy": {"pp": 2, **C}, "dp": 1},
    "moe": {**B, "model": "moe_gpt", "strategy": {"ep": 2, "zero_stage": 1, **C}},
    "cp": {**B, "model": "gpt", "strategy": {"cp": 2, **C}, "dp": 1},
    "diloco": {**B, "steps": 4, "model": "gpt",
               "strategy": {"zero_stage": 0, "dp_replicate": 2, "sync_every": 2, "check_replicas_every": 2}},
    "lightning_ddp": {**B, "model": "gpt", "strategy": "ddp", "replica_callback": 1},  # the callback alone
    "deepspeed_zero1": {**B, "model": "gpt", "strategy": "deepspeed_zero1", "replica_callback": 1},
    "deepspeed_arg": {**B, "model": "gpt", "strategy": {"backend": "deepspeed", "zero_stage": 1, **C}},
    "zero0_drift": {**B, "model": "gpt", "strategy": {"zero_stage": 0, **C}, "expect_error": True,
                    "corrupt": {"step": 1, "rank": 1, "name": NORM}},
    "tp_drift": {**B, "model": "gpt", "strategy": {"tp": 2, **C}, "dp": 1, "expect_error": True,
                 "corrupt": {"step": 2, "rank": 1, "name": NORM}},
}  # fmt: skip
FOUR: dict[str, dict[str, Any]] = {
    "hsdp_hf_llama": {**B, "model": "hf_llama", "strategy": {"zero_stage": 3, "dp_replicate": 2, **C}},
    "zero0_drift": {**B, "model": "gpt", "strategy": {"zero_stage": 0, **C}, "expect_error": True,
                    "corrupt": {"step": 1, "rank": 2, "name": NORM}},
    "hsdp_drift": {**B, "model": "gpt", "strategy": {"zero_stage": 3, "dp_replicate": 2, **C}, "expect_error": True,
                   "corrupt": {"step": 2, "rank": 3, "name": "transformer.h.1.mlp.c_fc.weight"}},
}  # fmt: skip


@pytest.fixture(scope="module")
def got(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("replicas")
    out = dict(zip((f"2/{k}" for k in TWO), run_jobs(tmp, list(TWO.values()), nproc=2, timeout=600), strict=True))
    four = run_jobs(tmp, list(FOUR.values()), nproc=4, timeout=600)
    out.update(zip((f"4/{k}" for k in FOUR), four, strict=True))
    return out


def _checks(result: dict[str, Any]) -> list[tuple[int, int]]:
    """(checks run, pieces compared) on each rank: one ReplicaCheck per rank, the same verdict everywhere."""
    assert result.get("error") is None, result["error"]
    assert all(len(per_rank) == 1 for per_rank in result["replica_checks"]), result["replica_checks"]
    return [per_rank[0] for per_rank in result["replica_checks"]]


@pytest.mark.parametrize(
    ("name", "compared"),
    [("2/zero0", GPT_PARAMS), ("2/zero1", GPT_PARAMS), ("2/zero3", 0), ("2/tp", GPT_PARAMS - 12),
     ("2/pipe_tied", 1), ("2/moe", None), ("2/cp", GPT_PARAMS), ("4/hsdp_hf_llama", None),
     ("2/lightning_ddp", GPT_PARAMS), ("2/deepspeed_zero1", GPT_PARAMS), ("2/deepspeed_arg", GPT_PARAMS)],
)  # fmt: skip
def test_every_layout_compares_what_it_replicates(got: dict[str, Any], name: str, compared: int | None) -> None:
    checks = _checks(got[name])
    assert {runs for runs, _ in checks} == {B["steps"]}  # after every step, on every rank
    if name == "2/moe":  # every tensor but each layer's two expert shards (w1, w2)
        compared = len(got[name]["param_shapes"]) - 4
    if name == "4/hsdp_hf_llama":  # each shard held by its 2 replicas
        compared = 2 * len(got[name]["params"])
    assert {n for _, n in checks} == {compared}


def test_local_sgd_is_checked_at_its_synchronisations(got: dict[str, Any]) -> None:
    assert _checks(got["2/diloco"]) == [(2, GPT_PARAMS)] * 2  # steps 2 and 4, right after the outer step


@pytest.mark.parametrize(
    ("name", "step", "names"),
    [("2/zero0_drift", 2, f"{NORM}: rank(s) [0] vs rank(s) [1]"),
     ("2/tp_drift", 3, f"{NORM}: rank(s) [0] vs rank(s) [1]"),
     ("4/zero0_drift", 2, f"{NORM}: rank(s) [2] differ from rank(s) [0, 1, 3]"),
     ("4/hsdp_drift", 3, "transformer.h.1.mlp.c_fc.weight [dp_shard 1]: rank(s) [1] vs rank(s) [3]")],
)  # fmt: skip
def test_a_drifting_copy_stops_the_run_naming_it(got: dict[str, Any], name: str, step: int, names: str) -> None:
    error = got[name]["error"]
    assert error is not None and error.startswith("ReplicasDiverged"), error
    assert f"after optimizer step {step}: 1 parameter(s)" in error, error
    assert names in error, error
    # It stopped at the end of the step it drifted in, before the callbacks after it (the recorder) saw that step.
    assert len(got[name]["losses"]) == step - 1


def test_bad_settings_are_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match="positive int"):
        lightning_par.ParallelStrategy(check_replicas_every=0)
    with pytest.raises(ValueError, match="check_replicas_every=4"):
        lightning_par.ParallelStrategy(dp_replicate=2, sync_every=2, check_replicas_every=5)
    assert lightning_par.ParallelStrategy(dp_replicate=2, sync_every=2, check_replicas_every=4) is not None
