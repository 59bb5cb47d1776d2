"""A synthetic language a Transformer can learn offline: a fixed random Markov chain.

Each of `vocab_size` tokens has `branching` possible successors, chosen once from the seed,
and the next token is one of them uniformly at random. A model that has learned the chain
reaches the entropy floor log(branching) (log 4 = 1.39 by default), far below log(vocab_size)
(log 64 = 4.16), which is what guessing uniformly costs.
"""
from __future__ import annotations

import torch

from ringtrain.data import DataModule, SequenceDataset, check_positive_ints


def markov_sequences(
    successors: torch.Tensor, num_sequences: int, seq_len: int, generator: torch.Generator
) -> torch.Tensor:
    """(num_sequences, seq_len + 1) token ids walking the chain `successors` (vocab, branching).

    Every sequence starts at a uniform random token; all sequences advance together, one
    vectorised step per position.
    """
    vocab_size, branching = successors.shape
    sequences = torch.empty(num_sequences, seq_len + 1, dtype=torch.long)
    sequences[:, 0] = torch.randint(vocab_size, (num_sequences,), generator=generator)
    choices = torch.randint(branching, (num_sequences, seq_len), generator=generator)
    for t in range(seq_len):
        sequences[:, t + 1] = successors[sequences[:, t], choices[:, t]]
    return sequences


def random_successors(vocab_size: int, branching: int, generator: torch.Generator) -> torch.Tensor:
    """(vocab_size, branching): for each token, `branching` distinct successors, uniformly.

    Usually (branching^2 <= vocab_size) rows are drawn with replacement and only rows that
    repeat a token are drawn again: each row stays uniform over distinct tuples, most rows
    pass at once, and the cost is O(vocab * branching), so GPT-2's 50304-token vocabulary
    needs no vocabulary x vocabulary table. Denser chains take the `branching` smallest of
    random scores, a block of rows at a time.
    """
    if branching * branching <= vocab_size:
        successors = torch.randint(vocab_size, (vocab_size, branching), generator=generator)
        while True:
            ordered = successors.sort(dim=1).values
            repeats = (ordered[:, 1:] == ordered[:, :-1]).any(dim=1)
            if not repeats.any():
                return successors
            successors[repeats] = torch.randint(vocab_size, (int(repeats.sum()), branching), generator=generator)
    blocks = []
    for start in range(0, vocab_size, 1024):
        scores = torch.rand(min(1024, vocab_size - start), vocab_size, generator=generator)
        blocks.append(scores.topk(branching, dim=1, largest=False).indices)
    return torch.cat(blocks)


class MarkovTokens(DataModule):
    def __init__(
        self,
        vocab_size: int = 64,
        seq_len: int = 64,
        num_train_tokens: int = 200000,
        num_val_tokens: int = 20000,
        branching: int = 4,
        seed: int = 0,
    ) -> None:
        self.vocab_size, self.seq_len, self.branching, self.seed = vocab_size, seq_len, branching, seed
        self.num_train_tokens, self.num_val_tokens = num_train_tokens, num_val_tokens
        check_positive_ints(self, "vocab_size", "seq_len", "branching")
        if not 1 <= branching <= vocab_size:
            raise ValueError(f"data.branching={branching} must be between 1 and data.vocab_size={vocab_size}")
        for name in ("num_train_tokens", "num_val_tokens"):
            if getattr(self, name) < seq_len:
                raise ValueError(
                    f"data.{name}={getattr(self, name)} is less than one sequence of "
                    f"data.seq_len={seq_len} tokens; raise it or lower the sequence length"
                )
        self.dims = {"vocab_size": vocab_size}

    def setup(self) -> None:
        generator = torch.Generator().manual_seed(self.seed)
        successors = random_successors(self.vocab_size, self.branching, generator)
        train = markov_sequences(successors, self.num_train_tokens // self.seq_len, self.seq_len, generator)
        val = markov_sequences(successors, self.num_val_tokens // self.seq_len, self.seq_len, generator)
        self.train, self.val = SequenceDataset(train), SequenceDataset(val)
