"""Reference models and the bundled byte-level datamodule: single process, CPU, no process group."""

import re
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torch.utils.data import SequentialSampler

from lightning_par.data import ByteTextDataModule, decode, encode, load_text
from lightning_par.models import GPT, Llama

TINY: dict[str, dict[str, Any]] = {
    "gpt": {"block_size": 32, "n_layer": 2, "n_head": 4, "n_embd": 32},
    "llama": {"max_seq_len": 32, "dim": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ffn_hidden": 64},
}


def _model(kind: str, **kw: Any) -> GPT | Llama:
    cls = GPT if kind == "gpt" else Llama
    return cls(**{**TINY[kind], **kw})


def _trainer(**kw: Any) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kw,
    )


class _RecordLoss(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, *args: Any) -> None:
        self.losses.append(float(outputs["loss"]))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_forward_shape_and_model_attributes(kind: str) -> None:
    model = _model(kind)
    logits = model(torch.randint(0, 256, (3, 17)))
    assert logits.shape == (3, 17, 256)
    assert (model.n_layers, model.hidden_size, model.seq_len) == (2, 32, 32)
    with pytest.raises(ValueError, match="exceeds"):
        model(torch.zeros(1, 33, dtype=torch.long))


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_loss_decreases_and_eval_loops_run(kind: str) -> None:
    L.seed_everything(0, verbose=False)
    model = _model(kind, lr=3e-3, warmup_steps=5, max_steps=30)
    dm = ByteTextDataModule(seq_len=32, batch_size=8, num_samples=240)
    record = _RecordLoss()
    trainer = _trainer(max_steps=30, callbacks=[record], limit_val_batches=2, num_sanity_val_steps=0)
    trainer.fit(model, dm)
    assert len(record.losses) == 30
    first, last = record.losses[0], sum(record.losses[-5:]) / 5
    assert first == pytest.approx(torch.log(torch.tensor(256.0)).item(), abs=0.3)  # near-uniform at init
    assert last < first - 1.0, record.losses

    metrics = trainer.validate(model, dm, verbose=False)[0]
    assert {"val_loss", "val_acc"} <= metrics.keys() and 0.0 <= metrics["val_acc"] <= 1.0
    assert "test_loss" in trainer.test(model, dm, verbose=False)[0]
    preds = trainer.predict(model, dm)
    assert preds is not None and len(preds) == 4
    assert preds[0].shape == (8, 32) and preds[0].dtype == torch.long  # type: ignore[union-attr]


def test_lr_schedule_warmup_then_cosine_floor() -> None:
    opt_cfg = GPT(lr=1.0, warmup_steps=4, max_steps=14).configure_optimizers()
    opt, sched = opt_cfg["optimizer"], opt_cfg["lr_scheduler"]["scheduler"]
    assert opt_cfg["lr_scheduler"]["interval"] == "step"
    decay, no_decay = opt.param_groups
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] == 0.1
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0.0
    lrs = []
    for _ in range(20):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert lrs[14:] == pytest.approx([0.1] * 6)
    with pytest.raises(ValueError, match="max_steps=3 must exceed warmup_steps=5"):
        GPT(warmup_steps=5, max_steps=3)


def test_llama_gqa_and_rope_stay_fp32_under_bf16() -> None:
    model = Llama(**{**TINY["llama"], "n_kv_heads": 1})
    assert model.get_parameter("layers.0.attention.wk.weight").shape == (8, 32)  # one kv head of head_dim 8
    x = torch.randint(0, 256, (2, 16))
    ref = model(x)
    model = model.to(torch.bfloat16)
    assert model.rope.dtype == torch.float32 and "rope" not in model.state_dict()
    torch.testing.assert_close(model(x).float(), ref, atol=0.1, rtol=0.1)
    with pytest.raises(ValueError, match="n_kv_heads=3 does not divide n_heads=4"):
        _model("llama", n_kv_heads=3)


def test_gpt_tie_weights_and_init() -> None:
    tied, untied = _model("gpt", tie_weights=True), _model("gpt")
    assert tied.get_parameter("lm_head.weight") is tied.get_parameter("transformer.wte.weight")
    assert untied.get_parameter("lm_head.weight") is not untied.get_parameter("transformer.wte.weight")
    n_params = sum(p.numel() for p in untied.parameters()) - sum(p.numel() for p in tied.parameters())
    assert n_params == 256 * 32
    # Residual projections get std 0.02 / sqrt(2 * n_layer) = 0.01; a 32x32 sample pins it within ~15%.
    assert untied.get_parameter("transformer.h.0.attn.c_proj.weight").std().item() == pytest.approx(0.01, rel=0.15)


def test_generate_greedy_is_deterministic() -> None:
    model = _model("gpt").train()
    prompt = encode("To be").unsqueeze(0)
    a, b = model.generate(prompt, 40, temperature=0.0), model.generate(prompt, 40, temperature=0.0)
    assert a.shape == (1, 45) and torch.equal(a, b) and model.training
    assert model.generate(prompt, 3, temperature=1.0).shape == (1, 8)


def test_models_and_data_import_nothing_from_lightning_par() -> None:
    # Except lightning_par.nn (building blocks such as MoE), which itself imports only lightning_par.nn.
    root = Path(__file__).parents[1] / "lightning_par"
    other = r"lightning_par\b(?!\.nn\b)"
    pattern = re.compile(rf"^\s*(from\s+({other}|\.\.)|import\s+{other})", re.MULTILINE)
    for path in [*(root / "models").glob("*.py"), *(root / "data").glob("*.py"), *(root / "nn").glob("*.py")]:
        assert not pattern.search(path.read_text()), f"{path} imports from lightning_par"
    assert pattern.search("from lightning_par.parallel import x") and pattern.search("import lightning_par")
    assert not pattern.search("from lightning_par.nn import MoE")


def test_text_codec_round_trip() -> None:
    text = load_text()
    assert 40_000 < len(text.encode()) < 120_000
    tokens = encode(text)
    assert tokens.dtype == torch.long and int(tokens.max()) < 256
    assert decode(tokens) == text
    assert decode(encode("naive caf\u00e9 \u2014 ok")) == "naive caf\u00e9 \u2014 ok"  # multi-byte UTF-8


def test_datamodule_windows_order_and_sampler() -> None:
    dm = ByteTextDataModule(seq_len=16, batch_size=4, seed=1, num_samples=40)
    loader = dm.train_dataloader()
    assert isinstance(loader.sampler, SequentialSampler)
    x, y = next(iter(loader))
    assert x.shape == y.shape == (4, 16) and x.dtype == torch.long
    assert torch.equal(x[:, 1:], y[:, :-1])
    tokens = encode(load_text())
    starts = [int(dm._train.order[i]) * 16 for i in range(4)]  # type: ignore[union-attr]
    assert torch.equal(x, torch.stack([tokens[s : s + 16] for s in starts]))

    again = next(iter(ByteTextDataModule(seq_len=16, batch_size=4, seed=1, num_samples=40).train_dataloader()))
    other = next(iter(ByteTextDataModule(seq_len=16, batch_size=4, seed=2, num_samples=40).train_dataloader()))
    assert torch.equal(x, again[0]) and not torch.equal(x, other[0])
    assert len(loader) == 10

    # Validation is the tail of the text, in order.
    vx, _ = next(iter(dm.val_dataloader()))
    split = int(len(tokens) * 0.9)
    assert torch.equal(vx[0], tokens[split : split + 16]) and torch.equal(vx[1], tokens[split + 16 : split + 32])
    plain = ByteTextDataModule(seq_len=16, batch_size=2, shuffle=False)
    assert torch.equal(next(iter(plain.train_dataloader()))[0][1], tokens[16:32])
