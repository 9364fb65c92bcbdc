"""ZeRO: stage 3 through FSDP2 (`fsdp`), stages 0-2 through the replicated engine (`replicated`, with its
buckets, prefetch, whole-parameter and local-view pieces)."""

from lightning_par.parallel.zero.fsdp import apply_fsdp
from lightning_par.parallel.zero.replicated import ReplicatedZero

__all__ = ["ReplicatedZero", "apply_fsdp"]
