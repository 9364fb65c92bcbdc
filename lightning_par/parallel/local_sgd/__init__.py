"""Local SGD / DiLoCo: the outer synchronisation (`outer`) and its state in checkpoints (`state`)."""

from lightning_par.parallel.local_sgd.outer import LocalSGD, OuterSync

__all__ = ["LocalSGD", "OuterSync"]
