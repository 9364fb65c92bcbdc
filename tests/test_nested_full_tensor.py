"""`lightning_par.checkpoint.full_tensor` of ZeRO-3 over tensor parallelism (FSDP2's ``_StridedShard`` over a tp
``Shard``) gathers with its own collectives, exactly, for even and uneven row counts (tests/_nested_full_worker.py;
one 4-rank spawn)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from launch import run_forked

pytestmark = pytest.mark.slow


def test_full_tensor_of_zero3_over_tp_equals_the_parameters_before_the_layout(tmp_path: Path) -> None:
    out = tmp_path / "out.pt"
    proc = run_forked(Path(__file__).with_name("_nested_full_worker.py"), [str(out)], 4, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0 and out.exists(), proc.stdout[-9000:]
    got = torch.load(out)
    assert got["params"] == 8 and got["nested"] >= 2  # the column-split weights and biases: the nested layout
