"""gpu_check.py section (7): fp8 training's step time on the 1 B Llama, against bf16, both compiled under zero3.

torchtitan's comparison is compile against compile + float8 (Llama-3.1-8B on 8 H100: 6,667 against 8,532
tokens/s/GPU, +28 %); here at world 1, so ZeRO-3 gathers nothing and the ratio is the GEMMs' and casts' alone.
``fp8=True`` where the device has fp8 tensor cores (compute capability >= 8.9), else ``"emulate"`` (then the ratio
says what the emulation costs, not what fp8 gains). Smoke runs (CPU) stay eager: compiling is what costs there.
Rounds alternate the order; the ratio is the median of the per-round ratios.
"""

from __future__ import annotations

import statistics
from typing import Any, Union

import torch
from _gpu_fits import LLAMA_1B, LLAMA_SMOKE, fit, tokens
from _gpu_speed import _released

import lightning_par
from lightning_par.models import Llama


def fp8_speed(accelerator: str, smoke: bool, rounds: int) -> dict[str, Any]:
    """Step time of zero3 (compiled) in bf16-mixed against the same with ``fp8``, and each run's last loss."""
    config = LLAMA_SMOKE if smoke else LLAMA_1B
    batch, warmup, timed = (2, 1, 2) if smoke else (4, 3, 8)
    data = tokens(batch * (warmup + timed), config["max_seq_len"], config["vocab_size"])
    capable = accelerator == "cuda" and torch.cuda.get_device_capability() >= (8, 9)
    mode: Union[bool, str] = True if capable else "emulate"

    def variant(fp8: Union[bool, str]) -> Any:
        def run() -> tuple[list[float], float]:
            strategy = lightning_par.ParallelStrategy(zero_stage=3, compile=not smoke, fp8=fp8)
            rec = fit(lambda: Llama(**config), strategy, data, batch=batch, steps=warmup + timed,
                      accelerator=accelerator, precision="bf16-mixed")[0]  # fmt: skip
            return rec.step_s, rec.losses[-1]

        return _released(run)

    variants = {"bf16": variant(False), "fp8": variant(mode)}
    steps: dict[str, list[float]] = {k: [] for k in variants}
    last: dict[str, float] = {}
    for r in range(rounds):
        for name in variants if r % 2 == 0 else reversed(list(variants)):
            times, last[name] = variants[name]()
            steps[name].append(statistics.median(times[warmup:]))
    ratios = [a / b for a, b in zip(steps["fp8"], steps["bf16"])]
    rows = [{"variant": k, "step_s": statistics.median(v), "last_loss": last[k]} for k, v in steps.items()]
    return {"rows": rows, "fp8": mode, "compiled": not smoke, "fp8_over_bf16": statistics.median(ratios),
            "range": [min(ratios), max(ratios)], "rounds": rounds}  # fmt: skip
