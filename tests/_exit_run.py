"""A short fit that ends as a user's script does, by leaving the interpreter (tests/test_clean_exit.py).

Its first act registers an ``atexit`` handler, so that it runs after every handler registered later (the strategy's):
the handler writes whether the process group was still alive into ``exit_<rank>.txt``. argv: strategy name, model
(``cohere``: a Hugging Face Cohere built from a config; ``gpt``; ``moe_gpt``), output folder.
"""

from __future__ import annotations

import atexit
import os
import sys
from pathlib import Path

import torch.distributed as dist

OUT = Path(sys.argv[3])


def _record() -> None:
    alive = dist.is_available() and dist.is_initialized()
    (OUT / f"exit_{os.environ.get('RANK', '0')}.txt").write_text("alive" if alive else "destroyed")


atexit.register(_record)

import lightning as L  # noqa: E402
import torch  # noqa: E402

import lightning_par  # noqa: E402, F401  (registers the names)
from lightning_par.data import ByteTextDataModule  # noqa: E402
from lightning_par.models import GPT, MoEGPT  # noqa: E402


class Cohere(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM, CohereConfig

        config = CohereConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
        self.model = AutoModelForCausalLM.from_config(config)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], i: int) -> torch.Tensor:
        x, y = batch
        logits = self.model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    strategy, model = sys.argv[1], sys.argv[2]
    L.seed_everything(0)
    module = {"cohere": Cohere, "gpt": lambda: GPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32),
              "moe_gpt": lambda: MoEGPT(vocab_size=256, block_size=32, n_layer=2, n_head=4, n_embd=32,
                                        n_experts=4)}[model]()  # fmt: skip
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["WORLD_SIZE"]), strategy=strategy, max_steps=3,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)  # fmt: skip
    trainer.fit(module, datamodule=ByteTextDataModule(seq_len=32, batch_size=4, num_samples=64))


if __name__ == "__main__":
    main()
