"""Sharded token corpora (data=token_shards): ringtrain's loader against what training consumes
and against a plain DataLoader over np.memmap, in the same run.

The corpus is written here in llm.c's format (dev/data/data_common.py write_datafile: a header
of 256 int32, then uint16 ids), 9 shards of 2 M tokens (one for validation), in a temporary
directory; it is in the page cache when it is read (a cold disk is not measured).

  (a) ours vs the model  ringtrain's loader alone (loop/loaders.py build_train_loader over
                         TokenShards, shuffled, the preset's batch of 16 x 1024) delivers
                         tokens/s; experiment=gpt2_small's model (model=transformer, 12 layers x
                         12 heads x 768, 1024 context, 50304 ids) consumes tokens/s in a training
                         step (forward, loss, backward, clip, AdamW) at batch 1 on this CPU, in
                         float32 and bf16 autocast, the faster counting. Target: ratio >= 10.
  (b) raw vs ours        the simplest fast loader a user writes: a Dataset with one np.memmap
                         per shard, `__getitem__` one window, torch DataLoader(batch_size=16,
                         shuffle=True); the same windows. Target: raw / ours tokens/s <= 1.1.
                         `stack`, for comparison: nanoGPT's get_batch (memmap slices stacked
                         per batch, no DataLoader) over the same Dataset.
  (c) --big              a corpus of 4.4 GB in 44 shards (and a validation shard), checked and
                         set up (every id read once), then read for --big-batches shuffled
                         batches; the peak resident set (VmHWM) of a fresh process for ours and
                         for the raw memmap loader. Target: ours < 1 GB.

    python benchmarks/bench_token_shards.py             # --repeats 5 --batches 256 --model-steps 2
    python benchmarks/bench_token_shards.py --big       # also (c): needs 4.5 GB free disk, deleted after

Loaders run interleaved, best of --repeats (a shared VM's load only slows a run down), one
process, no worker processes: ringtrain's loader reads a batch with one positioned read per
window in the training process (data/token_shards.py says why).
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import resource
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset

from ringtrain.data.token_shards import TokenShards
from ringtrain.loop.loaders import build_train_loader
from ringtrain.models.transformer import Transformer

CONF = Path(__file__).resolve().parents[1] / "conf"
SEQ_LEN, BATCH = 1024, 16  # experiment=gpt2_small's context and per-device batch
GPT2_IDS = 50257


# --- the corpus, as llm.c writes it ---------------------------------------------------------------

def write_shard(path: Path, num_tokens: int, seed: int, chunk: int = 1 << 24) -> None:
    """An llm.c GPT-2 token shard of `num_tokens` pseudo-random ids, written a chunk at a time."""
    header = np.zeros(256, dtype=np.int32)
    header[:3] = 20240520, 1, num_tokens
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for start in range(0, num_tokens, chunk):
            positions = np.arange(start, min(start + chunk, num_tokens), dtype=np.uint64) + seed * 1_000_003
            f.write((positions * 2654435761 % GPT2_IDS).astype(np.uint16).tobytes())


def write_corpus(directory: Path, train_shards: int, tokens_per_shard: int) -> None:
    write_shard(directory / "fineweb_val_000000.bin", min(tokens_per_shard, 1 << 20), seed=0)
    for shard in range(1, train_shards + 1):
        write_shard(directory / f"fineweb_train_{shard:06d}.bin", tokens_per_shard, seed=shard)


# --- the two loaders ----------------------------------------------------------------------------

def ours(directory: Path) -> TokenShards:
    data = TokenShards(str(directory), seq_len=SEQ_LEN, vocab_size=GPT2_IDS, cache_dir="")
    data.setup()
    return data


def our_batches(data: TokenShards, batches: int, epoch: int):
    loader = build_train_loader(data.train, BATCH, rank=0, world_size=1, seed=0, drop_last=True,
                                device=torch.device("cpu"))
    for number, batch in enumerate(loader.batches(epoch)):
        if number == batches:
            return
        yield batch


class MemmapWindows(Dataset):
    """What a user writes: a memory map per shard, a window per __getitem__."""

    def __init__(self, directory: Path):
        self.maps = [np.memmap(f, dtype=np.uint16, mode="r", offset=1024)
                     for f in sorted(directory.glob("*_train_*.bin"))]
        self.ends = np.cumsum([(len(m) - 1) // SEQ_LEN for m in self.maps])

    def __len__(self) -> int:
        return int(self.ends[-1])

    def __getitem__(self, index: int):
        shard = int(np.searchsorted(self.ends, index, side="right"))
        start = (index - (self.ends[shard - 1] if shard else 0)) * SEQ_LEN
        window = torch.from_numpy(self.maps[shard][start : start + SEQ_LEN + 1].astype(np.int64))
        return window[:-1], window[1:]


def stacked_batches(dataset: MemmapWindows, batches: int, epoch: int):
    """nanoGPT train.py's get_batch over the same windows: memmap slices stacked, no DataLoader."""
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(epoch))
    for rows in order[: batches * BATCH].split(BATCH):
        windows = torch.stack([dataset[i][0] for i in rows.tolist()])
        yield windows, windows


def raw_batches(dataset: MemmapWindows, batches: int, epoch: int):
    loader = DataLoader(dataset, batch_size=BATCH, shuffle=True, drop_last=True,
                        generator=torch.Generator().manual_seed(epoch))
    for number, batch in enumerate(loader):
        if number == batches:
            return
        yield batch


def tokens_per_second(batches) -> float:
    start, tokens = time.perf_counter(), 0
    for inputs, _ in batches:
        tokens += inputs.numel()
    return tokens / (time.perf_counter() - start)


# --- what training consumes -----------------------------------------------------------------------

def gpt2_small() -> Transformer:
    """experiment=gpt2_small's model, built from the preset itself."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(config_name="train", overrides=["experiment=gpt2_small"])
    torch.manual_seed(0)
    arguments = {key: value for key, value in cfg.model.items() if key != "_target_"}
    return Transformer(vocab_size=cfg.data.vocab_size, **arguments)


def model_tokens_per_second(steps: int, bf16: bool) -> float:
    """Tokens/s of training steps at batch 1 x 1024 after one warm-up step (fastest step)."""
    model = gpt2_small()
    # Decay on every parameter, not on the matrices only as the preset's optimizer does: the same cost.
    optimizer = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
    inputs = torch.randint(0, GPT2_IDS, (1, SEQ_LEN + 1))
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = model(inputs[:, :-1])
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), inputs[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    return SEQ_LEN / min(times[1:])


# --- (c) the resident set of a fresh process ---------------------------------------------------------

def peak_resident_mb() -> float:
    """VmHWM (the peak resident set) from /proc, else ru_maxrss."""
    try:
        line = next(l for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmHWM:"))
        return int(line.split()[1]) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def big_child(kind: str, directory: str, batches: int, results) -> None:
    """In a fresh (spawned) process: set up one loader over the big corpus, read `batches`."""
    start_mb, start = peak_resident_mb(), time.perf_counter()
    if kind == "ours":
        data = ours(Path(directory))
        set_up_mb, set_up_s = peak_resident_mb(), time.perf_counter() - start
        rate = tokens_per_second(our_batches(data, batches, epoch=0))
    else:
        dataset = MemmapWindows(Path(directory))
        set_up_mb, set_up_s = peak_resident_mb(), time.perf_counter() - start
        rate = tokens_per_second(raw_batches(dataset, batches, epoch=0))
    results.put((kind, start_mb, set_up_mb, set_up_s, peak_resident_mb(), rate))


def run_big(batches: int, base: str | None) -> None:
    train_shards, tokens_per_shard = 44, 50_000_000
    need = train_shards * (1024 + 2 * tokens_per_shard) + 2 * (1 << 20) + (1024 << 20)  # + 1 GiB to spare
    where = base or tempfile.gettempdir()
    free = shutil.disk_usage(where).free
    print(f"\n(c) --big: {train_shards} shards x {tokens_per_shard / 1e6:.0f} M tokens "
          f"= {train_shards * tokens_per_shard * 2 / 1e9:.2f} GB in {where}; needs {need / 1e9:.1f} GB free, "
          f"{free / 1e9:.1f} GB free")
    if free < need:
        raise SystemExit(f"not enough free disk in {where}: {need / 1e9:.1f} GB needed; pass --big-dir")
    with tempfile.TemporaryDirectory(dir=base) as directory:
        start = time.perf_counter()
        write_corpus(Path(directory), train_shards, tokens_per_shard)
        print(f"    written in {time.perf_counter() - start:.0f} s")
        context = multiprocessing.get_context("spawn")
        results = context.Queue()
        for kind in ("ours", "raw"):
            child = context.Process(target=big_child, args=(kind, directory, batches, results))
            child.start()
            child.join()  # what it sends is a few numbers: the queue does not block its exit
            if child.exitcode != 0:
                raise SystemExit(f"the {kind} child failed (exit status {child.exitcode}); its traceback is above")
            name, start_mb, set_up_mb, set_up_s, peak_mb, rate = results.get()
            print(f"    {name:5s} peak RSS {peak_mb:7.0f} MB (at start {start_mb:.0f} MB, after set-up {set_up_mb:.0f} MB"
                  f" in {set_up_s:.1f} s); {batches} batches of {BATCH} x {SEQ_LEN} at {rate / 1e6:.1f} M tokens/s")


# --- the report ---------------------------------------------------------------------------------

def machine() -> str:
    try:
        model = next(l.split(":", 1)[1].strip() for l in Path("/proc/cpuinfo").read_text().splitlines()
                     if l.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor() or "unknown CPU"
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{cores} cores ({model}), Python {platform.python_version()}, torch {torch.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batches", type=int, default=256, help="batches per loader run (a)/(b)")
    parser.add_argument("--model-steps", type=int, default=2, help="timed training steps per precision")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads for the model step")
    parser.add_argument("--big", action="store_true", help="also (c): a 4.4 GB corpus and the resident set")
    parser.add_argument("--big-batches", type=int, default=2000)
    parser.add_argument("--big-dir", default=None, help="where (c) writes its corpus (default: the temp dir)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(machine())

    with tempfile.TemporaryDirectory() as directory:
        write_corpus(Path(directory), train_shards=8, tokens_per_shard=2_000_000)
        data, memmaps = ours(Path(directory)), MemmapWindows(Path(directory))
        loaders = {"ours": lambda epoch: our_batches(data, args.batches, epoch),
                   "raw": lambda epoch: raw_batches(memmaps, args.batches, epoch),
                   "stack": lambda epoch: stacked_batches(memmaps, args.batches, epoch)}
        rates = {name: [] for name in loaders}
        for repeat in range(args.repeats):  # interleaved; a new epoch (permutation) each time
            for name, batches in loaders.items():
                rates[name].append(tokens_per_second(batches(repeat)))
    best = {name: max(values) for name, values in rates.items()}
    for name, values in rates.items():
        print(f"{name:5s} loader {best[name] / 1e6:6.2f} M tokens/s (median {statistics.median(values) / 1e6:.2f}), "
              f"{args.batches} batches of {BATCH} x {SEQ_LEN}, best of {args.repeats}")

    consumed = {}
    for bf16 in (False, True):
        consumed["bf16 autocast" if bf16 else "float32"] = model_tokens_per_second(args.model_steps, bf16)
    for name, rate in consumed.items():
        print(f"gpt2_small training step, batch 1 x {SEQ_LEN}, {name}, {args.threads} threads: {rate:.0f} tokens/s")
    model_rate = max(consumed.values())
    print(f"(a) ours / the model's consumption: {best['ours'] / model_rate:.0f}x (target >= 10)")
    print(f"(b) raw memmap DataLoader / ours: {best['raw'] / best['ours']:.2f} (target <= 1.1); "
          f"stack / ours: {best['stack'] / best['ours']:.2f}")
    if args.big:
        run_big(args.big_batches, args.big_dir)


if __name__ == "__main__":
    main()
