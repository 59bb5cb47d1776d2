"""Packing: short tokenized examples laid end to end in rows of at most max_length tokens, so
a batch holds tokens rather than padding (data/chat.py's `packing: true`).

`first_fit(lengths, capacity)` plans the rows: each example, in the data's order, goes into
the first row that still has room for it, else opens a new row. `PackedRows(examples,
max_length)` is the map-style Dataset of those rows; the plan depends only on the examples'
lengths and order, so row i is the same on every rank and every run (ringtrain's exact
mid-epoch resume needs nothing else). An example is never split across rows.

A packed row is {input_ids, labels, position_ids}: labels follow Hugging Face's causal-LM
convention (aligned with input_ids, the model shifts: task.shift_labels=true), and
position_ids restart at 0 for each example. The model reads the example boundaries from
those restarts and keeps attention inside each example:
- ringtrain's Transformer (models/transformer.py) builds a block-diagonal causal mask from
  them.
- Hugging Face models (transformers 5.x masking_utils: `find_packed_sequence_indices`, called
  by `create_causal_mask`) do the same, but only when the batch has no attention_mask and
  the model keeps no cache: a row therefore has no attention_mask (as transformers'
  DataCollatorWithFlattening gives none), and the model needs `use_cache=False` in its
  config (GPT2Config's default True builds a cache even in training, and then attention
  silently crosses examples; tests/test_packing.py holds both).

Padding a batch of rows to its longest adds tokens after every real token of a row, so
causal attention never lets a real token see one: no mask is needed for them, their labels
are -100 and their position_ids 0.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch.utils.data import Dataset

from ringtrain.data import DataError

IGNORE_INDEX = -100  # data/tasks.py's: labels that count neither in the loss nor in the metrics


def first_fit(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Example indices by row: each example, in order, joins the first row with room for it
    (row order: the order rows were opened). O(n log n): a tree of the rows' free space."""
    free = _FreeSpace(len(lengths), capacity)
    rows: list[list[int]] = []
    for index, length in enumerate(lengths):
        if length > capacity:
            raise DataError(f"example {index} is {length} tokens, longer than the packed rows' {capacity}; "
                            f"truncate examples to max_length before packing them")
        row = free.leftmost_with(length)
        if row == len(rows):  # rows open in order: the leftmost untouched one is the next
            rows.append([])
        rows[row].append(index)
        free.take(row, length)
    return rows


class _FreeSpace:
    """Free tokens of up to `count` rows of `capacity` (a row not yet opened is all free), as
    a max segment tree: the leftmost row with enough room in log(count) steps."""

    def __init__(self, count: int, capacity: int):
        self.leaves = 1 << max(0, count - 1).bit_length()
        self.tree = [capacity] * (2 * self.leaves)  # node k's children: 2k and 2k + 1; the root is 1

    def leftmost_with(self, need: int) -> int:
        node = 1
        while node < self.leaves:
            node = 2 * node if self.tree[2 * node] >= need else 2 * node + 1
        return node - self.leaves

    def take(self, row: int, amount: int) -> None:
        node = row + self.leaves
        self.tree[node] -= amount
        while node > 1:
            node //= 2
            self.tree[node] = max(self.tree[2 * node], self.tree[2 * node + 1])


class PackedRows(Dataset):
    """`examples` (each a mapping with input_ids and, optionally, labels: input_ids when
    absent) packed first-fit into rows of at most `max_length` tokens; `collate_fn` pads a
    batch of rows to its longest."""

    def __init__(self, examples: Any, max_length: int, pad_id: int = 0, lengths: Sequence[int] | None = None):
        """`lengths`: the examples' token counts, when the caller knows them without reading
        every example (a column of an Arrow table, say)."""
        self.examples, self.max_length, self.pad_id = examples, max_length, pad_id
        if lengths is None:
            lengths = [len(examples[i]["input_ids"]) for i in range(len(examples))]
        self.rows = first_fit(lengths, max_length)

    @property
    def max_sequence_length(self) -> int:
        """The longest a batch gets (data/batches.py: the pre-check holds the model's positions
        against it)."""
        return self.max_length

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        ids, labels, positions = [], [], []
        for example in (self.examples[i] for i in self.rows[int(index)]):
            example_ids = torch.as_tensor(example["input_ids"], dtype=torch.long)
            example_labels = torch.as_tensor(example.get("labels", example_ids), dtype=torch.long).clone()
            # The seam. The loss (shift) scores label t with the logits of token t - 1. At an
            # example's first token t, token t - 1 is the previous example's last token, which
            # (attention kept inside each example) has seen nothing of this example: label t
            # would ask it to guess an unrelated example's start. Unpacked, label 0 is never
            # scored either (no token precedes it), so -100 here keeps the packed loss equal to
            # the unpacked examples' losses. The row's first example loses nothing: the shift
            # drops label 0 anyway.
            example_labels[:1] = IGNORE_INDEX
            ids.append(example_ids)
            labels.append(example_labels)
            positions.append(torch.arange(len(example_ids)))
        return {"input_ids": torch.cat(ids), "labels": torch.cat(labels), "position_ids": torch.cat(positions)}

    def collate_fn(self, samples: list[Mapping[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """One batch of rows, each padded to the longest: input_ids with pad_id, labels with
        -100, position_ids with 0 (module docstring: padding needs no mask)."""
        width = max(len(sample["input_ids"]) for sample in samples)
        fills = {"input_ids": self.pad_id, "labels": IGNORE_INDEX, "position_ids": 0}
        batch = {key: torch.full((len(samples), width), fill, dtype=torch.long) for key, fill in fills.items()}
        for row, sample in enumerate(samples):
            for key, values in batch.items():
                values[row, : len(sample[key])] = sample[key]
        return batch
