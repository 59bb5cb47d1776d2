"""data=stream (data/streams.py) vs data=hf_text (data/hf_text.py) on the same corpus, in the same run.

A corpus of JSON Lines files (a few hundred MB, generated here) and a BPE tokenizer trained on
its head. Three measurements:

- time to the first batch: `stream` builds StreamText, its loader and takes one batch (it tokenizes
  only the documents that batch needs); `hf_text` builds HFText in a fresh cache directory, which
  converts the files to Arrow and tokenizes every row before its loader gives a batch;
- resume at 1% and at 90% of the stream: a StatefulDataLoader is run until its reader has read that
  part of the bytes, its state_dict() is saved, and a fresh StreamText + loader loads it and takes
  one batch: the time of that, and the bytes read before the batch (a seek and one document, so
  about the same at 90% as at 1%);
- the stream's throughput while it runs to 90% (tokenizing on the fly, one process).

    python benchmarks/bench_streams.py [--size-mb 300] [--files 8] [--repeats 3] [--dir /tmp]

Prints each figure (best of --repeats for the quick ones, one run for hf_text, whose cache would
otherwise answer), the machine, and the ratios.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from torchdata.stateful_dataloader import StatefulDataLoader

from ringtrain.data.bpe import train_bpe
from ringtrain.data.hf_text import HFText
from ringtrain.data.streams import StreamText

SEQ_LEN, BATCH_SIZE = 256, 8


def write_corpus(folder: Path, size_mb: int, files: int, seed: int = 0) -> list[Path]:
    """`files` JSON Lines files of about size_mb MB in all: documents of 50 to 1500 words drawn
    Zipf-like from 20,000 made-up words, so a BPE tokenizer has something to merge."""
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkqjxz"))
    words = ["".join(rng.choice(letters, size=rng.integers(2, 10))) for _ in range(20_000)]
    probabilities = 1 / np.arange(1, len(words) + 1)
    probabilities /= probabilities.sum()
    paths = []
    for index in range(files):
        path = folder / f"part-{index:03d}.jsonl"
        with path.open("w", encoding="utf-8") as out:
            while out.tell() < size_mb * 1e6 / files:
                ids = rng.choice(len(words), size=rng.integers(50, 1500), p=probabilities)
                out.write(json.dumps({"text": " ".join(words[i] for i in ids)}) + "\n")
        paths.append(path)
    return paths


def stream_data(folder: Path) -> StreamText:
    data = StreamText(str(folder / "part-*.jsonl"), str(folder / "tokenizer.json"), seq_len=SEQ_LEN, val_documents=50)
    data.setup()
    return data


def stream_first_batch(folder: Path) -> float:
    start = time.perf_counter()
    next(iter(StatefulDataLoader(stream_data(folder).train, batch_size=BATCH_SIZE)))
    return time.perf_counter() - start


def hf_text_first_batch(folder: Path, cache: Path) -> float:
    shutil.rmtree(cache, ignore_errors=True)
    start = time.perf_counter()
    data = HFText(str(folder / "part-*.jsonl"), str(folder / "tokenizer.json"), seq_len=SEQ_LEN, val_fraction=0.01,
                  cache_dir=str(cache))
    data.setup()
    next(iter(DataLoader(data.train, batch_size=BATCH_SIZE)))
    return time.perf_counter() - start


def state_at(folder: Path, fraction: float, corpus_bytes: int) -> tuple[dict, float, int]:
    """A loader state after the stream has read `fraction` of the bytes; the seconds and tokens that took."""
    data = stream_data(folder)
    loader = StatefulDataLoader(data.train, batch_size=BATCH_SIZE)
    batches, start, count = iter(loader), time.perf_counter(), 0
    while data.train.reads["bytes"] < fraction * corpus_bytes:
        next(batches)
        count += 1
    return loader.state_dict(), time.perf_counter() - start, count * BATCH_SIZE * SEQ_LEN


def resume(folder: Path, state: dict) -> tuple[float, int]:
    """Seconds from a fresh StreamText to the resumed loader's first batch, and the bytes read for it."""
    start = time.perf_counter()
    data = stream_data(folder)
    loader = StatefulDataLoader(data.train, batch_size=BATCH_SIZE)
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - start, data.train.reads["bytes"]


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor())
    return f"{os.cpu_count()} CPUs ({model}), torch {torch.__version__}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=300)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the corpus and hf_text's cache go")
    args = parser.parse_args()
    torch.set_num_threads(1)
    free = shutil.disk_usage(args.dir).free
    if free < 4 * args.size_mb * 1e6:  # the corpus, datasets' Arrow copy, the tokenized copy, slack
        raise SystemExit(f"{args.dir} has {free / 1e9:.1f} GB free; --size-mb {args.size_mb} needs about "
                         f"{4 * args.size_mb / 1e3:.1f} GB (pass --dir or a smaller --size-mb)")
    with tempfile.TemporaryDirectory(prefix="bench-streams-", dir=args.dir) as scratch:
        folder = Path(scratch)
        made = time.perf_counter()
        paths = write_corpus(folder, args.size_mb, args.files)
        corpus_bytes = sum(path.stat().st_size for path in paths)
        with paths[0].open(encoding="utf-8") as head:
            sample = [json.loads(line)["text"] for _, line in zip(range(300), head)]
        (folder / "tokenizer.json").write_text(train_bpe(sample, 4096).tokenizer_json, encoding="utf-8")
        print(f"{machine()}; corpus {corpus_bytes / 1e6:.0f} MB in {len(paths)} JSON Lines files "
              f"(made in {time.perf_counter() - made:.0f} s), seq_len {SEQ_LEN}, batch {BATCH_SIZE}, one process")

        first = min(stream_first_batch(folder) for _ in range(args.repeats))
        hf_first = hf_text_first_batch(folder, folder / "hf-cache")
        print(f"time to first batch: stream {first:.3f} s (best of {args.repeats}), hf_text {hf_first:.1f} s "
              f"(one run, fresh cache): hf_text takes {hf_first / first:.0f}x the stream's")

        states = {fraction: state_at(folder, fraction, corpus_bytes) for fraction in (0.01, 0.9)}
        seconds, tokens = states[0.9][1], states[0.9][2]
        print(f"running to 90%: {seconds:.1f} s, {tokens / seconds / 1e3:.0f}k tokens/s "
              f"({0.9 * corpus_bytes / seconds / 1e6:.1f} MB/s of JSON Lines)")
        resumed = {}
        for fraction, (state, _, _) in states.items():
            runs = [resume(folder, state) for _ in range(args.repeats)]
            resumed[fraction] = min(runs)
            print(f"resume at {fraction:.0%}: {resumed[fraction][0]:.3f} s to the first batch (best of {args.repeats}), "
                  f"{resumed[fraction][1]} bytes read for it")
        print(f"resume at 90% / at 1%: {resumed[0.9][0] / resumed[0.01][0]:.2f}x the time, "
              f"{resumed[0.9][1] / max(1, resumed[0.01][1]):.2f}x the bytes")


if __name__ == "__main__":
    main()
