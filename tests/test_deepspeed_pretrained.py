"""``pretrained=`` under the DeepSpeed backend: the file's weights, bitwise, and under ZeRO-3 never the whole model
on a rank.

A Hugging Face Llama folder (``save_pretrained`` of weights no seed-0 initialisation gives) is read by
``deepspeed_zero2``, ``deepspeed_zero3`` and ``deepspeed_zero3_offload`` into the model built in
``configure_model()`` (on the meta device: never initialised), and by ``deepspeed_zero1`` into an eagerly built
one. The reference is the same folder loaded by transformers' ``from_pretrained`` in one process: the weights
after set-up (ZeRO-3's gathered) must equal the file bitwise, and 3 steps follow the reference's losses within
1e-5 relative. Under ZeRO-3 each rank reports (`MetaInitReport`) the most parameter bytes it held at once while the
file was read unit by unit: under the full model, within its share plus one unit. A folder of another model (one
more layer) is refused before the first step, naming the folder.

Two spawns: one process (the references), then 2 ranks for every DeepSpeed job (~30-40 s together).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_jobs
from parity import rel
from safetensors.torch import load_file

from lightning_par.names import deepspeed_strategy_kwargs

pytest.importorskip("deepspeed")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

# name -> (model, strategy): hf_llama_deferred is built in configure_model() (meta), hf_llama in __init__ (eager).
CASES = {
    "zero2_meta": ("hf_llama_deferred", "deepspeed_zero2"),
    "zero3_meta": ("hf_llama_deferred", "deepspeed_zero3"),
    "zero3_offload_meta": ("hf_llama_deferred", "deepspeed_zero3_offload"),
    "zero1_eager": ("hf_llama", "deepspeed_zero1"),
}


def _strategy(name: str, folder: Path) -> dict[str, Any]:
    return {"backend": "deepspeed", **deepspeed_strategy_kwargs(name), "pretrained": str(folder)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    sys.path.insert(0, str(Path(__file__).parent))
    from _hf_models import HFLlama

    tmp = tmp_path_factory.mktemp("deepspeed_pretrained")
    torch.manual_seed(7)  # other weights than any seed-0 initialisation
    HFLlama().model.save_pretrained(tmp / "llama")
    HFLlama(layers=3).model.save_pretrained(tmp / "llama_3_layers")
    models = sorted({m for m, _ in CASES.values()})
    ref_jobs = [{"model": m, "hf_from_pretrained": str(tmp / "llama"), "record_init": True} for m in models]
    refs = dict(zip(models, run_jobs(tmp / "ref", ref_jobs, nproc=1, timeout=600), strict=True))
    jobs = [{"model": m, "strategy": _strategy(s, tmp / "llama"), "record_init": True} for m, s in CASES.values()]
    jobs.append(
        {"model": "hf_llama_deferred", "strategy": _strategy("deepspeed_zero3", tmp / "llama_3_layers"),
         "expect_error": True}
    )  # fmt: skip
    got = run_jobs(tmp / "ds", jobs, nproc=2, timeout=800)
    out = {name: (g, refs[CASES[name][0]]) for name, g in zip(CASES, got[: len(CASES)], strict=True)}
    return {**out, "wrong": got[-1], "file": load_file(str(tmp / "llama" / "model.safetensors"))}


@pytest.mark.parametrize("name", list(CASES))
def test_pretrained_weights_bitwise_and_losses_follow_from_pretrained(runs: dict[str, Any], name: str) -> None:
    got, ref = runs[name]
    init = got["init_state"]
    for key, value in runs["file"].items():
        assert init[f"model.{key}"].dtype == value.dtype and torch.equal(init[f"model.{key}"], value), key
    for key, value in ref["init_state"].items():  # rotary tables: recomputed, as from_pretrained does
        assert torch.equal(init[key], value), key
    assert len(got["losses"]) == len(ref["losses"]) == 3
    assert rel(got["losses"], ref["losses"]) < 1e-5


def test_zero3_rank_never_holds_the_model_while_reading(runs: dict[str, Any]) -> None:
    for name in ("zero3_meta", "zero3_offload_meta"):
        got, _ = runs[name]
        shapes = got["param_shapes"]
        full = sum(torch.Size(s).numel() for s in shapes.values()) * 4  # fp32
        largest_unit = max(_block_bytes(shapes).values())
        for report in got["meta_init_all"]:
            assert report["full_bytes"] == full and report["units"] > 2
            assert report["peak_bytes"] < full
            # Its half of every parameter (DeepSpeed pads each to a multiple of the world size) plus one unit.
            assert report["peak_bytes"] <= full / 2 + largest_unit + 4 * len(shapes)


def _block_bytes(shapes: dict[str, tuple[int, ...]]) -> dict[str, int]:
    units: dict[str, int] = {}
    for name, shape in shapes.items():
        parts = name.split(".")
        unit = ".".join(parts[:4]) if "layers" in parts else name.rpartition(".")[0]
        units[unit] = units.get(unit, 0) + torch.Size(shape).numel() * 4
    return units


def test_pretrained_of_another_model_is_refused_before_training(runs: dict[str, Any]) -> None:
    got = runs["wrong"]
    assert got["error"] is not None and got["losses"] == []
    assert "llama_3_layers" in got["error"] and "layers.2" in got["error"], got["error"]
