"""`torch.compile` per trunk block, the torchtitan way: one compiled region per repeated block.

Compiling the blocks rather than the whole model keeps compile time small (every block runs the same code, so the
first one's graph serves the others: with torch's default ``inline_inbuilt_nn_modules`` a block's parameters are
graph inputs, not constants), and leaves the code around the trunk (embeddings, the head, the user's
``training_step`` with its ``self.log``) eager, where data-dependent Python is harmless.

What is compiled is the block's ``forward``, replaced on the instance like activation checkpointing does, not the
module (``nn.Module.compile()`` would compile ``_call_impl``, hooks included). So:

- parameter and buffer names do not change (no ``_orig_mod.`` prefix): checkpoints load across compiled and eager
  runs and every layout;
- the hooks registered on the block itself stay outside the compiled region, as on torchtitan's ``OptimizedModule``
  that ``fully_shard`` wraps: FSDP2's gather / reshard, the pipeline's stage cut, context parallelism's sequence
  cuts; tensor parallelism's DTensor redistributions on the block's Linears are inside and traced;
- activation checkpointing's wrapper (applied first) is inside, so the recomputation is compiled too.

Code dynamo cannot trace (an MoE layer's ``.tolist()`` over expert counts, a collective in a hook) is a graph break:
that part runs eagerly and the results are unchanged. Nothing here asks for ``fullgraph=True``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn


def apply_compile(blocks: Sequence[nn.Module], *, backend: str = "inductor", options: Optional[dict] = None) -> int:
    """Compile each block's ``forward`` in place with `torch.compile`.

    Args:
        blocks: the trunk's blocks (of every part this rank runs), after activation checkpointing and tensor
            parallelism changed them and before FSDP2 shards them.
        backend: the `torch.compile` backend (``"inductor"``; ``"aot_eager"`` to test without code generation).
        options: `torch.compile`'s ``options`` (e.g. ``{"max_autotune": True}``).

    Returns:
        the number of blocks compiled (a block compiled before is left as it is).
    """
    done = 0
    for block in blocks:
        if getattr(block, "_lp_compiled", False):
            continue
        forward = block.forward  # the block's own, or the wrapper activation checkpointing installed

        def run(*args: Any, _forward: Any = forward, **kwargs: Any) -> Any:
            return _forward(*args, **kwargs)

        block.forward = torch.compile(run, backend=backend, options=options)  # type: ignore[method-assign]
        block._lp_compiled = True  # type: ignore[assignment]
        done += 1
    return done
