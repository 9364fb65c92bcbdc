"""What stands in for a module another pipeline stage owns: a meta-device copy of its subtree (`shadow`).

The user's code still reads a stand-in's attributes, configs, dtypes and shapes (Hugging Face ``ViTModel.forward``
reads ``self.embeddings.patch_embeddings.projection.weight.dtype``), but its tensors have no storage and are not
registered, so optimizers, checkpoints and ZeRO never see them. A stand-in for a unit of the first stage (an
embedding) runs on every later stage for every microbatch: its output is only a shape (the stage's first block
swaps in the received activation), so the shapes a meta-device forward gives are remembered per input signature
and later calls make the zeros directly (`pipeline.meta.MetaOutputs`; twice per forward of a GPT stage,
`benchmarks/bench_pipeline_throughput.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from lightning_par.parallel.pipeline.meta import MetaOutputs, meta_copy
from lightning_par.parallel.pipeline.owners import PipelineError

__all__ = ["meta_copy", "shadow"]


def shadow(
    original: nn.Module, name: str, *, before: bool, device: torch.device, why: str, in_trunk: Callable[[], bool]
) -> nn.Module:
    """A stand-in for the unit ``original`` on a stage that does not own it: a meta-device copy of its subtree.

    Its parameters and buffers stay readable as attributes (meta tensors, no storage) but are unregistered, so the
    rank's model holds none of them. Called, a unit of the first stage (``before``) returns zeros of the output's
    shape and dtype on ``device`` (the stage's first block replaces the hidden state with the received activation,
    so only the shapes of what the user's code computes from it matter): the first call with an input signature
    (shapes, dtypes, plain values, train / eval, autocast) runs the copy on the meta device, later ones reuse its
    shapes. A unit of the last stage raises: it cannot run where its weights are not.

    Args:
        original: the unit.
        name: its qualified name (for errors).
        before: it belongs to the first stage (else to the last).
        device: this rank's device.
        why: how its stage was chosen (for errors): `pipeline.owners.Ownership.why`.
        in_trunk: whether the trunk has started in the current run of the user's code.
    """
    copied = meta_copy(original)
    outputs = MetaOutputs(copied, device)

    def run(*args: Any, **kwargs: Any) -> Any:
        if not before or in_trunk():
            now = "after" if in_trunk() else "before"
            raise PipelineError(
                f"{name} belongs to the {'first' if before else 'last'} pipeline stage ({why}) but ran {now} the "
                "trunk here, on a stage that does not hold its weights; give the "
                "LightningModule an example_input_array of a real input, so that the probe sees the real call order"
            )
        return outputs(args, kwargs)

    object.__setattr__(copied, "forward", run)
    object.__setattr__(copied, "_lp_shadow_of", name)
    return copied
