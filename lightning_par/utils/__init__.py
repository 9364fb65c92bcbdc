"""Small helpers shared by the package, its tests and benchmarks."""

from lightning_par.utils.memory import LiveStorageBytes
from lightning_par.utils.process import clean_exit

__all__ = ["LiveStorageBytes", "clean_exit"]
