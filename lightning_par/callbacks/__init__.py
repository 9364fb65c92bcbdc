"""Lightning callbacks that work with every lightning_par strategy."""

from lightning_par.callbacks.monitor import ParallelismMonitor, peak_flops_for

__all__ = ["ParallelismMonitor", "peak_flops_for"]
