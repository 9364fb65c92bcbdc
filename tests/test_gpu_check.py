"""benchmarks/gpu_check.py --smoke: the GPU check's every section runs on the CPU at tiny sizes and reports right.

One subprocess (~30 s) runs all six CPU sections; the assertions read its JSON report. What must hold on any
machine: every strategy family matches the plain Trainer (fp32, and bf16-mixed for zero3), the activation formula
equals the live-tensor count for every checkpointing policy (exactly but for the loss's two scalars; this also
catches a library leaving a process-wide patch behind: DeepSpeed ZeRO-3's F.linear, which the parity rows run
first), and both checkpoints hold the weights of their save's moment. Timings are reported, never asserted.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest
from launch import run_session, worker_env

ROOT = Path(__file__).resolve().parents[1]


def test_the_check_runs_every_cuda_marked_test_file():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from gpu_check import CUDA_TEST_FILES
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    mark = re.compile(r"^(@pytest\.mark\.cuda\b|pytestmark = \[\s*pytest\.mark\.cuda\b)", re.M)
    marked = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "tests").glob("test_*.py")
                    if mark.search(p.read_text()))  # fmt: skip
    assert list(CUDA_TEST_FILES) == marked


@pytest.mark.slow
def test_gpu_check_smoke_runs_every_section_and_reports(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--smoke", "--out", str(tmp_path)]
    proc = run_session(cmd, env=worker_env(), timeout=400, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    sections = report["sections"]
    assert list(sections) == ["parity", "throughput", "activations", "async_save", "offload", "fp8"]
    assert all(s["ok"] for s in sections.values()), {k: s.get("error") for k, s in sections.items()}

    parity = sections["parity"]["result"]
    assert len(parity) == 16 and {r["precision"] for r in parity} == {"32-true", "bf16-mixed"}
    assert [r for r in parity if not r["ok"]] == []
    assert all(r["loss_rel"] <= 1e-5 for r in parity if r["precision"] == "32-true")

    throughput = sections["throughput"]["result"]
    variants = {r["variant"]: r for r in throughput["rows"]}
    assert set(variants) == {"zero3", "tp", "pipe", "lightning_model_parallel", "hand_fsdp2", "zero1", "zero2", "ddp"}
    assert all(r["step_s"] > 0 and r["tflops"] > 0 and r["mfu"] is None for r in variants.values())  # no peak on CPU
    assert variants["hand_fsdp2"]["ratio_vs_hand_fsdp2"] == 1.0 and variants["ddp"]["ratio_vs_ddp"] == 1.0

    rows = sections["activations"]["result"]["rows"]
    assert [r["policy"] for r in rows] == ["none", "full", "selective", "selective_op", "offload", "offload:2"]
    for r in rows:
        assert 0 <= r["held_bytes"] - r["predicted_bytes"] <= 16, r  # the loss and nll's total weight: 2 x 4 bytes
    assert rows[1]["held_bytes"] < rows[3]["held_bytes"] < rows[2]["held_bytes"] < rows[0]["held_bytes"]

    saves = sections["async_save"]["result"]
    assert saves["sync_holds_save_time_values"] and saves["async_holds_save_time_values"]
    assert len(saves["sync"]) == len(saves["async"]) == 2 and saves["ratio"] > 0

    offload = sections["offload"]["result"]
    assert [r["variant"] for r in offload] == ["zero3", "zero3_offload", "zero3 + activation offload",
                                               "zero3 + activation offload, first half", "zero3 + full recomputation"]
    fp8 = sections["fp8"]["result"]  # on a CPU: emulated, eager; both train (finite losses), the ratio is reported
    assert fp8["fp8"] == "emulate" and [r["variant"] for r in fp8["rows"]] == ["bf16", "fp8"]
    assert all(0 < r["last_loss"] < 10 for r in fp8["rows"]) and fp8["fp8_over_bf16"] > 0
    markdown = (tmp_path / "report.md").read_text()
    for name in sections:
        assert f"## {name} (" in markdown
    assert "| zero3_offload | gpt | 32-true | True |" in markdown
