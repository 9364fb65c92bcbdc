"""A user LM with a recurrent-depth core (Huginn's and Dory's pattern, written plainly): a prelude block, one core
block run several times, each run re-injecting the embedding's output, and a coda block, all three of one class in
one ``nn.ModuleList``. Nothing here knows about the strategies.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from _job_models import _TinyLM
from torch import Tensor, nn


class _Block(nn.Module):
    """A pre-norm residual MLP; given ``inject``, it adds it to its input first (the core's input injection)."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up, self.down = nn.Linear(d, 2 * d), nn.Linear(2 * d, d)

    def forward(self, h: Tensor, inject: Optional[Tensor] = None) -> Tensor:
        h = h if inject is None else h + inject
        return h + self.down(nn.functional.gelu(self.up(self.norm(h))))


class LoopedLM(_TinyLM):
    """Blocks 0 (prelude), 1 (core, run ``loops`` times) and 2 (coda): the calls ``[0, 1, 1, 1, 2]``.

    Args:
        loops: runs of the core per forward.
        train_loops: runs of the core in training mode, when they differ (a forward that changes its depth while
            training: the probe, in eval mode, sees ``loops``).
    """

    def __init__(self, loops: int = 3, train_loops: Optional[int] = None) -> None:
        super().__init__()
        self.loops, self.train_loops = loops, train_loops if train_loops is not None else loops
        self.emb = nn.Embedding(256, 32)
        self.blocks = nn.ModuleList(_Block(32) for _ in range(3))
        self.norm, self.head = nn.LayerNorm(32), nn.Linear(32, 256)

    def forward(self, x: Tensor) -> Tensor:
        e = self.emb(x)
        h = self.blocks[0](e)
        for _ in range(self.train_loops if self.training else self.loops):
            h = self.blocks[1](h, e)
        return self.head(self.norm(self.blocks[2](h)))

    def configure_optimizers(self) -> Any:
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)
