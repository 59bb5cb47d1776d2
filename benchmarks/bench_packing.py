"""Packing (data/packing.py, data=chat's `data.packing=true`): real tokens trained per second,
packed rows against padding each batch to its longest example.

A data set of examples whose lengths are spread log-uniformly from 16 to 512 tokens (as chat
and instruction data are: many short, a few long), the same model (ringtrain's Transformer,
block 512) and the same token budget per batch (`--rows` x 512 tokens, padding included):
- padded: examples in the data's order, as many a batch as fit the budget once padded to the
  batch's longest (right padding, labels -100 there; the model attends causally, so no real
  token sees a pad);
- packed: PackedRows (first-fit, position_ids restarting per example, the model masking
  attention block-diagonally), `--rows` rows a batch, padded to the batch's longest row.
Each epoch trains every example once (AdamW, the language-model loss over the labels that are
not -100). Counted: the examples' tokens (not padding) over the epoch's time, the sum of its
steps' times, each batch collated inside its step's timing as a loop would. The two epochs run
interleaved, batch by batch in proportion (so load from elsewhere on a shared machine falls on
both alike), on one model in this process, after one untimed warm-up step of each; `--repeats`
such pairs of epochs.

    python benchmarks/bench_packing.py          # --examples 400 --rows 8 --layers 4 --d-model 128
"""
from __future__ import annotations

import argparse
import math
import os
import platform
import statistics
import time
from datetime import date
from pathlib import Path

import torch
import torch.nn.functional as F

from ringtrain.data.packing import IGNORE_INDEX, PackedRows
from ringtrain.models.transformer import Transformer

MAX_LENGTH = 512


def examples(count: int, vocab: int, shortest: int, longest: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    """`count` random token examples, lengths log-uniform in [shortest, longest]; labels are the
    ids (the model shifts), the first quarter of each masked as a prompt."""
    generator = torch.Generator().manual_seed(seed)
    logs = torch.empty(count).uniform_(math.log(shortest), math.log(longest + 1), generator=generator)
    made = []
    for length in logs.exp().floor().long().clamp(shortest, longest).tolist():
        ids = torch.randint(0, vocab, (length,), generator=generator)
        labels = ids.clone()
        labels[: length // 4] = IGNORE_INDEX
        made.append({"input_ids": ids, "labels": labels})
    return made


def padded_batches(data: list[dict], budget: int) -> list[list[int]]:
    """Example indices per batch, in order: a batch takes examples while (count x its longest)
    stays within `budget` tokens."""
    batches, current, longest = [], [], 0
    for index, example in enumerate(data):
        length = len(example["input_ids"])
        if current and (len(current) + 1) * max(longest, length) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(index)
        longest = max(longest, length)
    return batches + ([current] if current else [])


def pad(data: list[dict], indices: list[int], pad_id: int = 0) -> dict[str, torch.Tensor]:
    width = max(len(data[i]["input_ids"]) for i in indices)
    ids = torch.full((len(indices), width), pad_id, dtype=torch.long)
    labels = torch.full((len(indices), width), IGNORE_INDEX, dtype=torch.long)
    for row, i in enumerate(indices):
        n = len(data[i]["input_ids"])
        ids[row, :n], labels[row, :n] = data[i]["input_ids"], data[i]["labels"]
    return {"input_ids": ids, "labels": labels}


def train_step(model: Transformer, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor]) -> None:
    inputs = {key: value for key, value in batch.items() if key != "labels"}
    logits = model(**inputs)
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=IGNORE_INDEX)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def interleaved_epochs(model, optimizer, cases: dict) -> dict[str, float]:
    """One epoch of each case, {name: [collate one batch, ...]}, run batch by batch in
    proportion to each case's number of batches; {name: seconds of its steps}."""
    order = sorted((position / len(collates), name, position) for name, collates in cases.items()
                   for position in range(len(collates)))
    seconds = dict.fromkeys(cases, 0.0)
    for _, name, position in order:
        start = time.perf_counter()
        train_step(model, optimizer, cases[name][position]())
        seconds[name] += time.perf_counter() - start
    return seconds


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    return (f"{os.cpu_count()} CPUs ({cpu}), load average {load}, Python {platform.python_version()}, "
            f"torch {torch.__version__}, {torch.get_num_threads()} threads, {date.today().isoformat()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=400)
    parser.add_argument("--shortest", type=int, default=16)
    parser.add_argument("--longest", type=int, default=MAX_LENGTH)
    parser.add_argument("--rows", type=int, default=8, help="rows of 512 tokens a batch: the token budget")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--d-model", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3, help="pairs of interleaved epochs")
    parser.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    print(f"machine: {machine()}")
    data = examples(args.examples, args.vocab, args.shortest, args.longest)
    lengths = [len(example["input_ids"]) for example in data]
    real = sum(lengths)
    budget = args.rows * MAX_LENGTH
    packed_rows = PackedRows(data, MAX_LENGTH, lengths=lengths)
    row_batches = [list(range(i, min(i + args.rows, len(packed_rows)))) for i in range(0, len(packed_rows), args.rows)]
    pad_batches = padded_batches(data, budget)

    cases = {"padded": [lambda indices=indices: pad(data, indices) for indices in pad_batches],
             "packed": [lambda rows=rows: packed_rows.collate_fn([packed_rows[i] for i in rows])
                        for rows in row_batches]}

    print(f"{args.examples} examples of {min(lengths)}..{max(lengths)} tokens (log-uniform, median "
          f"{statistics.median(lengths):.0f}), {real} tokens; batches of at most {budget} tokens "
          f"({args.rows} x {MAX_LENGTH}); Transformer {args.layers} layers x {args.d_model} wide, vocab {args.vocab}, "
          f"AdamW, fp32\n")
    filled = {name: real / sum(collate()["input_ids"].numel() for collate in collates)
              for name, collates in cases.items()}

    torch.manual_seed(0)
    model = Transformer(vocab_size=args.vocab, block_size=MAX_LENGTH, n_layers=args.layers, n_heads=args.heads,
                        d_model=args.d_model, dropout=0.0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for collates in cases.values():  # warm-up: AdamW's moments, kernels for both kinds of batch
        train_step(model, optimizer, collates[0]())
    seconds: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.repeats):
        for name, spent in interleaved_epochs(model, optimizer, cases).items():
            seconds[name].append(spent)

    print(f"{'':>7} {'batches':>8} {'real/slots':>11} {'epoch s (best)':>15} {'real tok/s (best)':>18} "
          f"{'real tok/s (median)':>20}")
    rate = {}
    for name in cases:
        best, median = min(seconds[name]), statistics.median(seconds[name])
        rate[name] = (real / best, real / median)
        print(f"{name:>7} {len(cases[name]):>8} {filled[name]:>11.1%} {best:>15.2f} {rate[name][0]:>18.0f} "
              f"{rate[name][1]:>20.0f}")
    print(f"\npacked / padded, real tokens per second: {rate['packed'][0] / rate['padded'][0]:.2f}x best, "
          f"{rate['packed'][1] / rate['padded'][1]:.2f}x median")
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()
