"""0-dim parameters (a learned temperature, a gate ``nn.Parameter(torch.tensor(1.0))``) under every layout.

ZeRO shards along dim 0 and FSDP2 refuses a 0-dim parameter; they stay whole on every rank and their gradients are
averaged apart (`lightning_par.parallel.zero.scalars`). A user model (tests/_job_models.py, ``Scalars0LM``) holds them
on the model (scales of the embedding and the logits), in every block (a gate on its MLP) and one the forward never
uses, with SGD + momentum + weight decay (which would move the unused one if it got a zero gradient). One 2-rank spawn:
ZeRO 0-3 (ZeRO-2 with accumulation), tp, a pipeline (the unused one is held on every stage), and local SGD with a
plain outer step every step (which is data parallelism: a replica's scalars left out of its synchronisation would
follow its own data). Each against the same model in one process: losses to 1e-5 relative, every parameter rtol
1e-5 / atol 1e-7.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from launch import run_jobs
from parity import params_close, rel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

MODEL = "scalars0_lm"
JOBS: dict[str, dict[str, Any]] = {
    "zero0": {"strategy": {"zero_stage": 0}, "dp": 2},
    "zero1": {"strategy": {"zero_stage": 1}, "dp": 2},
    "zero2_accumulate": {"strategy": {"zero_stage": 2}, "dp": 2, "accumulate": 2},
    "zero3": {"strategy": {"zero_stage": 3}, "dp": 2},
    "tp": {"strategy": {"tp": 2}, "dp": 1},
    "pipe": {"strategy": {"pp": 2}, "dp": 1},
    "local_sgd": {"strategy": {"zero_stage": 1, "dp_replicate": 2, "sync_every": 1, "outer_lr": 1.0,
                               "outer_momentum": 0.0}, "dp": 2},
}  # fmt: skip


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp: Path = tmp_path_factory.mktemp("scalar_params")
    extra = [{k: j[k] for k in ("accumulate",) if k in j} for j in JOBS.values()]
    refs = run_jobs(tmp, [{"model": MODEL, "strategy": "auto", **e} for e in extra], nproc=1, timeout=300)
    got = run_jobs(tmp, [{"model": MODEL, **j} for j in JOBS.values()], nproc=2, timeout=500)
    return {name: (g, r) for name, g, r in zip(JOBS, got, refs, strict=True)}


@pytest.mark.parametrize("name", list(JOBS))
def test_0_dim_parameters_train_as_in_one_process(runs: dict[str, Any], name: str) -> None:
    got, ref = runs[name]
    assert len(got["losses"]) == len(ref["losses"]) >= 3
    assert rel(got["losses"], ref["losses"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)
    assert got["param_shapes"]["scale"] == got["param_shapes"]["blocks.0.gate"] == ()
    assert float(got["params"]["unused"]) == 0.5  # no gradient anywhere: the optimizer left it alone
