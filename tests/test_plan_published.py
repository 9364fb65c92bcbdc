"""The planner against published runs: Korthikanti et al.'s Table 5 (arXiv 2205.05198), transcribed with its
citation in tests/data/korthikanti2022_table5.csv, predicted from the model shapes, the layout and the A100 entry of
the device table with no per-row constant. Mean step-time error <= 5 %, max <= 10 % (docs/planner.md lists every row).
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from lightning_par.planner import ModelDesc, device
from lightning_par.planner.layout import Layout
from lightning_par.planner.steptime import step_time

TABLE = Path(__file__).parent / "data" / "korthikanti2022_table5.csv"


def rows() -> list[dict[str, str]]:
    lines = [line for line in TABLE.read_text().splitlines() if not line.startswith("#")]
    return list(csv.DictReader(lines))


def gpt(row: dict[str, str]) -> ModelDesc:
    """The paper's GPT-3-style model: LayerNorm, GeLU MLP of 4h, biases, learned positions, tied 51,200 vocab."""
    h, a = int(row["hidden"]), int(row["heads"])
    return ModelDesc(layers=int(row["layers"]), hidden=h, heads=a, kv_heads=a, head_dim=h // a, ffn=4 * h,
                     vocab=51200, gated_mlp=False, tied_embeddings=True, layernorm=True, bias=True,
                     learned_positions=2048)  # fmt: skip


def layout(row: dict[str, str]) -> Layout:
    selective = row["mode"] == "sp_selective"
    vpp = int(row["vpp"])
    return Layout(
        tp=int(row["tp"]), pp=int(row["pp"]), vpp=vpp, pp_schedule="interleaved_1f1b" if vpp > 1 else "1f1b",
        micro_batch_size=int(row["micro_batch"]), recompute="selective" if selective else "full",
        sequence_parallel=selective, precision="16-mixed",
    )  # fmt: skip


def predicted(row: dict[str, str]) -> float:
    return step_time(gpt(row), layout(row), device("A100-SXM4-80GB"), int(row["global_batch"]), 2048,
                     profile="megatron").total  # fmt: skip


def test_table5_step_time_error() -> None:
    table = rows()
    assert len(table) == 8
    errors = {}
    for row in table:
        assert layout(row).world == int(row["gpus"]), row  # the transcribed layout uses the paper's GPU count
        errors[(row["model"], row["mode"])] = abs(predicted(row) / float(row["iteration_s"]) - 1)
    mean = sum(errors.values()) / len(errors)
    assert mean <= 0.05, errors
    assert max(errors.values()) <= 0.10, errors


def test_table5_predicts_the_speedup_of_sp_selective() -> None:
    # The paper's point: sequence parallelism + selective recomputation is ~30 % faster than full recomputation.
    table = rows()
    for full, sel in zip(table[::2], table[1::2], strict=True):
        measured = float(full["iteration_s"]) / float(sel["iteration_s"])
        assert predicted(full) / predicted(sel) == pytest.approx(measured, rel=0.06), full["model"]


# torchtitan's published Llama-3.1-8B run on 8 H100 (FSDP over 8, sequence 8,192, local batch 1, torch.compile):
# 6,667 tokens/s/GPU in bf16, 8,532 with float8 linear layers (torchtitan's docs/performance.md), +28 %. The
# planner's fp8 line (lightning_par.planner.fp8: the projections at the fp8 rate, plus the casts' bytes) predicts
# +23 % for it (measured 2026-12-06); its absolute rate is 43 % above torchtitan's, the torch profile's known
# optimism on GPU figures it was never fitted to (docs/planner.md, "fp8").
LLAMA31_8B = ModelDesc(layers=32, hidden=4096, heads=32, kv_heads=8, head_dim=128, ffn=14336, vocab=128256)


def test_the_fp8_gain_of_torchtitans_llama_8b_run() -> None:
    def tokens_per_s(fp8: bool) -> float:
        run = Layout(dp_shard=8, zero_stage=3, micro_batch_size=1, fp8=fp8)
        return 8192 / step_time(LLAMA31_8B, run, device("H100"), 8, 8192, profile="torch").total

    gain = tokens_per_s(True) / tokens_per_s(False) - 1
    assert abs(gain - (8532 / 6667 - 1)) < 0.10, gain


def test_fp8_is_refused_on_a_device_without_it() -> None:
    from lightning_par.planner.layout import LayoutError

    with pytest.raises(LayoutError, match="A100-SXM4-80GB has no fp8 tensor cores"):
        step_time(LLAMA31_8B, Layout(dp_shard=8, zero_stage=3, fp8=True), device("A100"), 8, 8192)
