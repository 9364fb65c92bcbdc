"""The family x strategy matrix where the per-technique files leave gaps, against one process.

tests/test_tp_families.py, tests/test_pipeline_families.py and tests/test_moe_parallel.py test each technique on the
families that stress it (Conv1D, fused grouped qkv, head registered first, tied weights, MoE structures). This file
trains every family under ``zero3`` on 2 ranks, the dense families under ``tp`` and ``pipe`` where those files do
not, the MoE families without an aux loss under ``pipe`` (stages cut between MoE blocks), and on 4 ranks every
dense family under ``pipe_tp`` (pp 2 x tp 2) and the four-block ones under pp 4. docs/compatibility.md links each
cell of its table to the test that proves it. Tolerances as everywhere: fp32 losses and gradient norms 1e-5
relative, SGD + momentum parameters 1e-5 relative / 1e-7 absolute (every family but ``hf_llama``, whose AdamW gets
1% of its learning rate absolute, docs/testing.md says why).
"""

from __future__ import annotations

from typing import Any

import pytest
from conftest import reference_job
from launch import run_jobs
from parity import params_close, rel, without_tied_copies

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

DENSE = ("hf_llama", "litgpt_pythia", "litgpt_llama", "hf_gpt2", "hf_qwen2_tied", "hf_bert", "hf_vit")
MOE = ("hf_mixtral", "hf_qwen2_moe", "hf_qwen3_moe", "hf_olmoe", "hf_deepseek_v3", "hf_gpt_oss", "user_moe_list")

JOBS_2: dict[str, dict[str, Any]] = {
    **{f"{m}_zero3": {"model": m, "strategy": "zero3"} for m in (*DENSE, *MOE, "xt_decoder")},
    # tp and pipe ranks share one batch: dp 1.
    **{f"{m}_tp": {"model": m, "strategy": {"tp": 2}, "dp": 1} for m in ("litgpt_pythia", "hf_qwen2_tied")},
    **{f"{m}_pipe": {"model": m, "strategy": {"pp": 2}, "dp": 1} for m in ("hf_llama", "hf_bert")},
    # MoE families under tp: attention split, the MoE layer kept whole on every tp rank (sequence parallelism off).
    **{f"{m}_tp": {"model": m, "strategy": {"tp": 2}, "dp": 1} for m in ("hf_mixtral", "hf_qwen2_moe")},
    # DBRX (experts stored flat): its fused, clipped Wqkv split; with its aux loss too (every tp rank holds the same
    # tokens, so the loss's statistics are the global batch's; data parallelism refuses it: test_moe_parallel.py).
    "hf_dbrx_tp": {"model": "hf_dbrx", "strategy": {"tp": 2}, "dp": 1},
    "hf_dbrx_aux_tp": {"model": "hf_dbrx_aux", "strategy": {"tp": 2}, "dp": 1},
    "hf_dbrx_zero3": {"model": "hf_dbrx", "strategy": "zero3"},
    # MoE families without a load-balancing term in the loss (one with it is refused: tests/test_check.py).
    **{
        f"{m}_pipe": {"model": m, "strategy": {"pp": 2}, "dp": 1}
        for m in ("hf_mixtral", "hf_deepseek_v3", "user_moe_list", "hf_dbrx")
    },
}
JOBS_4: dict[str, dict[str, Any]] = {
    **{f"{m}_pipe_tp": {"model": m, "strategy": {"pp": 2, "tp": 2}, "dp": 1} for m in DENSE},
    # pp 4 for the four-block families tests/test_pipeline_families.py runs at pp 2 or 3 only.
    **{f"{m}_pp4": {"model": m, "strategy": {"pp": 4}, "dp": 1} for m in ("litgpt_pythia", "hf_qwen2_tied",
                                                                          "hf_bert", "hf_vit")},
    # Two MoE families in four-block configs (one stage each; DeepSeek-V3's first block is dense).
    **{f"{m}_pp4": {"model": f"{m}_4", "strategy": {"pp": 4}, "dp": 1} for m in ("hf_deepseek_v3", "user_moe_list")},
    "hf_llama_pp4": {"model": "hf_llama_4", "strategy": {"pp": 4}, "dp": 1},
    "hf_mixtral_pipe_tp": {"model": "hf_mixtral", "strategy": {"pp": 2, "tp": 2}, "dp": 1},
    "hf_mixtral_pp4": {"model": "hf_mixtral_4", "strategy": {"pp": 4}, "dp": 1},
}  # fmt: skip
ALL = {**JOBS_2, **JOBS_4}


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, dict]]:
    tmp = tmp_path_factory.mktemp("families")
    refs = run_jobs(tmp, [reference_job({k: v for k, v in j.items() if k != "dp"}) for j in ALL.values()], nproc=1,
                    timeout=900)  # fmt: skip
    got = run_jobs(tmp, list(JOBS_2.values()), nproc=2, timeout=900)
    got += run_jobs(tmp, list(JOBS_4.values()), nproc=4, timeout=900)
    return dict(zip(ALL, zip(got, refs, strict=True), strict=True))


@pytest.mark.parametrize("name", list(ALL))
def test_matches_one_process(results, name):
    got, ref = results[name]
    assert len(got["losses"]) == len(ref["losses"]) >= 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params = without_tied_copies(got, ref)
    params_close(params, ref["params"], rtol=1e-5, atol=3e-5 if ALL[name]["model"].startswith("hf_llama") else 1e-7)
