"""Model introspection every technique shares: the trunk of repeated blocks (`trunk`) and the probe forward that
records who reads whom inside a block (`_probe`). No process group, no Lightning."""

from lightning_par.blocks.trunk import Trunk, find_trunk

__all__ = ["Trunk", "find_trunk"]
