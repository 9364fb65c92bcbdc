"""Reference single-device models that the parallel strategies train unchanged.

Nothing in this package imports from `lightning_par`: a model that needs the strategy code to run is not a
reference.
"""

from .gpt import GPT
from .hf import HFCausalLM
from .llama import Llama
from .moe_gpt import MoEGPT

__all__ = ["GPT", "HFCausalLM", "Llama", "MoEGPT"]
