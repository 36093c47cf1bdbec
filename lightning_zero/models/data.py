"""A synthetic language the main job can learn, made on the spot: no download.

A lexicon of random words (2-5 letters each, token 0 is the space between words) and a sparse
word-level Markov chain: each word can be followed by only ``branching`` words, with random
(Dirichlet) probabilities. A model first learns the spelling (letters inside a word are fixed),
then which words follow which. Since the spelled-out words decode uniquely, the information in the
text is exactly that of the word chain, so the lowest loss any model can reach is
sum(-log P(word | previous word)) / number of tokens, which ``SyntheticLanguage.sample`` returns
with the text.
"""

from __future__ import annotations

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.utils.data import DataLoader, TensorDataset

from lightning_zero.resilience.resumable_data import resumable_loader


class SyntheticLanguage:
    """The language of the module's docstring: ``num_words`` random words over the letters 1 .. ``vocab_size`` - 1,
    each followed by one of ``branching`` words, all drawn from ``seed``. Sizes it cannot make raise ValueError."""

    def __init__(self, vocab_size: int = 32, num_words: int = 128, branching: int = 4, seed: int = 1234) -> None:
        if vocab_size < 3 or num_words < 2 or not 1 <= branching <= num_words:
            raise ValueError(
                "need vocab_size >= 3, num_words >= 2 and 1 <= branching <= num_words,"
                f" got {vocab_size}, {num_words}, {branching}"
            )
        if num_words > (vocab_size - 1) ** 2:
            raise ValueError(f"{num_words} distinct words need more than {vocab_size - 1} letters")
        g = torch.Generator().manual_seed(seed)
        words: dict[tuple[int, ...], None] = {}
        while len(words) < num_words:
            length = int(torch.randint(2, 6, (), generator=g))
            words[tuple(torch.randint(1, vocab_size, (length,), generator=g).tolist())] = None
        self.vocab_size = vocab_size
        self.words = list(words)
        self.successors = torch.rand(num_words, num_words, generator=g).argsort(dim=1)[:, :branching]  # (W, k)
        # Dirichlet(1, ..., 1) as normalized exponentials, drawn from this language's own generator
        weights = -torch.rand(num_words, branching, generator=g).log()
        self.successor_probs = weights / weights.sum(dim=1, keepdim=True)  # (W, k)

    def sample(self, num_tokens: int, seed: int) -> tuple[Tensor, float]:
        """A stream of ``num_tokens`` token ids, and the lowest loss (nats per token) it allows."""
        g = torch.Generator().manual_seed(seed)
        word = int(torch.randint(len(self.words), (), generator=g))
        tokens: list[int] = []
        nats = 0.0
        while len(tokens) < num_tokens:
            choice = int(torch.multinomial(self.successor_probs[word], 1, generator=g))
            nats -= float(self.successor_probs[word, choice].log())
            word = int(self.successors[word, choice])
            tokens.extend(self.words[word])
            tokens.append(0)
        return torch.tensor(tokens[:num_tokens]), nats / len(tokens)


class SyntheticTextDataModule(pl.LightningDataModule):
    """Next-token pairs (x, y) of ``block_size`` tokens cut from the synthetic language.

    The text is made in the constructor, on every rank alike: ``num_train + num_val`` sequences of
    ``block_size + 1`` tokens cut from one stream, each giving x (its first ``block_size`` tokens) and y (its
    last ``block_size``). ``loss_floor`` is the lowest loss (nats per token) a model can reach on the text,
    which ``ZeroMetrics``' summary prints. The training loader is shuffled and resumable mid-epoch.

    Args:
        vocab_size: the tokens: the space between words (token 0) and the letters; at least 3.
        block_size: the tokens of a sample.
        batch_size: the samples of a batch, in training and validation.
        num_train: the training samples.
        num_val: the validation samples.
        num_words: the words of the lexicon; at least 2, at most (``vocab_size`` - 1) ** 2.
        branching: the words that can follow each word, in [1, ``num_words``].
        seed: the seed of the language (its words and chain); the text is drawn with ``seed + 1``.

    Raises:
        ValueError: ``vocab_size``, ``num_words`` or ``branching`` out of the ranges above.
    """

    def __init__(
        self,
        vocab_size: int = 32,
        block_size: int = 64,
        batch_size: int = 16,
        num_train: int = 4096,
        num_val: int = 128,
        num_words: int = 128,
        branching: int = 4,
        seed: int = 1234,
    ) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.language = SyntheticLanguage(vocab_size, num_words, branching, seed)
        n = num_train + num_val
        stream, self.loss_floor = self.language.sample(n * (block_size + 1), seed + 1)
        sequences = stream.view(n, block_size + 1)
        self.train_set = TensorDataset(sequences[:num_train, :-1], sequences[:num_train, 1:])
        self.val_set = TensorDataset(sequences[num_train:, :-1], sequences[num_train:, 1:])

    def train_dataloader(self) -> DataLoader:
        """Shuffled like Lightning's DistributedSampler, and resumable mid-epoch (resumable_data.py)."""
        return resumable_loader(self.train_set, self.hparams.batch_size, shuffle=True, drop_last=True)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.val_set, batch_size=self.hparams.batch_size)
