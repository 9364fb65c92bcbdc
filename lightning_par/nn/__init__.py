"""Building blocks a user may put in a model; they run on one device and the strategies know how to shard them.

Nothing here imports from the rest of `lightning_par`, so reference models may import this package alone.
"""

from lightning_par.nn.moe import Experts, MoE, moe_loss

__all__ = ["Experts", "MoE", "moe_loss"]
