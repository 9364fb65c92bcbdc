"""Pictures of the logged step for loggers that take images: memory per rank as stacked bars, expert load as a
heatmap, a pipeline step as a timeline. Plain RGB arrays (height x width x 3, uint8) drawn with Pillow, so any
logger can take them: W&B (`WandbLogger.log_image`) and TensorBoard (`add_image`) are fed by `log_pictures`; the
numbers behind them are logged as metrics too, for loggers without images (CSV).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

MEMORY_KINDS = ("params", "grads", "optim_state")
_COLOURS = ((66, 133, 244), (251, 140, 0), (52, 168, 83))  # one per kind, in MEMORY_KINDS order
_WHITE, _BLACK, _GREY = (255, 255, 255), (0, 0, 0), (200, 200, 200)


def memory_bars(per_rank: Sequence[Sequence[float]]) -> np.ndarray:
    """Stacked bars of each rank's bytes of parameters, gradients and optimizer state (`MEMORY_KINDS` order)."""
    n = len(per_rank)
    bar, gap, left, top, height = 28, 12, 70, 30, 200
    image = Image.new("RGB", (left + n * (bar + gap) + 150, top + height + 40), _WHITE)
    draw = ImageDraw.Draw(image)
    most = max((sum(r) for r in per_rank), default=0.0) or 1.0
    draw.line([(left - 4, top), (left - 4, top + height)], fill=_BLACK)
    draw.text((4, top - 4), f"{most / 2**20:.1f} MiB", fill=_BLACK)
    draw.text((4, top + height - 8), "0", fill=_BLACK)
    for i, row in enumerate(per_rank):
        x, y = left + i * (bar + gap), top + height
        for value, colour in zip(row, _COLOURS):
            h = round(height * value / most)
            if h > 0:
                draw.rectangle([x, y - h, x + bar, y], fill=colour)
            y -= h
        draw.text((x + 4, top + height + 6), f"r{i}", fill=_BLACK)
    legend_x = left + n * (bar + gap) + 10
    for j, (kind, colour) in enumerate(zip(MEMORY_KINDS, _COLOURS)):
        draw.rectangle([legend_x, top + 16 * j, legend_x + 10, top + 16 * j + 10], fill=colour)
        draw.text((legend_x + 16, top + 16 * j - 1), kind, fill=_BLACK)
    return np.asarray(image)


def load_heatmap(loads: Mapping[str, torch.Tensor]) -> np.ndarray:
    """One row per MoE layer, one cell per expert: tokens over the layer's mean, white (0) to red (the largest)."""
    rows = [loads[k].double().cpu() for k in loads]
    cell, left, top = 18, 40, 24
    width = max((len(r) for r in rows), default=1)
    image = Image.new("RGB", (left + width * cell + 10, top + len(rows) * cell + 10), _WHITE)
    draw = ImageDraw.Draw(image)
    ratios = [r / r.mean() if float(r.mean()) > 0 else torch.zeros_like(r) for r in rows]
    most = max((float(r.max()) for r in ratios if len(r)), default=1.0) or 1.0
    draw.text((4, 4), f"load / mean, max {most:.2f}", fill=_BLACK)
    for i, ratio in enumerate(ratios):
        draw.text((4, top + i * cell + 3), str(i), fill=_BLACK)
        for e, value in enumerate(ratio.tolist()):
            fade = round(255 * (1 - value / most))
            x, y = left + e * cell, top + i * cell
            draw.rectangle([x, y, x + cell - 2, y + cell - 2], fill=(255, fade, fade), outline=_GREY)
    return np.asarray(image)


_SPAN_COLOURS = {"F": (66, 133, 244), "B": (52, 168, 83), "I": (52, 168, 83), "W": (251, 140, 0),
                 "wait": (234, 67, 53)}  # fmt: skip


def pipeline_timeline(per_rank: Sequence[Any]) -> np.ndarray:
    """One row per rank of a pipeline step: forward (blue), backward / input gradient (green), weight gradient
    (orange) and waiting on peers (red) over a common time axis; white is time the rank spent elsewhere.

    Args:
        per_rank: each rank's `lightning_par.parallel.pipeline.trace.StepRecord`.
    """
    width, left, top, row = 720, 40, 24, 22
    longest = max((r.duration for r in per_rank), default=0.0) or 1.0
    image = Image.new("RGB", (left + width + 10, top + len(per_rank) * row + 24), _WHITE)
    draw = ImageDraw.Draw(image)
    draw.text((4, 4), f"pipeline step {longest * 1e3:.1f} ms: F blue, B/I green, W orange, wait red", fill=_BLACK)
    for i, record in enumerate(per_rank):
        y = top + i * row
        draw.text((4, y + 4), f"r{i}", fill=_BLACK)
        draw.rectangle([left, y, left + width, y + row - 4], outline=_GREY)
        for span in record.spans:
            x0 = left + round(width * span.start / longest)
            x1 = max(x0 + 1, left + round(width * span.end / longest))
            draw.rectangle([x0, y + 1, x1, y + row - 5], fill=_SPAN_COLOURS[span.kind])
    return np.asarray(image)


def log_pictures(loggers: Sequence[Any], pictures: Mapping[str, np.ndarray], step: int) -> None:
    """Send the pictures to every logger that takes images (W&B, TensorBoard); call on global rank 0.

    Args:
        loggers: ``trainer.loggers``.
        pictures: RGB arrays by key.
        step: the step the loggers' x-axis shows for this optimizer step's metrics.
    """
    from lightning.pytorch.loggers import TensorBoardLogger, WandbLogger

    for logger in loggers:
        if isinstance(logger, WandbLogger):
            import wandb

            # One call: all pictures in one history row (log_image would make one row per key).
            images: dict[str, Any] = {key: wandb.Image(picture) for key, picture in pictures.items()}
            logger.log_metrics(images, step=step)
        elif isinstance(logger, TensorBoardLogger):
            for key, picture in pictures.items():
                logger.experiment.add_image(key, picture, step, dataformats="HWC")
