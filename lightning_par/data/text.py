"""Byte-level language-modelling data over a small bundled public-domain corpus.

`corpus.txt` is transcribed from public-domain works (details in CORPUS.md): Shakespeare's sonnets and speeches
from the plays, passages of the King James Bible (1611), the Declaration of Independence (1776), and Lincoln's
Gettysburg Address (1863) and Second Inaugural Address (1865).
"""

from importlib import resources

import lightning as L
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset, Subset

VOCAB_SIZE = 256  # one token per byte of UTF-8
_PREDICT_BATCHES = 4


def load_text() -> str:
    """Return the bundled corpus (about 70 KB of English, mostly ASCII)."""
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def encode(text: str) -> Tensor:
    """UTF-8 bytes of `text` as an int64 tensor of ids in [0, 256)."""
    return torch.frombuffer(bytearray(text.encode("utf-8")), dtype=torch.uint8).long()


def decode(tokens: Tensor) -> str:
    """Inverse of `encode`; byte sequences that are not valid UTF-8 become U+FFFD."""
    return bytes(tokens.flatten().tolist()).decode("utf-8", errors="replace")


class _Windows(Dataset[tuple[Tensor, Tensor]]):
    """Non-overlapping windows `x = tokens[s:s+T]`, `y = tokens[s+1:s+T+1]`, visited in a fixed `order`."""

    def __init__(self, tokens: Tensor, seq_len: int, order: Tensor) -> None:
        self.tokens, self.seq_len, self.order = tokens, seq_len, order

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        start = int(self.order[i]) * self.seq_len
        chunk = self.tokens[start : start + self.seq_len + 1]
        return chunk[:-1], chunk[1:]


def _n_windows(tokens: Tensor, seq_len: int) -> int:
    return (len(tokens) - 1) // seq_len  # -1: the last window's target needs one token past it


class ByteTextDataModule(L.LightningDataModule):
    """Next-byte prediction on the bundled corpus; the first `1 - val_fraction` of the text trains.

    The training loader keeps a sequential sampler and any shuffling is a fixed permutation inside the dataset.
    Under a distributed strategy (this suite's at any world size, Lightning's DDP) Lightning replaces that sampler
    with `DistributedSampler(shuffle=True, seed=0)`: each epoch visits the windows in that sampler's seeded order,
    the same on every rank, and rank r of n data-parallel ranks reads positions r, r + n, r + 2n, ... of it. At every
    step the union of the n per-rank batches is exactly the batch of size `n * batch_size` that one process reading
    the dataset in that order would see, which is what the parity tests compare against. For exact parity on the
    last step, make the sample count a multiple of `n * batch_size` (see `num_samples`).

    Args:
        seq_len: Tokens per sample; must not exceed the model's context length.
        batch_size: Samples per batch per process (Lightning's convention); the global batch is
            `batch_size * data-parallel world size`.
        val_fraction: Fraction of the text, taken from its end, held out for validation, test and predict.
        num_samples: Cap on training samples (after shuffling), for quick tests; None uses all windows.
        shuffle: Visit training windows in a seeded random order instead of text order.
        seed: Seed of the shuffling permutation; independent of the global RNG.
        num_workers: DataLoader worker processes.
    """

    def __init__(
        self,
        seq_len: int = 64,
        batch_size: int = 8,
        val_fraction: float = 0.1,
        num_samples: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        num_workers: int = 0,
    ) -> None:
        super().__init__()
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction={val_fraction} must lie strictly between 0 and 1, e.g. 0.1")
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"num_samples={num_samples} must be >= 1, or None for every window")
        self.save_hyperparameters()
        self.seq_len = seq_len
        self.batch_size = batch_size
        self.val_fraction = val_fraction
        self.num_samples = num_samples
        self.shuffle = shuffle
        self.seed = seed
        self.num_workers = num_workers
        self._train: _Windows | None = None
        self._val: _Windows | None = None

    def setup(self, stage: str | None = None) -> None:
        if self._train is not None:
            return
        tokens = encode(load_text())
        split = int(len(tokens) * (1.0 - self.val_fraction))
        train_tokens, val_tokens = tokens[:split], tokens[split:]
        n_train, n_val = _n_windows(train_tokens, self.seq_len), _n_windows(val_tokens, self.seq_len)
        if n_train < 1 or n_val < 1:
            raise ValueError(
                f"seq_len={self.seq_len} leaves {n_train} train / {n_val} val windows in a {len(tokens)}-byte "
                f"corpus with val_fraction={self.val_fraction}; lower seq_len or adjust val_fraction"
            )
        if self.shuffle:
            order = torch.randperm(n_train, generator=torch.Generator().manual_seed(self.seed))
        else:
            order = torch.arange(n_train)
        self._train = _Windows(train_tokens, self.seq_len, order[: self.num_samples])
        self._val = _Windows(val_tokens, self.seq_len, torch.arange(n_val))

    def _loader(self, dataset: Dataset[tuple[Tensor, Tensor]], drop_last: bool) -> DataLoader[tuple[Tensor, Tensor]]:
        # shuffle=False everywhere: the order is fixed by the dataset so distributed sampling stays a pure split.
        return DataLoader(
            dataset, batch_size=self.batch_size, shuffle=False, drop_last=drop_last, num_workers=self.num_workers
        )

    def _splits(self) -> tuple[_Windows, _Windows]:
        self.setup()
        assert self._train is not None and self._val is not None
        return self._train, self._val

    def train_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        # drop_last keeps every step at full batch: fixed shapes, and no ragged step to break parity.
        return self._loader(self._splits()[0], drop_last=True)

    def val_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader(self._splits()[1], drop_last=False)

    def test_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        return self._loader(self._splits()[1], drop_last=False)

    def predict_dataloader(self) -> DataLoader[tuple[Tensor, Tensor]]:
        val = self._splits()[1]
        return self._loader(Subset(val, range(min(len(val), _PREDICT_BATCHES * self.batch_size))), drop_last=False)
