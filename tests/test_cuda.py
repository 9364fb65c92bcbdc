"""CUDA-only paths: the asynchronous save's pinned side-stream staging, and exact resume with CUDA's RNG.

Skipped without a CUDA device (CI has none); ``benchmarks/gpu_check.py`` runs them (``pytest -m cuda``) on a lent GPU
and reports the outcome with its figures. The other CUDA-marked tests live beside their subject (test_monitor's peak
table, test_activation_checkpointing's offload).
"""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
from test_checkpoint_recovery import _full_state
from test_checkpoint_recovery import _gated_staging as _gate  # holds the worker until the test opens the gate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (benchmarks/gpu_check.py runs it)"),
]


def test_async_save_stages_cuda_tensors_into_pinned_buffers_with_save_time_values(tmp_path, monkeypatch):
    from lightning_par.checkpoint.async_save import AsyncSaver

    gate = _gate(monkeypatch)
    saver, path = AsyncSaver(timedelta(seconds=60)), tmp_path / "step=1.ckpt"
    # 256 MiB of parameter: its device-to-host copy takes milliseconds, long enough to race a careless fence.
    weight = torch.arange(2**26, device="cuda", dtype=torch.float32)
    stats = torch.ones(2**20, device="cuda")  # a buffer the next forward changes
    expected_w, expected_s = weight.cpu(), stats.cpu()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saver.save(path, {"state_dict": {"w": weight, "stats": stats}}, {"global_step": 1}, rank=0,
                   deferred=frozenset({weight.untyped_storage().data_ptr()}))  # fmt: skip
        stats.mul_(3.0)  # the next forward, queued at once: the device-side fence orders it after the buffer's copy
        buffers = list(saver._stager._buffers.values())
        assert buffers and all(b.is_pinned() for b in buffers)
        gate.set()
        saver.wait_for_staging()  # the optimizer step's pre-hook: the host waits for the parameter's copy
        weight.add_(1.0)  # the optimizer step
        assert saver.wait() == path
    state = _full_state(path)
    assert torch.equal(state["state_dict"]["w"], expected_w)
    assert torch.equal(state["state_dict"]["stats"], expected_s)
    # A second save reuses the pinned buffers (pinning is slow: cudaHostAlloc).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saver.save(tmp_path / "step=2.ckpt", {"state_dict": {"w": weight, "stats": stats}}, {"global_step": 2}, rank=0)
        assert [b.data_ptr() for b in saver._stager._buffers.values()] == [b.data_ptr() for b in buffers]
        saver.release()
    assert torch.equal(_full_state(tmp_path / "step=2.ckpt")["state_dict"]["w"], expected_w + 1)


def test_cuda_tensor_changed_before_its_copy_fails_the_save(tmp_path, monkeypatch):
    from lightning_par.checkpoint import CheckpointError
    from lightning_par.checkpoint.async_save import AsyncSaver

    gate = _gate(monkeypatch)
    saver, path = AsyncSaver(timedelta(seconds=60)), tmp_path / "step=1.ckpt"
    weight = torch.zeros(2**20, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        saver.save(path, {"state_dict": {"w": weight}}, {"global_step": 1}, rank=0,
                   deferred=frozenset({weight.untyped_storage().data_ptr()}))  # fmt: skip
        weight.add_(1.0)  # outside an optimizer step, before the staging fence
        gate.set()
        with pytest.raises(CheckpointError, match=r"state_dict.w was changed in place"):
            saver.wait_for_staging()
        with pytest.raises(CheckpointError, match="was not committed"):
            saver.wait()
    assert not path.exists()


def _fit_gpt(tmp_path: Path, max_steps: int, save_at: int | None = None, ckpt: Path | None = None) -> list[float]:
    import lightning as L

    import lightning_par  # noqa: F401  (registers the strategy names)
    from lightning_par.data import ByteTextDataModule
    from lightning_par.models import GPT

    losses: list[float] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: Any, i: int) -> None:
            losses.append(float(outputs["loss"]))
            if trainer.global_step == save_at:
                trainer.save_checkpoint(tmp_path / "mid.ckpt")

    L.seed_everything(0)
    model = GPT(dropout=0.2)  # dropout draws from CUDA's generator: a resume must restore it
    trainer = L.Trainer(accelerator="cuda", devices=1, strategy="zero2", max_steps=max_steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, callbacks=[Record()])  # fmt: skip
    trainer.fit(model, datamodule=ByteTextDataModule(seq_len=32, batch_size=8, num_samples=64), ckpt_path=ckpt)
    return losses


def test_resume_on_cuda_continues_the_dropout_stream_exactly(tmp_path):
    whole = _fit_gpt(tmp_path, max_steps=6, save_at=3)
    resumed = _fit_gpt(tmp_path, max_steps=6, ckpt=tmp_path / "mid.ckpt")
    assert len(whole) == 6 and len(resumed) == 3
    # Dropout masks drawn from a wrong generator state move the loss by ~1e-2; 1e-5 leaves room for the atomics of
    # attention's backward (not bit-deterministic on CUDA).
    assert max(abs(a - b) / abs(b) for a, b in zip(resumed, whole[3:], strict=True)) < 1e-5
