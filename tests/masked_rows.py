"""Rows whose labels are -100 on a prefix of varying length, and the models that train on them
(module level, so that ranks spawned by the Python API can unpickle them)."""
from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import Dataset

VOCAB, LENGTH = 32, 16


class MaskedRows(Dataset):
    """Token rows; the first `masked` labels of row i are -100, with `masked` from 0 to
    LENGTH - 1, so micro-batches and ranks count very different numbers of tokens."""

    def __init__(self, n: int, seed: int, as_dict: bool):
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, LENGTH), generator=generator)
        self.masked = torch.randint(0, LENGTH, (n,), generator=generator)
        self.as_dict = as_dict

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int):
        labels = self.ids[i].clone()
        labels[: int(self.masked[i])] = -100
        if self.as_dict:  # Hugging Face style: labels are the input ids, the model shifts
            return {"input_ids": self.ids[i], "labels": labels}
        return self.ids[i], labels


def tiny_transformer() -> nn.Module:
    from ringtrain.models.transformer import Transformer

    torch.manual_seed(0)
    return Transformer(vocab_size=VOCAB, block_size=LENGTH, n_layers=1, n_heads=2, d_model=16, dropout=0.0)


def tiny_gpt2() -> nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=LENGTH, n_embd=16, n_layer=1, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=None, eos_token_id=None)
    return transformers.GPT2LMHeadModel(config)
