"""Activation checkpointing of trunk blocks: trade recomputation (or host memory) for activation memory.

Modes, per block:

- ``"full"``: recompute the whole block in backward; only its input is kept. One extra forward of every block
  (~33% more compute).
- ``"selective"``: the same for every k-th block only (less memory saved, less recomputation).
- ``"selective_op"``: op-level selective checkpointing (the policy of torchtitan's op-level SAC): every block is
  checkpointed, but the outputs of matmuls and attention are saved; only the cheap element-wise ops (norms,
  activations, rotary embeddings, residual adds) are recomputed. Memory between "none" and "full", almost no
  extra FLOPs.
- ``"offload"``: nothing is recomputed; the tensors a block saves for backward are copied to host memory during
  the forward and back ahead of the block's backward, on a side stream (`lightning_par.parallel.activation_offload`);
  every block, or the first ``count`` (``offload_blocks``). On CPU-only hosts the mode runs but saves nothing.

The block's ``forward`` is replaced on the instance rather than wrapping the module, so parameter names (and
therefore checkpoints) do not change, and hooks registered on the module (FSDP2's) stay outside the wrapped
region.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import Any, Optional

import torch
from torch import nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from lightning_par import _compat
from lightning_par.parallel.activation_offload import ActivationOffload

MODES = ("full", "selective", "selective_op", "offload")


def _ops(*names: str, namespace: Any = torch.ops.aten) -> frozenset[Any]:
    # Build-dependent kernels (cuDNN, fused-overrideable attention) may be missing from a torch build.
    return frozenset(getattr(namespace, n).default for n in names if hasattr(namespace, n))


# Ops whose outputs "selective_op" keeps: the ones whose recomputation costs FLOPs. They are what reaches the
# dispatcher: aten.linear and aten.matmul are CompositeImplicitAutograd and arrive here as mm / addmm / bmm, and
# F.scaled_dot_product_attention as the kernel it picked (on CPU, _scaled_dot_product_flash_attention_for_cpu;
# the math fallback used with dropout or odd masks arrives as bmm + softmax). The reduce-scatter is tensor
# parallelism's output collective: recomputing it would repeat communication. torchtitan's list is the same
# except that it also recomputes every second mm to save more memory.
SAVE_OPS = _ops(
    "mm",
    "addmm",
    "bmm",
    "baddbmm",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
) | _ops("reduce_scatter_tensor", namespace=_compat.c10d_functional_ops())


def op_policy(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """The ``"selective_op"`` policy for `torch.utils.checkpoint.create_selective_checkpoint_contexts`.

    Args:
        ctx: the `SelectiveCheckpointContext` (unused: the decision depends on the op only).
        op: the aten op about to be saved or recomputed.
        args, kwargs: the op's arguments (unused).

    Returns:
        ``MUST_SAVE`` for matmuls, attention and reduce-scatter (`SAVE_OPS`), ``PREFER_RECOMPUTE`` otherwise.
    """
    return CheckpointPolicy.MUST_SAVE if op in SAVE_OPS else CheckpointPolicy.PREFER_RECOMPUTE


_recomputing = 0  # blocks being recomputed right now (nested checkpoints count each)


def recomputing() -> bool:
    """Whether a block checkpointed here is being recomputed in backward (not a forward of the step).

    Observers that count per forward (the expert-load statistics of `lightning_par.callbacks.ParallelismMonitor`)
    skip these replays, which would otherwise count every checkpointed forward twice.
    """
    return _recomputing > 0


class _marking_recompute:
    """Counts a recomputation while it runs. A class, not a generator: it is re-entered when one forward's block is
    recomputed twice (the zero-bubble schedules' input and weight passes each unpack its saved tensors)."""

    def __init__(self, inner: Any = None) -> None:
        self.inner = inner

    def __enter__(self) -> None:
        global _recomputing
        _recomputing += 1
        if self.inner is not None:
            self.inner.__enter__()

    def __exit__(self, *exc: Any) -> Any:
        global _recomputing
        try:
            return self.inner.__exit__(*exc) if self.inner is not None else None
        finally:
            _recomputing -= 1


def _plain_contexts() -> tuple[Any, Any]:
    return contextlib.nullcontext(), _marking_recompute()


def _checkpointed(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # Non-reentrant: works with keyword arguments, inputs that do not require grad and FSDP2's hooks.
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_plain_contexts, **kwargs)


def _sac_contexts() -> tuple[Any, Any]:
    # A fresh pair per call: the pair holds this forward's saved outputs until its backward.
    forward, recompute = create_selective_checkpoint_contexts(op_policy)
    return forward, _marking_recompute(recompute)


def _checkpointed_compiled(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # Under torch.compile (`lightning_par.parallel.compile`): dynamo accepts the default context_fn and selective
    # checkpointing's dispatch modes only, so no recomputation is marked (`recomputing` stays False).
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _checkpointed_op_level_compiled(forward: Any, *args: Any, **kwargs: Any) -> Any:
    contexts = functools.partial(create_selective_checkpoint_contexts, op_policy)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _checkpointed_op_level(forward: Any, *args: Any, **kwargs: Any) -> Any:
    # Saved outputs must not be modified in place afterwards (torch checks it and raises in backward).
    return checkpoint(forward, *args, use_reentrant=False, context_fn=_sac_contexts, **kwargs)


def _no_cache_while_recomputing(model: nn.Module, blocks: Sequence[nn.Module]) -> None:
    # A block that writes a key/value cache in training writes it again when recomputed, so the replay attends over
    # twice the keys (op-level checkpointing then fails in backward: "not found in storage"). Models that build such
    # a cache declare a boolean `gradient_checkpointing` switch on the modules that loop over the blocks (the
    # Hugging Face convention: with it on and training, `use_cache` becomes False); turning it on there, never on
    # the blocks (their own switch would checkpoint them a second time), makes them build none.
    inside = {id(m) for b in blocks for m in b.modules()}
    for m in model.modules():
        if id(m) not in inside and isinstance(getattr(m, "gradient_checkpointing", None), bool):
            below = {id(c) for c in m.modules()}
            if any(id(b) in below for b in blocks):
                m.gradient_checkpointing = True  # type: ignore[assignment]


def apply_activation_checkpointing(
    blocks: Sequence[nn.Module],
    mode: Optional[str],
    every: int = 2,
    model: Optional[nn.Module] = None,
    *,
    compiled: bool = False,
    count: Optional[int] = None,
) -> list[int]:
    """Checkpoint (or offload the activations of) ``blocks`` in place.

    Args:
        blocks: the trunk's blocks in order.
        mode: ``None`` (nothing), ``"full"`` (every block), ``"selective"`` (every ``every``-th block, starting
            with the first), ``"selective_op"`` (every block, keeping matmul and attention outputs) or
            ``"offload"`` (every block's saved tensors in CPU memory).
        every: the period for ``"selective"``; ignored by the other modes.
        model: the whole model, when it is known: a recomputing mode turns on the ``gradient_checkpointing``
            switch of the modules around the blocks that declare one (Hugging Face models: no key/value cache is
            built in training, which a recomputed block would fill twice).
        count: under ``"offload"``, offload the first ``count`` blocks only (``None``: every block).
        compiled: the blocks are compiled next (`lightning_par.parallel.compile`): checkpoint without the
            recomputation marker, which dynamo cannot trace (`recomputing` then stays False, so the expert-load
            statistics of a checkpointed MoE block also count its recomputation).

    Returns:
        indices of the blocks the mode was applied to.
    """
    if mode is None:
        return []
    if mode not in MODES:
        raise ValueError(f"activation checkpointing mode {mode!r} is unknown; choose None or one of {MODES}")
    period = every if mode == "selective" else 1
    picked = [i for i in range(len(blocks)) if i % period == 0]
    if mode == "offload" and count is not None:
        picked = picked[:count]
    offload = ActivationOffload() if mode == "offload" else None
    for i in picked:
        block = blocks[i]
        if getattr(block, "_lp_checkpointed", None):
            continue
        if offload is not None:
            wrapped = offload.wrap(i, block, block.forward)
        elif mode == "selective_op":
            op_level = _checkpointed_op_level_compiled if compiled else _checkpointed_op_level
            wrapped = functools.partial(op_level, block.forward)
        else:
            wrapped = functools.partial(_checkpointed_compiled if compiled else _checkpointed, block.forward)
        block.forward = wrapped  # type: ignore[method-assign]
        block._lp_checkpointed = mode  # type: ignore[assignment]
    if model is not None and mode != "offload":
        _no_cache_while_recomputing(model, [blocks[i] for i in picked])
    return picked
