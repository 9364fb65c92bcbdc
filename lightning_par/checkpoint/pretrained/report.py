"""What `lightning_par.checkpoint.pretrained.load.load_pretrained` did on a rank: one start-up log line."""

from __future__ import annotations

import dataclasses

from lightning_par.checkpoint.pretrained.names import PrefixRewrite, listing


@dataclasses.dataclass(frozen=True)
class PretrainedReport:
    """What `load_pretrained` did on this rank; ``str()`` is one start-up log line.

    Args:
        path: the checkpoint read.
        format: its format (``hf``, ``hf-sharded``, ``safetensors``, ``torch``, ``dcp``) and file count.
        rewrite: the prefix rewrite that maps the module's names to the file's keys.
        tensors: views filled on this rank (tied names included).
        bytes_read: bytes of tensor data this rank read from the file (for DCP: asked DCP for).
        ignored: file keys skipped on purpose (recomputed buffers such as ``rotary_emb.inv_freq``).
        tied: module names missing from the file, filled through the tensor they are tied to.
        skipped: with ``strict=False``: module names missing from the file (left as they were) and file keys that
            matched nothing.
        seconds: wall time of the load on this rank.
        fresh: low-rank adapter tensors the file does not hold, which keep their own initial values.
    """

    path: str
    format: str
    rewrite: PrefixRewrite
    tensors: int
    bytes_read: int
    ignored: tuple[str, ...] = ()
    tied: tuple[str, ...] = ()
    skipped: tuple[str, ...] = ()
    seconds: float = 0.0
    fresh: int = 0

    def __str__(self) -> str:
        line = (
            f"pretrained weights: {self.tensors} tensors from {self.path} ({self.format}); names: {self.rewrite}; "
            f"{_size(self.bytes_read)} read on this rank in {self.seconds:.1f} s"
        )
        if self.tied:
            line += f"; tied: {listing(list(self.tied), 3)}"
        if self.ignored:
            line += f"; ignored {len(self.ignored)} recomputed buffer(s) ({listing(list(self.ignored), 2)})"
        if self.fresh:
            line += f"; {self.fresh} adapter tensor(s) keep their initial values"
        if self.skipped:
            line += f"; strict=False skipped {len(self.skipped)} ({listing(list(self.skipped), 3)})"
        return line


def _size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
