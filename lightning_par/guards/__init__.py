"""Checks that a run is still the run it should be: replicas that must agree (`check_replicas`)."""

from lightning_par.guards.replicas import ReplicasDiverged, check_replicas

__all__ = ["ReplicasDiverged", "check_replicas"]
