"""`HFCausalLM`: any Hugging Face causal language model, from a local folder, as a `CausalLM` (fine-tuning recipes).

The network is built from the folder's ``config.json`` in ``configure_model()``, Lightning's hook for models larger
than one device: under this suite's strategies it is built on the meta device and each rank creates or reads only
its part; the weights come from the strategy's ``pretrained=`` (the same folder's safetensors, read into any
layout). Under a plain Trainer it is built whole; load weights there with ``from_pretrained`` instead. Nothing is
downloaded: ``config`` is a path. Needs ``transformers`` (``pip install transformers``).
"""

from __future__ import annotations

from typing import Any, Optional

from torch import Tensor, nn

from ._lm import CausalLM


class HFCausalLM(CausalLM):
    """A Hugging Face ``AutoModelForCausalLM`` built from a local config, trained on ``(x, y)`` token batches.

    Args:
        config: a folder holding ``config.json`` (a downloaded snapshot, or what ``save_pretrained`` wrote), or the
            path of a ``config.json`` file.
        attn_implementation: ``"sdpa"`` (context parallelism needs it), ``"eager"``, or another the model offers.
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay for parameters with ``dim() >= 2``.
        warmup_steps: Linear-warmup optimizer steps.
        max_steps: 0 keeps ``lr`` constant after warmup; otherwise cosine decay to ``0.1 * lr`` at ``max_steps``.
        betas: AdamW betas.
        lora: fine-tune low-rank adapters instead of every weight: ``peft.LoraConfig`` arguments (``r``,
            ``lora_alpha``, ``target_modules``, ...), applied with ``peft.get_peft_model`` in ``configure_model()``;
            the base weights are frozen and come from the strategy's ``pretrained=`` (docs/fine_tuning.md). Needs
            ``pip install peft``.
    """

    def __init__(
        self,
        config: str,
        attn_implementation: str = "sdpa",
        lr: float = 2e-5,
        weight_decay: float = 0.0,
        warmup_steps: int = 0,
        max_steps: int = 0,
        betas: tuple[float, float] = (0.9, 0.95),
        lora: Optional[dict[str, Any]] = None,
    ) -> None:
        from transformers import AutoConfig

        hf_config = AutoConfig.from_pretrained(config)
        super().__init__(hf_config.vocab_size, lr, weight_decay, warmup_steps, max_steps, betas)
        self.save_hyperparameters()
        self.hf_config = hf_config
        self.attn_implementation = attn_implementation
        self.n_layers = int(hf_config.num_hidden_layers)
        self.hidden_size = int(hf_config.hidden_size)
        self.seq_len = int(getattr(hf_config, "max_position_embeddings", 0) or 0)
        self.lora = dict(lora) if lora else None
        self.model: Optional[nn.Module] = None

    def configure_model(self) -> None:
        if self.model is not None:  # Lightning calls the hook again for validate / test after fit
            return
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_config(self.hf_config, attn_implementation=self.attn_implementation)
        if self.lora:
            from peft import LoraConfig, get_peft_model

            self.model = get_peft_model(self.model, LoraConfig(**self.lora))

    def forward(self, tokens: Tensor) -> Tensor:
        """Next-token logits of shape (B, T, vocab_size) for token ids of shape (B, T)."""
        if self.model is None:
            raise RuntimeError("HFCausalLM has no network yet: Lightning builds it in configure_model() at fit start")
        out: Any = self.model(input_ids=tokens)
        return out.logits
