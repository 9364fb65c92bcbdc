"""A pretrained base read into a model wrapped with low-rank adapters, under any layout (`pretrained=`).

A Hugging Face Llama saved with ``save_pretrained`` (a base model: no adapters) is the ``pretrained=`` of peft's LoRA
on the same architecture: the wrapped layers are filled under their unwrapped names (``q_proj.base_layer.weight``
from ``q_proj.weight``: `lightning_par.parallel.tensor.adapters.adapter_names`), the adapters keep their own
initial values, and nothing is refused. Under ``zero3`` (dp 2), ``tp`` (2) and ``pipe`` (pp 2), and in one process:
every base tensor at train start is the file's, bit for bit; the adapters are the model's own (the same under every
layout); the start-up line says how many adapter tensors kept their values; and the three layouts train as the
one-process run does (fp32 losses and gradient norms 1e-5 relative, parameters 1e-5 / 1e-7).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from launch import run_jobs
from parity import fp32_parity, params_close, rel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

pytest.importorskip("peft")

LAYOUTS = {"zero3": ("zero3", 2), "tp": ("tp", 1), "pipe": ({"pp": 2}, 1)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from _hf_models import _llama
    from safetensors.torch import load_file

    tmp = tmp_path_factory.mktemp("lora_pretrained")
    torch.manual_seed(7)  # another draw than the job's own initialisation: the file's values must win
    _llama(2).save_pretrained(tmp / "base")
    base = str(tmp / "base")

    def job(strategy: Any, dp: int) -> dict[str, Any]:
        spec = strategy if isinstance(strategy, dict) else {"zero3": {"zero_stage": 3}, "tp": {"tp": 2}}[strategy]
        return {"model": "peft_llama", "strategy": {**spec, "pretrained": base}, "dp": dp, "record_init": True}

    (ref,) = run_jobs(tmp, [job({}, 1)], nproc=1, timeout=300)
    got = run_jobs(tmp, [job(s, dp) for s, dp in LAYOUTS.values()], nproc=2, timeout=300)
    return {"file": load_file(str(tmp / "base" / "model.safetensors")), "ref": ref, "base": base,
            "got": dict(zip(LAYOUTS, got, strict=True))}  # fmt: skip


def _unwrapped(name: str) -> str:
    # model.base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight -> model.layers.0.self_attn.q_proj.weight
    return name.removeprefix("model.base_model.model.").replace(".base_layer.", ".")


@pytest.mark.parametrize("name", ["one_process", *LAYOUTS])
def test_base_weights_come_from_the_file_and_adapters_keep_their_own(runs: dict[str, Any], name: str) -> None:
    got = runs["ref"] if name == "one_process" else runs["got"][name]
    init, file = got["init_state"], runs["file"]
    base = {k: v for k, v in init.items() if ".lora_" not in k and "rotary" not in k}
    adapters = {k: v for k, v in init.items() if ".lora_" in k}
    assert len(base) == len(file) and len(adapters) == 2 * 7 * 2  # A and B of 7 projections in 2 layers
    for key, value in base.items():
        torch.testing.assert_close(value, file[_unwrapped(key)], rtol=0, atol=0, msg=key)
    for key, value in adapters.items():  # the model's own initial values, whatever the layout
        torch.testing.assert_close(value, runs["ref"]["init_state"][key], rtol=0, atol=0, msg=key)
    (line,) = [x for x in got["startup"] if x.startswith("pretrained weights:")]
    assert f"{len(adapters)} adapter tensor(s) keep their initial values" in line


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_adapted_pretrained_model_trains_as_in_one_process(runs: dict[str, Any], name: str) -> None:
    got, ref = runs["got"][name], runs["ref"]
    fp32_parity(got, ref, steps=3)


@pytest.fixture(scope="module")
def meta_runs(runs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    # The same base file; the adapted model built in configure_model(), so on the meta device: peft initialised
    # nothing there, lightning_par runs peft's own initialisation of the adapters (parallel/materialize.py).
    tmp = tmp_path_factory.mktemp("lora_meta")
    base = runs["base"]

    def job(spec: dict[str, Any], dp: int, model: str = "peft_llama_meta") -> dict[str, Any]:
        return {"model": model, "strategy": {**spec, "pretrained": base}, "dp": dp, "record_init": True}

    ref, plain = run_jobs(tmp, [job({}, 1), job({}, 1, "hf_llama_sgd")], nproc=1, timeout=300)
    got = run_jobs(tmp, [job({"zero_stage": 3}, 2), job({"tp": 2}, 1)], nproc=2, timeout=300)
    return {"ref": ref, "plain": plain, "zero3": got[0], "tp": got[1]}


def test_adapters_built_on_the_meta_device_start_as_peft_initialises_them(meta_runs: dict[str, Any]) -> None:
    ref = meta_runs["ref"]
    assert any(x.startswith("built on the meta device") for x in ref["startup"])
    lora_b = [v for k, v in ref["init_state"].items() if ".lora_B." in k]
    lora_a = [v for k, v in ref["init_state"].items() if ".lora_A." in k]
    assert len(lora_b) == len(lora_a) == 3 * 2 and all(bool((b == 0).all()) for b in lora_b)
    assert all(float(a.std()) > 0.01 for a in lora_a)  # A drawn (kaiming), not left empty
    # B zero: the adapted model computes what its base does, so its first loss is the base model's on that batch.
    assert ref["losses"][0] == pytest.approx(meta_runs["plain"]["losses"][0], rel=1e-6)
    assert ref["losses"][1] != pytest.approx(meta_runs["plain"]["losses"][1], rel=1e-4)  # then they part


@pytest.mark.parametrize("name", ["zero3", "tp"])
def test_meta_built_adapted_model_trains_as_in_one_process(meta_runs: dict[str, Any], name: str) -> None:
    got, ref = meta_runs[name], meta_runs["ref"]
    assert rel(got["losses"], ref["losses"]) < 1e-5 and len(got["losses"]) == 3
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)


# ---- adapters in: a PEFT folder read after the base (pretrained=[base, adapter]) ----------------------------------
@pytest.fixture(scope="module")
def adapter_runs(runs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from _lora_models import PeftLlama
    from safetensors.torch import load_file

    tmp = tmp_path_factory.mktemp("lora_adapter_in")
    torch.manual_seed(11)  # adapters other than the ones the job's model draws: the file's must win
    PeftLlama().model.save_pretrained(tmp / "adapter")  # adapter_model.safetensors + adapter_config.json
    sources = [runs["base"], str(tmp / "adapter")]

    def job(spec: dict[str, Any], dp: int) -> dict[str, Any]:
        return {"model": "peft_llama", "strategy": {**spec, "pretrained": sources}, "dp": dp, "record_init": True}

    (ref,) = run_jobs(tmp, [job({}, 1)], nproc=1, timeout=300)
    got = run_jobs(tmp, [job({"zero_stage": 3}, 2), job({"tp": 2}, 1), job({"pp": 2}, 1)], nproc=2, timeout=300)
    return {"ref": ref, "file": load_file(str(tmp / "adapter" / "adapter_model.safetensors")),
            "got": dict(zip(LAYOUTS, got, strict=True))}  # fmt: skip


def _peft_key(name: str) -> str:
    # model.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight
    #   -> base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight (PEFT saves without the adapter's name)
    return name.removeprefix("model.").replace(".default.", ".")


@pytest.mark.parametrize("name", ["one_process", *LAYOUTS])
def test_adapters_come_from_the_peft_folder(adapter_runs: dict[str, Any], runs: dict[str, Any], name: str) -> None:
    got = adapter_runs["ref"] if name == "one_process" else adapter_runs["got"][name]
    adapters = {k: v for k, v in got["init_state"].items() if ".lora_" in k}
    assert len(adapters) == len(adapter_runs["file"]) == 28
    for key, value in adapters.items():
        torch.testing.assert_close(value, adapter_runs["file"][_peft_key(key)], rtol=0, atol=0, msg=key)
    base = {k: v for k, v in got["init_state"].items() if ".lora_" not in k and "rotary" not in k}
    for key, value in base.items():
        torch.testing.assert_close(value, runs["file"][_unwrapped(key)], rtol=0, atol=0, msg=key)
    lines = [x for x in got["startup"] if x.startswith("pretrained weights:")]
    assert len(lines) == 2 and "keep their initial values" not in lines[0] and "adapter_model.safetensors" in lines[1]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_model_with_loaded_adapters_trains_as_in_one_process(adapter_runs: dict[str, Any], name: str) -> None:
    got, ref = adapter_runs["got"][name], adapter_runs["ref"]
    assert rel(got["losses"], ref["losses"]) < 1e-5 and len(got["losses"]) == 3
    assert rel(got["grad_norms"], ref["grad_norms"]) < 1e-5
    params_close(got["params"], ref["params"], rtol=1e-5, atol=1e-7)


def test_an_adapter_of_another_rank_is_refused_before_training(runs: dict[str, Any], tmp_path: Any) -> None:
    from _hf_models import _llama
    from peft import LoraConfig, get_peft_model

    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    get_peft_model(_llama(2), LoraConfig(r=8, target_modules=targets)).save_pretrained(tmp_path / "r8")
    job = {"model": "peft_llama", "strategy": {"zero_stage": 3, "pretrained": [runs["base"], str(tmp_path / "r8")]},
           "expect_error": True}  # fmt: skip
    (got,) = run_jobs(tmp_path, [job], nproc=2, timeout=300)
    assert got["error"] is not None and "lora_A" in got["error"] and "shape" in got["error"], got["error"]
    assert got["losses"] == []
