"""Adapters out in PEFT's format: ``lightning-par consolidate CKPT --format peft`` on checkpoints saved under layouts
that shard or split the adapters, loaded back by peft's own ``PeftModel.from_pretrained``.

peft LoRA (and DoRA) on Hugging Face Llama trained under ``zero3`` (dp 2: adapters sharded) and ``tp`` (2: each
adapter split with its base) for 2 steps, a checkpoint saved after each. The exported folder holds exactly the
adapter tensors (no base weight), under PEFT's names; ``PeftModel.from_pretrained`` on a fresh Llama of the same
config loads every one of them (no missing adapter key) with the values of the trained model (the checkpoint read
whole), and the adapter config (r, alpha, target modules, DoRA) is the one the model was wrapped with. A checkpoint
of a model without adapters is refused naming ``--format hf``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from launch import run_jobs

from lightning_par.checkpoint.consolidate import load_full_state, main

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

pytest.importorskip("peft")

JOBS = {
    "lora_zero3": {"model": "peft_llama", "strategy": "zero3", "dp": 2},
    "dora_zero3": {"model": "peft_llama_dora", "strategy": "zero3", "dp": 2},
    "lora_tp": {"model": "peft_llama", "strategy": "tp", "dp": 1},
    "plain": {"model": "hf_llama", "strategy": "zero3", "dp": 2},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("peft_export")
    jobs = [{**j, "epoch_steps": 1, "max_steps": 2, "ckpt_dir": str(tmp / name)} for name, j in JOBS.items()]
    run_jobs(tmp, jobs, nproc=2, timeout=600)
    return {name: tmp / name / "epoch=1.ckpt" for name in JOBS}


def _fresh_peft(folder: Path) -> Any:
    from _hf_models import _llama
    from peft import PeftModel

    torch.manual_seed(123)  # another base: only the adapters must come from the folder
    return PeftModel.from_pretrained(_llama(2), str(folder))


@pytest.mark.parametrize("name", ["lora_zero3", "dora_zero3", "lora_tp"])
def test_exported_adapter_loads_in_peft_with_the_trained_values(checkpoints: dict[str, Path], name: str,
                                                                tmp_path: Path) -> None:  # fmt: skip
    from safetensors.torch import load_file

    out = tmp_path / "adapter"
    main([str(checkpoints[name]), str(out), "--format", "peft"])
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8)
    assert config["use_dora"] == (name == "dora_zero3")
    assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                             "down_proj"}  # fmt: skip
    written = load_file(str(out / "adapter_model.safetensors"))
    assert all(".lora_" in k and ".default" not in k for k in written)  # the adapters only, PEFT's names
    assert len(written) == 2 * 7 * 2 + (7 * 2 if name == "dora_zero3" else 0)  # A, B (+ magnitude) x 7 x 2 layers
    model = _fresh_peft(out)
    trained = load_full_state(checkpoints[name])["state_dict"]
    loaded = {k: v for k, v in model.state_dict().items() if ".lora_" in k}
    assert len(loaded) == len(written)
    for key, value in loaded.items():  # the model's names: model.<PEFT model's own name>
        torch.testing.assert_close(value, trained[f"model.{key}"], rtol=0, atol=0, msg=key)


def test_a_checkpoint_without_adapters_is_refused_naming_the_whole_model_format(
    checkpoints: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as err:
        main([str(checkpoints["plain"]), str(tmp_path / "x"), "--format", "peft"])
    assert err.value.code == 2
    message = capsys.readouterr().err
    assert "records no PEFT adapter" in message and "--format hf" in message
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("name", ["lora_zero3", "dora_zero3", "lora_tp"])
def test_merged_export_loads_in_transformers_and_computes_what_the_adapted_model_does(
    checkpoints: dict[str, Path], name: str, tmp_path: Path
) -> None:
    # --format hf --merge-adapters: the base model with W + scale B A (DoRA: each row rescaled to its magnitude),
    # named as the unwrapped model, loads with from_pretrained and gives the trained adapted model's logits.
    from _hf_models import _llama
    from _lora_models import PeftLlama
    from transformers import AutoModelForCausalLM

    cfg = tmp_path / "cfg"
    _llama(2).config.save_pretrained(cfg)
    out = tmp_path / "merged"
    main([str(checkpoints[name]), str(out), "--format", "hf", "--merge-adapters", "--config", str(cfg)])
    merged = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    adapted = PeftLlama(dora=name == "dora_zero3").eval()
    adapted.load_state_dict(load_full_state(checkpoints[name])["state_dict"])  # the trained weights, adapters too
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = adapted(tokens), merged(input_ids=tokens).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    base = _llama(2)  # not vacuous: the adapters changed what the model computes
    base.load_state_dict({k.replace("base_model.model.", "").replace(".base_layer", ""): v for k, v in
                          adapted.model.state_dict().items() if ".lora_" not in k})  # fmt: skip
    with torch.no_grad():
        assert not torch.allclose(base(input_ids=tokens).logits, want, rtol=1e-3, atol=1e-3)
