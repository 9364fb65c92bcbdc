"""One layout's prediction: per-GPU memory (parameters, gradients, optimizer state, activations, temporary buffers)
and step time, with throughput and MFU. The composition of `state`, `activations` and `steptime`.

Activations are the peak of `lightning_par.planner.activations` (what a rank holds once its in-flight micro-batches
have run their forward, plus one micro-batch's backward working set: the loss's gradients or a recomputed block).
Temporary buffers are what lives only during a step besides them: under ZeRO-3 the gathered parameters of the
block being computed and of the one prefetched (FSDP2 keeps two in flight), and the ZeRO 0-2 communication buckets
(two of ``bucket_cap_mb`` in flight, the suite's default 25 MB).

PipeDream-2BW (``pp_schedule="2bw"``; Narayanan et al., arXiv 2006.09503) has a line of its own,
``double_buffer``: the second version of each stage's trainable weights and the second gradient buffer its
one-step-late update keeps (`lightning_par.planner.state.StateBytes.double_buffer`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Optional

from lightning_par.parallel.compression.powersgd import compressed_numel
from lightning_par.planner.activations import activation_bytes
from lightning_par.planner.compute import peak_flops
from lightning_par.planner.devices import GIB, Device
from lightning_par.planner.layout import Layout, compute_bytes, stored_bytes
from lightning_par.planner.model import ModelDesc
from lightning_par.planner.params import ParamSpec, specs_from_desc
from lightning_par.planner.state import state_bytes
from lightning_par.planner.steptime import StepTime, step_time

_BUCKET_BYTES = 2 * 25 * 2**20


@dataclasses.dataclass(frozen=True)
class Estimate:
    """A layout's predicted per-GPU memory (bytes) and step time (seconds)."""

    layout: Layout
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    temporary: float
    time: StepTime
    peak: float  # the device's peak FLOP/s at the layout's precision
    host: float = 0.0  # bytes kept in host memory (``offload``: the sharded parameters, gradients and state)
    # PipeDream-2BW (arXiv 2006.09503): the stage's second weight version and gradient buffer; 0 otherwise.
    double_buffer: float = 0.0

    @property
    def total(self) -> float:
        state = self.parameters + self.gradients + self.optimizer + self.double_buffer
        return state + self.activations + self.temporary

    @property
    def mfu(self) -> float:
        return self.time.mfu(self.peak)

    @property
    def tflops_per_gpu(self) -> float:
        return self.time.model_flops / self.time.total / 1e12

    def as_dict(self) -> dict[str, Any]:
        """The ``--json`` object of ``lightning-par estimate``."""
        parts = ("parameters", "gradients", "optimizer", "activations", "temporary", "double_buffer")
        gib = {k: getattr(self, k) / GIB for k in parts}
        gib["total"] = self.total / GIB
        gib["host"] = self.host / GIB
        t = self.time
        return {
            "layout": self.layout.describe(), "strategy": self.layout.strategy_kwargs(),
            "step_time_s": t.total, "tflops_per_gpu": self.tflops_per_gpu, "mfu": self.mfu, "memory_gib": gib,
            "step_time_parts_s": {"compute": t.compute, "tp_comm": t.tp_comm, "pipeline_bubble": t.pipeline_bubble,
                                  "pipeline_p2p": t.pipeline_p2p, "dp_comm_exposed": t.dp_comm_exposed,
                                  "optimizer": t.optimizer},
        }  # fmt: skip


def temporary_bytes(desc: ModelDesc, layout: Layout, seq_len: int) -> float:
    """The step's transient buffers besides activations (module docstring)."""
    el = compute_bytes(layout.precision)
    if layout.zero_stage == 3 and layout.shard_group > 1:
        return 2 * desc.block_params / layout.tp * el
    return _BUCKET_BYTES if layout.dp > 1 else 0


def estimate(
    desc: ModelDesc,
    layout: Layout,
    dev: Device,
    global_batch: int,
    seq_len: int,
    profile: str = "torch",
    specs: Optional[Sequence[ParamSpec]] = None,
) -> Estimate:
    """Predict ``layout``'s memory and step time for ``desc`` on ``dev`` GPUs (checked with `Layout.check` first).

    Args:
        profile: ``"torch"`` (this suite running Hugging Face-style modules) or ``"megatron"`` (Megatron-LM's fused
            kernels and its 18-bytes-per-parameter mixed-precision state), for comparing with published runs.
        specs: the model's parameters (default: synthesised from ``desc``); pass `specs_from_module`'s for a live
            model so that state bytes follow its exact shapes.
    """
    layout.check(desc, layout.world, global_batch, seq_len, suite=profile != "megatron")
    framework = "megatron" if profile == "megatron" else "lightning_par"
    accumulation = layout.m(global_batch) if layout.pp == 1 else 1
    specs = specs if specs is not None else specs_from_desc(desc)
    state = state_bytes(specs, layout, framework=framework, accumulation=accumulation)
    acts = activation_bytes(
        desc, layout, seq_len, profile=profile, dropout=desc.dropout if profile == "torch" else None
    )
    local = state.parameters / (2 if framework == "megatron" else stored_bytes(layout.precision))
    local *= layout.shard_group if layout.zero_stage == 3 else 1
    sent = None
    if layout.powersgd_rank:  # the share of the gradient elements PowerSGD all-reduces
        trained = [s for s in specs if s.trainable]
        sent = compressed_numel([s.shape for s in trained], layout.powersgd_rank) / sum(s.numel for s in trained)
    t = step_time(desc, layout, dev, global_batch, seq_len, profile=profile, local_params=local, dp_sent=sent)
    on_gpu = (0, 0, 0) if layout.offload else (state.parameters, state.gradients, state.optimizer)
    return Estimate(
        layout=layout, parameters=on_gpu[0], gradients=on_gpu[1], optimizer=on_gpu[2], activations=acts.peak,
        temporary=temporary_bytes(desc, layout, seq_len), time=t, peak=peak_flops(dev, layout.precision),
        host=state.total if layout.offload else 0, double_buffer=0 if layout.offload else state.double_buffer,
    )  # fmt: skip
