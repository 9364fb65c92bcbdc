"""``lightning-par estimate`` and ``lightning-par plan`` (the planner on the command line): the exact options and
JSON keys scripts rely on, the ranking and its reasons, the run command, the model read from a recipe's own module,
and bad input (unknown GPU, a layout that does not divide, a config with missing keys) ending with a message that
names the fix. In-process (`lightning_par.cli.main` with ``sys.argv``): no training, no process group.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from lightning_par import cli, cli_plan
from lightning_par.planner import from_hf_config
from lightning_par.planner.layout import Layout, LayoutError

ROOT = Path(__file__).resolve().parents[1]
LLAMA = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 8,
         "num_attention_heads": 16, "num_key_value_heads": 4, "vocab_size": 32000}  # fmt: skip


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(LLAMA))
    return str(path)


def main(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, *argv: str) -> str:
    monkeypatch.setattr(sys, "argv", ["lightning-par", *argv])
    cli.main()
    return capsys.readouterr().out


def test_estimate_json_has_the_documented_keys(config: str, capsys: Any, monkeypatch: Any) -> None:
    out = main(capsys, monkeypatch, "estimate", "--model-config", config, "--gpu", "H100", "--gpus-per-node", "8",
               "--tp", "2", "--pp", "2", "--vpp", "2", "--dp", "2", "--zero", "1", "--ep", "1", "--cp", "1",
               "--micro-batch-size", "1", "--global-batch-size", "16", "--seq-len", "2048", "--recompute", "selective",
               "--precision", "bf16-mixed", "--json")  # fmt: skip
    got = json.loads(out)
    assert {"step_time_s", "tflops_per_gpu", "mfu", "memory_gib"} <= set(got)
    mem = got["memory_gib"]
    assert {"parameters", "gradients", "optimizer", "activations", "total"} <= set(mem)
    assert mem["total"] == pytest.approx(sum(v for k, v in mem.items() if k != "total"))
    assert 0 < got["mfu"] < 1 and got["step_time_s"] > 0
    assert got["strategy"]["pp_schedule"] == "interleaved_1f1b" and got["strategy"]["microbatches"] == 8
    # The text form; sequence parallelism, also inside pipeline stages (each hands on its tp rank's shard).
    text = main(capsys, monkeypatch, "estimate", "--model-config", config, "--gpu", "h100", "--tp", "2",
                "--global-batch-size", "16", "--seq-len", "2048", "--dp", "4", "--sequence-parallel")  # fmt: skip
    assert "step time:" in text and "MFU" in text and "tp=2 pp=1 dp=4 zero=0 mbs=1 sp" in text
    text = main(capsys, monkeypatch, "estimate", "--model-config", config, "--gpu", "H100", "--tp", "2", "--pp", "2",
                "--global-batch-size", "16", "--seq-len", "2048", "--sequence-parallel")  # fmt: skip
    assert "step time:" in text and "tp=2 pp=2" in text and " sp" in text


def test_estimate_follows_the_layout(config: str) -> None:
    base = ["--model-config", config, "--gpu", "A100", "--global-batch-size", "32", "--seq-len", "2048", "--json"]

    def run(*extra: str) -> dict[str, Any]:
        return json.loads(cli_plan.run_estimate([*base, *extra]))

    ddp, zero3 = run("--dp", "8"), run("--dp", "8", "--zero", "3")
    assert zero3["memory_gib"]["parameters"] == pytest.approx(ddp["memory_gib"]["parameters"] / 8, rel=0.01)
    full, none = run("--dp", "8", "--recompute", "full"), run("--dp", "8")
    # Full recomputation keeps each block's input only; the logits and the loss's fp32 copy stay.
    assert full["memory_gib"]["activations"] < none["memory_gib"]["activations"] / 2
    assert full["step_time_s"] > none["step_time_s"]  # recomputation costs a forward
    assert run("--dp", "8", "--micro-batch-size", "4")["memory_gib"]["activations"] > none["memory_gib"]["activations"]
    # Offload (no CLI option; the Python API): the sharded state leaves the GPU for host memory and crosses PCIe.
    from lightning_par.planner import device
    from lightning_par.planner.estimate import estimate

    desc = from_hf_config(LLAMA)
    kept, moved = (estimate(desc, Layout(dp_shard=8, zero_stage=3, offload=o), device("A100"), 32, 2048).as_dict()
                   for o in (False, True))  # fmt: skip
    state = ("parameters", "gradients", "optimizer")
    assert all(moved["memory_gib"][k] == 0 for k in state) and moved["memory_gib"]["host"] > 0
    assert moved["memory_gib"]["host"] == pytest.approx(sum(kept["memory_gib"][k] for k in state))
    assert moved["step_time_s"] > kept["step_time_s"]
    # fp8 (H100): faster, the same memory (no persistent state changes); refused on a GPU without fp8.
    h100 = [*base[:3], "H100", *base[4:]]
    bf16 = json.loads(cli_plan.run_estimate([*h100, "--dp", "8", "--zero", "3"]))
    fp8 = json.loads(cli_plan.run_estimate([*h100, "--dp", "8", "--zero", "3", "--fp8"]))
    assert fp8["step_time_s"] < bf16["step_time_s"] and fp8["memory_gib"] == bf16["memory_gib"]
    assert "fp8" in fp8["layout"]
    with pytest.raises(LayoutError, match="no fp8 tensor cores"):
        run("--dp", "8", "--zero", "3", "--fp8")


def test_plan_ranks_feasible_layouts_and_says_why_others_fail(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    # 3.5 B parameters, 12 heads (tp 8 does not divide them), on 40 GB GPUs: some layouts do not fit.
    config = str(tmp_path / "big.json")
    Path(config).write_text(json.dumps({**LLAMA, "hidden_size": 3072, "num_attention_heads": 12,
                                        "num_hidden_layers": 28, "intermediate_size": 8192}))  # fmt: skip
    out = main(capsys, monkeypatch, "plan", "--model-config", config, "--gpu", "A100-SXM4-40GB", "--nodes", "1",
               "--global-batch-size", "64", "--seq-len", "4096", "--top", "5")  # fmt: skip
    rows = [line for line in out.splitlines() if line[:4].strip().isdigit()]
    times = [float(line.split()[1]) for line in rows]
    assert len(rows) == 5 and times == sorted(times)
    assert "infeasible x" in out and "out of memory" in out and "must divide the 12 query heads" in out
    assert "torchrun --nnodes 1 --nproc-per-node 8 -m lightning_par.cli fit" in out
    assert "class_path: lightning_par.ParallelStrategy" in out
    as_json = json.loads(main(capsys, monkeypatch, "plan", "--model-config", config, "--gpu", "A100-SXM4-40GB",
                              "--global-batch-size", "64", "--seq-len", "4096", "--json"))  # fmt: skip
    assert as_json["feasible"][0]["step_time_s"] == pytest.approx(times[0], rel=1e-3)
    assert as_json["n_feasible"] > 5 and as_json["infeasible"]


def test_the_best_layout_is_what_the_yaml_runs() -> None:
    # The printed recipe runs the chosen layout: ParallelStrategy's arguments, microbatches and accumulation.
    from lightning_par.config import ParallelConfig

    layout = Layout(tp=2, pp=2, dp_shard=2, zero_stage=1, pp_schedule="interleaved_1f1b", vpp=2, microbatches=8,
                    recompute="selective")  # fmt: skip
    kwargs = layout.strategy_kwargs()
    cfg = ParallelConfig(**kwargs)
    assert (cfg.tp, cfg.pp, cfg.dp_shard, cfg.zero_stage, cfg.microbatches) == (2, 2, 2, 1, 8)
    assert cfg.activation_checkpointing == "selective_op" and cfg.pp_schedule == "interleaved_1f1b"
    text = cli_plan.strategy_yaml(Layout(dp_shard=8, micro_batch_size=2), nodes=1, gpus_per_node=8, global_batch=64)
    assert "accumulate_grad_batches: 4" in text and "batch_size 2 per data-parallel rank" in text


def test_model_from_a_recipe_is_its_own_module() -> None:
    # --config RECIPE reads the recipe's own module (configure_model on the meta device): blocks, heads, parameters.
    from lightning_par.cli_recipe import _built, build_cli

    recipe = str(ROOT / "recipes" / "tp.yaml")
    desc, specs = cli_plan._model(cli_plan.plan_parser().parse_args(
        ["--config", recipe, "--gpu", "H100", "--global-batch-size", "8", "--seq-len", "128"]))  # fmt: skip
    model = _built(build_cli(["--config", recipe], run=False).model)
    assert sum(s.numel for s in specs) == sum(p.numel() for p in model.parameters()) == desc.total_params
    assert desc.layers == len(model.transformer.h) and desc.heads == model.hparams.n_head


def test_tp_plan_printing_is_still_reachable(capsys: Any, monkeypatch: Any) -> None:
    out = main(capsys, monkeypatch, "plan", "--config", str(ROOT / "recipes" / "tp.yaml"))
    assert "colwise" in out and "valid for tp=2" in out


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--gpu", "Z9000"], "known: A100-SXM4-40GB"),
        (["--gpu", "H100", "--tp", "3", "--dp", "1"], "that divide or are multiples of the key/value head count"),
        (["--gpu", "H100", "--dp", "3"], "multiple of 3"),
        (["--gpu", "H100", "--pp", "16", "--dp", "1"], "lower pp or vpp"),
    ],
)
def test_bad_input_names_the_fix(config: str, capsys: Any, monkeypatch: Any, extra: list[str], message: str) -> None:
    with pytest.raises(SystemExit) as err:
        main(capsys, monkeypatch, "estimate", "--model-config", config, "--global-batch-size", "16", "--seq-len",
             "1024", *extra)  # fmt: skip
    assert message in str(err.value)


def test_a_sequence_past_the_position_table_is_refused(tmp_path: Path) -> None:
    gpt2 = tmp_path / "gpt2.json"
    gpt2.write_text(json.dumps({"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "vocab_size": 256,
                                "n_positions": 128}))  # fmt: skip
    base = ["--model-config", str(gpt2), "--gpu", "H100", "--global-batch-size", "8", "--json"]
    assert json.loads(cli_plan.run_estimate([*base, "--seq-len", "128"]))["step_time_s"] > 0
    with pytest.raises(ValueError, match="longer than the model's 128 learned positions"):
        cli_plan.run_estimate([*base, "--seq-len", "129"])


def test_config_missing_keys_names_them(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({k: v for k, v in LLAMA.items() if k != "intermediate_size"}))
    with pytest.raises(SystemExit) as err:
        main(capsys, monkeypatch, "estimate", "--model-config", str(bad), "--gpu", "H100", "--global-batch-size",
             "8", "--seq-len", "128")  # fmt: skip
    assert "lacks ['intermediate_size']" in str(err.value) and "add them to the config" in str(err.value)
    assert from_hf_config(LLAMA).layers == 8
