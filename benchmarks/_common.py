"""Shared by the benchmark scripts (run as `torchrun ... benchmarks/<script>.py`, so this directory is on the path)."""

from __future__ import annotations

import os
import sys

import torch.distributed as dist


def clean_exit() -> None:
    """End a rank: barrier, destroy the process group, flush, then `os._exit(0)`.

    CPU_FACTS.md: gloo ranks sometimes abort at interpreter exit after the work is done ("terminate called
    without an active exception"); leaving through `os._exit` after an orderly teardown avoided it in 46 of 46 runs.
    """
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
