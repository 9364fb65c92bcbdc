"""Model introspection without process groups: find the trunk of repeated blocks (more plans land later)."""

from lightning_par.plans.trunk import Trunk, find_trunk

__all__ = ["Trunk", "find_trunk"]
