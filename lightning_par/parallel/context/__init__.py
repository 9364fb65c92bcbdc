"""Context parallelism: the sequence split (`layout`), ring attention (`apply`) and Ulysses all-to-all (`ulysses`)."""

from lightning_par.parallel.context.apply import ContextParallel, apply_context_parallel

__all__ = ["ContextParallel", "apply_context_parallel"]
