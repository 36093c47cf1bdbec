"""A synthetic language the main job can learn, made on the spot: no download.

Text is drawn from a fixed random order-2 Markov chain: for each pair of previous tokens, only
``branching`` next tokens are possible, with random (Dirichlet) probabilities. A model that learns the
chain reaches the chain's entropy rate, which ``SyntheticLanguage.entropy_rate`` computes from the
generated text, so the run shows both the loss and the floor it can reach.
"""

from __future__ import annotations

import math

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset


class SyntheticLanguage:
    def __init__(self, vocab_size: int = 64, branching: int = 4, seed: int = 1234) -> None:
        if vocab_size < 2 or not 1 <= branching <= vocab_size:
            raise ValueError(f"need vocab_size >= 2 and 1 <= branching <= vocab_size, got {vocab_size}, {branching}")
        g = torch.Generator().manual_seed(seed)
        V = vocab_size
        self.vocab_size = V
        # probs[a, b, c] = P(next = c | previous two = a, b); `branching` non-zero entries per context
        choices = torch.rand(V * V, V, generator=g).argsort(dim=1)[:, :branching]
        weights = torch.distributions.Dirichlet(torch.ones(branching)).sample((V * V,))
        probs = torch.zeros(V * V, V)
        probs.scatter_(1, choices, weights)
        self.probs = probs.view(V, V, V)

    def sample(self, num_sequences: int, length: int, seed: int) -> Tensor:
        """(num_sequences, length) token ids."""
        g, V = torch.Generator().manual_seed(seed), self.vocab_size
        out = torch.empty(num_sequences, length, dtype=torch.long)
        out[:, :2] = torch.randint(V, (num_sequences, 2), generator=g)
        for t in range(2, length):
            p = self.probs[out[:, t - 2], out[:, t - 1]]  # (N, V)
            out[:, t] = torch.multinomial(p, 1, generator=g).squeeze(1)
        return out

    def entropy_rate(self, tokens: Tensor) -> float:
        """Mean -log P(next | previous two) over ``tokens``: the lowest loss a model can reach (nats)."""
        p = self.probs[tokens[:, :-2], tokens[:, 1:-1], tokens[:, 2:]]
        return float(-p.log().mean())


class SyntheticTextDataModule(pl.LightningDataModule):
    """Next-token pairs (x, y) of ``block_size`` tokens from the synthetic language."""

    def __init__(
        self,
        vocab_size: int = 64,
        block_size: int = 64,
        batch_size: int = 16,
        num_train: int = 8192,
        num_val: int = 256,
        branching: int = 4,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.language = SyntheticLanguage(vocab_size, branching, seed)
        tokens = self.language.sample(num_train + num_val, block_size + 1, seed)
        self.train_set = TensorDataset(tokens[:num_train, :-1], tokens[:num_train, 1:])
        self.val_set = TensorDataset(tokens[num_train:, :-1], tokens[num_train:, 1:])
        # The first two tokens of a sequence are uniform: they cost log(V) each, whoever predicts them.
        chain = self.language.entropy_rate(tokens)
        self.loss_floor = (math.log(vocab_size) + (block_size - 1) * chain) / block_size

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.train_set, batch_size=self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
