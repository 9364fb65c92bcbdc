"""``trainer.fit(torch.compile(model))`` under our strategies: the compiled model becomes ``compile=True``.

Lightning unwraps the ``OptimizedModule`` (`lightning.pytorch.utilities.compile.from_compiled`: the module's
``forward`` and ``*_step`` methods wrapped in dynamo's context) and then accepts it only under its single-device,
DDP and FSDP strategies. Here the same request is served the torchtitan way: the wrappers are removed
(`to_uncompiled`) and each trunk block is compiled (`lightning_par.parallel.compile`), so the user's
``training_step`` runs eagerly (``self.log`` included), and the pipeline, tensor parallelism and ZeRO keep their
hooks outside the compiled regions.
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch.utilities.compile import to_uncompiled
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_par import _compat
from lightning_par.config import ParallelConfig, ParallelConfigError


def take_compiled(module: Any, config: ParallelConfig, refusal: Optional[str] = None) -> Any:
    """Return ``module`` uncompiled, with ``config.compile`` set, when Lightning marked it compiled; else as it is.

    Args:
        module: what the trainer hands the strategy (a LightningModule, or ``None``).
        config: the strategy's configuration, changed in place.
        refusal: why this strategy cannot compile its blocks (DeepSpeed); the compiled model is then refused.
    """
    if _compat.compiled_context(module) is None:
        return module
    if refusal is not None:
        raise ParallelConfigError(f"a torch.compile'd model cannot be trained here: {refusal}")
    to_uncompiled(module)
    if not config.compile:
        config.compile = True
        rank_zero_info(
            "lightning_par: the model was torch.compile'd; compiling each trunk block instead (compile=True), with "
            "training_step eager; pass the plain model and compile=True to say so yourself"
        )
    return module
