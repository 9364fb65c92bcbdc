"""A finished fit leaves nothing of its model behind: a second fit in the same process (a sweep, a notebook, the GPU
check) finds the device memory the first one used.

Found on the lent H200 (benchmarks/results/gpu): ZeRO-1/2's gradient-ready hooks held their engine, which holds the
parameters, and a parameter's own hooks are not seen by Python's cycle collector while autograd holds the
parameter, so every parameter, gradient and bucket of a ZeRO-2 fit stayed allocated after it. Tested here on the CPU
through weak references: a parameter object that outlives its fit is memory that outlives it on a GPU.

Found there too: a callback kept after the fit (gpu_check's step-time recorder; a ModelCheckpoint read for its
best path) held the module through the ``log`` / ``log_dict`` the Trainer binds onto every callback, and with it
the parameters, the last step's gradients and, through ``module.trainer``, the optimizer state: 8-11 GB of a 1 B
ZeRO-3 fit. Lightning's own single-device teardown only hides that by moving the module to the CPU; the test keeps
a callback and also counts every tensor storage created since before the model, so a holder that only keeps
gradients or optimizer state (no parameter object) is caught too.
"""

from __future__ import annotations

import gc
import logging
import warnings
import weakref

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import lightning_par  # noqa: F401  (registers the strategy names)
from lightning_par.models import Llama

# One layout per engine that registers hooks or wraps the model (DeepSpeed's engine is left out: its own tensor
# hooks keep it alive, which only DeepSpeed's `destroy()` undoes; see docs/deepspeed.md).
LAYOUTS = ["zero1", "zero2", "zero3", "zero3_offload", "tp", "pipe", "cp"]  # registered names, degree 1


class _Kept(L.Callback):
    """A callback the caller keeps after the fit, as gpu_check keeps its step-time recorder."""

    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_end(self, *args: object) -> None:
        self.steps += 1


def _new_tensors(before: dict[int, torch.Tensor]) -> list[torch.Tensor]:
    """Live floating-point tensors with a storage (a DTensor's local tensor, not the DTensor) not in ``before``:
    parameters, gradients, optimizer state. Integer ones are left out: torch's process-wide DTensor sharding cache
    keeps the device mesh's rank table (``tensor([0], dtype=int32)``) of the first FSDP2 fit, a few bytes."""
    gc.collect()
    out = []
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and id(obj) not in before and not obj.is_meta and obj.is_floating_point():
            try:
                nbytes = obj.untyped_storage().nbytes()
            except (RuntimeError, NotImplementedError):  # a wrapper subclass: no storage (its local tensor counts)
                continue
            if nbytes > 0:
                out.append(obj)
    return out


@pytest.mark.parametrize("name", LAYOUTS)
def test_a_finished_fit_leaves_no_parameter_alive(name):
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    L.seed_everything(0, verbose=False)
    gc.collect()
    # By id, holding them (a WeakSet compares tensors with == on a hash collision; held, no id is reused).
    before = {id(o): o for o in gc.get_objects() if isinstance(o, torch.Tensor)}
    kept = _Kept()
    model = Llama(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=64, max_seq_len=16)
    data = TensorDataset(torch.randint(0, 64, (8, 16)), torch.randint(0, 64, (8, 16)))
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=name,
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0, callbacks=[kept])  # fmt: skip
    trainer.fit(model, train_dataloaders=DataLoader(data, batch_size=4))
    assert trainer.global_step == 2
    params = [weakref.ref(p) for p in model.parameters()]
    optimizer = weakref.ref(trainer.optimizers[0])
    assert all(p() is not None for p in params) and optimizer() is not None  # the references do see live objects
    assert kept.steps == 2 and len(_new_tensors(before)) > 0  # the scan does see the fit's tensors
    del model, trainer, data
    gc.collect()
    alive = sum(p() is not None for p in params)
    assert alive == 0, f"{alive} of {len(params)} parameters outlived the fit"
    assert optimizer() is None
    left = _new_tensors(before)
    shown = [(type(t).__name__, tuple(t.shape)) for t in left[:5]]
    assert not left, f"{len(left)} floating-point tensors of the fit outlived it: {shown}"
