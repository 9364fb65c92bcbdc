"""Training, evaluation and optimizer logic shared by the reference causal language models.

Plain single-device Lightning code: the parallel strategies must train these models unchanged, so nothing here
may import from `lightning_par`.
"""

import functools
import math
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

Batch = tuple[Tensor, Tensor] | list[Tensor]


def _lr_factor(step: int, warmup_steps: int, max_steps: int) -> float:
    if step < warmup_steps:
        # (step + 1) so the first optimizer step does not run at lr 0.
        return (step + 1) / warmup_steps
    if max_steps == 0:
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, max_steps - warmup_steps))
    # Cosine from 1.0 down to a 0.1 floor, as in nanoGPT's min_lr = lr / 10.
    return 0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress))


class CausalLM(L.LightningModule):
    """Base class for next-token-prediction models trained on `(x, y)` batches of int64 token ids.

    Subclasses build the network, define `forward(idx) -> logits (B, T, vocab)`, set `n_layers`, `hidden_size`
    and `seq_len` (a throughput monitor reads them for the attention FLOPs term), and call
    `self.save_hyperparameters()`.

    Args:
        vocab_size: Number of token ids; also the class count of the validation accuracy.
        lr: Peak AdamW learning rate.
        weight_decay: AdamW weight decay, applied only to parameters with `dim() >= 2` (matrices, embeddings).
        warmup_steps: Optimizer steps of linear warmup from `lr / warmup_steps` to `lr`.
        max_steps: 0 keeps `lr` constant after warmup; otherwise cosine decay to `0.1 * lr` at `max_steps`.
        betas: AdamW betas.
    """

    n_layers: int
    hidden_size: int
    seq_len: int

    def __init__(
        self,
        vocab_size: int,
        lr: float,
        weight_decay: float,
        warmup_steps: int,
        max_steps: int,
        betas: tuple[float, float],
    ) -> None:
        super().__init__()
        if warmup_steps < 0 or max_steps < 0:
            raise ValueError(f"warmup_steps={warmup_steps} and max_steps={max_steps} must be >= 0")
        if max_steps and max_steps <= warmup_steps:
            raise ValueError(
                f"max_steps={max_steps} must exceed warmup_steps={warmup_steps}; pass max_steps=0 for a constant lr"
            )
        self.vocab_size = vocab_size
        self.lr = lr
        self.weight_decay = weight_decay
        self.warmup_steps = warmup_steps
        self.max_steps = max_steps
        self.betas = (float(betas[0]), float(betas[1]))
        self.val_acc = MulticlassAccuracy(num_classes=vocab_size, average="micro")

    def _loss(self, logits: Tensor, targets: Tensor) -> Tensor:
        # Upcast so bf16-true training does not take log-softmax in bf16; a no-op in fp32 and under autocast.
        return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())

    def training_step(self, batch: Batch, batch_idx: int) -> Tensor:
        x, y = batch
        loss = self._loss(self(x), y)
        # sync_dist costs one all-reduce per step; it makes the logged value the global-batch loss.
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.log("val_loss", self._loss(logits, y), prog_bar=True, sync_dist=True)
        self.val_acc(logits.argmax(-1).flatten(), y.flatten())
        self.log("val_acc", self.val_acc)

    def test_step(self, batch: Batch, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", self._loss(self(x), y), sync_dist=True)

    def predict_step(self, batch: Batch | Tensor, batch_idx: int) -> Tensor:
        x = batch if isinstance(batch, Tensor) else batch[0]
        return self(x).argmax(-1)

    def configure_optimizers(self) -> Any:
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": self.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.lr, betas=self.betas)
        factor = functools.partial(_lr_factor, warmup_steps=self.warmup_steps, max_steps=self.max_steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    @torch.no_grad()
    def generate(self, idx: Tensor, max_new_tokens: int, temperature: float = 1.0) -> Tensor:
        """Extend token sequences autoregressively.

        Re-runs the full context for every new token (no KV cache): O(max_new_tokens * seq_len) work, fine for a
        demo, not for serving.

        Args:
            idx: Prompt token ids, shape (B, T).
            max_new_tokens: Number of tokens to append.
            temperature: Softmax temperature for sampling; 0 picks the argmax (greedy).

        Returns:
            Token ids of shape (B, T + max_new_tokens); the context fed to the model is the last `seq_len` of them.
        """
        was_training = self.training
        self.eval()  # dropout off while sampling
        try:
            for _ in range(max_new_tokens):
                logits = self(idx[:, -self.seq_len :])[:, -1, :].float()
                if temperature == 0:
                    nxt = logits.argmax(-1, keepdim=True)
                else:
                    nxt = torch.multinomial(F.softmax(logits / temperature, dim=-1), num_samples=1)
                idx = torch.cat([idx, nxt], dim=1)
        finally:
            self.train(was_training)
        return idx
