"""Sharded token corpora (data=token_shards): llm.c's FineWeb shards and token directories."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import assert_same_weights, checkpoint_weights, run_cli
from helpers import ok, refused
from ringtrain.data import DataError, token_ids, token_shards, windows_of
from ringtrain.data.token_shards import ShardWindows, TokenShards
from ringtrain.loop.loaders import ShuffledShards, build_train_loader


def write_datafile(filename: Path, toks) -> None:
    """llm.c's dev/data/data_common.py write_datafile, model_desc="gpt-2": a header of 256
    int32 (magic 20240520, version 1, the token count, zeros), then the ids as uint16."""
    header = np.zeros(256, dtype=np.int32)
    header[0] = 20240520
    header[1] = 1
    header[2] = len(toks)
    with open(filename, "wb") as f:
        f.write(header.tobytes())
        f.write(np.array(toks, dtype=np.uint16).tobytes())


def write_token_dir(directory: Path, train: np.ndarray, val: np.ndarray, vocab_size: int, vocab=None) -> Path:
    """A token directory as data/token_file.py reads it: flat ids and meta.json."""
    directory.mkdir(parents=True)
    train.tofile(directory / "train.bin")
    val.tofile(directory / "val.bin")
    meta = {"dtype": str(train.dtype), "vocab_size": vocab_size, **({"vocab": vocab} if vocab else {})}
    (directory / "meta.json").write_text(json.dumps(meta))
    return directory


def marked_ids(shard: int, count: int) -> np.ndarray:
    """Ids that say which shard and which position they come from: shard * 1000 + position % 1000."""
    return shard * 1000 + np.arange(count) % 1000


def expected_windows(*streams: np.ndarray, seq_len: int) -> torch.Tensor:
    return torch.cat([windows_of(torch.from_numpy(s.astype(np.int64)), seq_len) for s in streams])


def test_shards_written_as_llm_c_writes_them_read_back_as_the_same_ids_window_for_window(tmp_path):
    rng = np.random.default_rng(0)
    streams = {name: rng.integers(0, 50257, size) for name, size in
               [("fineweb_val_000000.bin", 300), ("fineweb_train_000001.bin", 1000), ("fineweb_train_000002.bin", 777)]}
    for name, ids in streams.items():
        write_datafile(tmp_path / name, ids)
    data = TokenShards(str(tmp_path), seq_len=16, cache_dir="")
    data.setup()
    train = expected_windows(streams["fineweb_train_000001.bin"], streams["fineweb_train_000002.bin"], seq_len=16)
    val = expected_windows(streams["fineweb_val_000000.bin"], seq_len=16)
    assert data.dims == {"vocab_size": 1 + max(int(ids.max()) for ids in streams.values())} and data.vocab is None
    assert (len(data.train), len(data.val)) == (len(train), len(val)) == (999 // 16 + 776 // 16, 299 // 16)
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(0))
    inputs, targets = data.train.get_batch(order)
    assert inputs.dtype == torch.int64 and inputs.equal(train[order, :-1]) and targets.equal(train[order, 1:])
    for i in (0, 61, 62, len(train) - 1, -1):  # 62 is the second shard's first window
        assert data.train[i][0].equal(train[i, :-1]) and data.train[i][1].equal(train[i, 1:])
    assert data.val.get_batch(torch.arange(len(val)))[1].equal(val[:, 1:])
    with pytest.raises(IndexError, match=f"window indices must lie in \\[-{len(train)}, {len(train)}\\)"):
        data.train.get_batch(torch.tensor([len(train)]))


def test_sample_indices_number_the_windows_shard_after_shard_and_val_comes_from_val_shards(tmp_path):
    # Written out of order: the global order is the shards' path order, whatever the directory's.
    for shard, count in ((3, 33), (1, 17), (2, 100)):  # 2, 12 and 4 windows of 8 + 1 tokens
        write_datafile(tmp_path / f"fineweb_train_00000{shard}.bin", marked_ids(shard, count))
    write_datafile(tmp_path / "fineweb_val_000000.bin", marked_ids(4, 41))
    data = TokenShards(str(tmp_path), seq_len=8, vocab_size=5000, cache_dir="")
    data.setup()
    assert [Path(s.path).name for s in data.shards["train"]] == [f"fineweb_train_00000{k}.bin" for k in (1, 2, 3)]
    assert len(data.train) == 2 + 12 + 4 and len(data.val) == 5
    shard, window = data.train.locate(np.array([0, 1, 2, 13, 14, 17]))
    assert shard.tolist() == [0, 0, 1, 1, 2, 2] and window.tolist() == [0, 1, 0, 11, 0, 3]
    inputs, targets = data.train.get_batch(torch.arange(len(data.train)))
    assert inputs[:, 0].tolist() == [1000, 1008, *range(2000, 2096, 8), 3000, 3008, 3016, 3024]
    # A window never crosses into the next shard: each one's ids all come from one file.
    assert ((targets // 1000) == (inputs[:, :1] // 1000)).all()
    val_inputs, val_targets = data.val.get_batch(torch.arange(len(data.val)))
    assert (val_inputs // 1000 == 4).all() and val_targets[-1, -1].item() == 4040


def test_token_directories_join_llm_c_shards_and_a_glob_picks_the_shards(tmp_path):
    corpus = tmp_path / "corpus"
    write_token_dir(corpus / "books", marked_ids(1, 50).astype(np.uint16), marked_ids(2, 30).astype(np.uint16), 3000)
    write_token_dir(corpus / "wiki", marked_ids(3, 40).astype(np.uint16), marked_ids(4, 20).astype(np.uint16), 6000)
    write_datafile(corpus / "fineweb_train_000001.bin", marked_ids(5, 25))
    data = TokenShards(str(corpus), seq_len=8, cache_dir="")
    data.setup()
    assert [Path(s.path).relative_to(corpus).as_posix() for s in data.shards["train"]] == [
        "books/train.bin", "fineweb_train_000001.bin", "wiki/train.bin"]
    assert [Path(s.path).relative_to(corpus).as_posix() for s in data.shards["val"]] == ["books/val.bin", "wiki/val.bin"]
    assert data.dims == {"vocab_size": 6000}  # the largest meta.json's, with no vocab_size given
    inputs, _ = data.train.get_batch(torch.arange(len(data.train)))
    assert inputs[:, 0].tolist() == [1000, 1008, 1016, 1024, 1032, 1040, 5000, 5008, 5016, 3000, 3008, 3016, 3024]

    # A glob of token directories; one directory alone keeps its vocabulary for decoding.
    globbed = TokenShards(str(corpus / "w*"), seq_len=8, cache_dir="")
    assert [Path(s.path).parent.name for s in globbed.shards["train"] + globbed.shards["val"]] == ["wiki", "wiki"]
    write_token_dir(tmp_path / "chars", np.arange(20, dtype=np.uint16), np.arange(20, dtype=np.uint16), 65,
                    vocab={"kind": "char", "chars": "ab"})
    assert TokenShards(str(tmp_path / "chars"), seq_len=8).vocab == {"kind": "char", "chars": "ab"}
    assert TokenShards(str(tmp_path / "chars"), seq_len=8).dims == {"vocab_size": 65}


def test_at_most_max_open_files_shards_are_open_at_once(tmp_path):
    if not Path("/proc/self/fd").is_dir():
        pytest.skip("counts this process's open files in /proc")
    for shard in range(1, 11):
        write_datafile(tmp_path / f"fineweb_train_{shard:06d}.bin", marked_ids(shard, 81))
    write_datafile(tmp_path / "fineweb_val_000000.bin", marked_ids(0, 81))
    data = TokenShards(str(tmp_path), seq_len=8, vocab_size=20000, cache_dir="")
    windows = ShardWindows(data.shards["train"], seq_len=8, max_open_files=3)
    before = len(os.listdir("/proc/self/fd"))
    order = torch.randperm(len(windows), generator=torch.Generator().manual_seed(1))
    for batch in order.split(7):  # batches that touch shards all over the corpus
        inputs, _ = windows.get_batch(batch)
        assert inputs[:, 0].tolist() == [(1 + i // 10) * 1000 + (i % 10) * 8 for i in batch.tolist()]
        assert len(os.listdir("/proc/self/fd")) - before <= 3
    windows.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_dataset_pickles_as_paths_and_reopens_its_files(tmp_path):
    for shard in range(3):
        write_datafile(tmp_path / f"fineweb_{'val' if shard == 0 else 'train'}_{shard:06d}.bin", marked_ids(shard, 5000))
    data = TokenShards(str(tmp_path), seq_len=32, vocab_size=3000, cache_dir="")
    data.setup()
    expected = data.train.get_batch(torch.tensor([5, 200, 0]))  # its files are open now
    blob = pickle.dumps(data.train)
    assert len(blob) < 2000
    copy = pickle.loads(blob)
    assert all(a.equal(b) for a, b in zip(copy.get_batch(torch.tensor([5, 200, 0])), expected))


def test_the_trainers_loader_reads_its_permutation_and_resumes_mid_epoch(tmp_path):
    for shard in range(4):
        write_datafile(tmp_path / f"fineweb_{'val' if shard == 0 else 'train'}_{shard:06d}.bin", marked_ids(shard, 200))
    data = TokenShards(str(tmp_path), seq_len=8, vocab_size=4000, cache_dir="")
    data.setup()
    everything = expected_windows(*(marked_ids(shard, 200) for shard in (1, 2, 3)), seq_len=8)
    loader = build_train_loader(data.train, batch_size=4, rank=0, world_size=1, seed=7, drop_last=True,
                                device=torch.device("cpu"))
    order = ShuffledShards(len(data.train), 0, 1, seed=7, shuffle=True, drop_last=True).indices(epoch=2)
    batches = list(loader.batches(2))
    assert torch.cat([x for x, _ in batches]).equal(everything[order[: len(batches) * 4], :-1])
    resumed = list(loader.batches(2, start=20))  # a checkpoint taken after 5 batches
    assert len(resumed) == len(batches) - 5
    assert all(a[0].equal(b[0]) and a[1].equal(b[1]) for a, b in zip(resumed, batches[5:]))


# --- bad data: one line each --------------------------------------------------------------------

def _header(magic=20240520, version=1, count=100) -> bytes:
    header = np.zeros(256, dtype=np.int32)
    header[:3] = magic, version, count
    return header.tobytes()


GOOD = np.arange(100, dtype=np.uint16)
SHARD = "fineweb_train_000002.bin"


@pytest.mark.parametrize("content, message", [
    (_header(magic=12345) + GOOD.tobytes(),
     "{file} is not an llm.c token shard: its header starts with 12345, not the magic number 20240520; "
     "write it with llm.c's dev/data/data_common.py or leave it out of data.path"),
    (_header(magic=20240801, version=7) + GOOD.astype(np.uint32).tobytes(),
     "{file} is not an llm.c token shard: its header starts with 20240801 (llm.c's llama-3 shard, uint32 ids), "
     "not the magic number 20240520; write it with llm.c's dev/data/data_common.py or leave it out of data.path"),
    ("npy", "{file} is not an llm.c token shard: its header starts with 1297436307 (a .npy file, as build-nanogpt's "
            "fineweb.py writes), not the magic number 20240520"),
    (_header(version=2) + GOOD.tobytes(),
     "{file} is an llm.c token shard of version 2; ringtrain reads version 1 (uint16 GPT-2 ids): "
     "write it again with llm.c's gpt-2 format"),
    (_header()[:100], "{file} is 100 bytes, shorter than the 1024-byte header of an llm.c token shard; "
                      "it is cut short: download or write it again"),
    (_header() + GOOD.tobytes()[:-3], "{file} is 1221 bytes, but its header's 100 tokens make 1224 (1024 + 2 x 100); "
                                      "it is cut short: download or write it again"),
    (_header() + GOOD.tobytes() + b"\0\0", "{file} is 1226 bytes, but its header's 100 tokens make 1224 (1024 + 2 x 100); "
                                           "it holds more than its header says: write it again"),
    (_header(count=0), "{file} holds 0 tokens (its header's count); leave it out of data.path"),
    (_header(count=8) + GOOD[:8].tobytes(),
     "{file} holds 8 tokens, fewer than one window of seq_len + 1 = 9; leave it out of data.path "
     "or use a smaller model.block_size"),
    ("dangling", "{file} cannot be read (No such file or directory); make it readable or leave it out of data.path"),
])
def test_each_damaged_shard_is_refused_in_one_line_before_setup(tmp_path, content, message):
    write_datafile(tmp_path / "fineweb_val_000000.bin", GOOD)
    write_datafile(tmp_path / "fineweb_train_000001.bin", GOOD)
    file = tmp_path / SHARD
    if content == "npy":
        with open(file, "wb") as handle:
            np.save(handle, GOOD)  # build-nanogpt's shards, named like llm.c's
    elif content == "dangling":
        file.symlink_to(tmp_path / "gone.bin")
    else:
        file.write_bytes(content)
    with pytest.raises(DataError) as error:
        TokenShards(str(tmp_path), seq_len=8, cache_dir="")
    assert str(error.value).startswith(message.format(file=file)) and "\n" not in str(error.value)


def test_a_token_directorys_file_cut_inside_a_token_is_refused_in_one_line(tmp_path):
    directory = write_token_dir(tmp_path / "books", GOOD, GOOD, 100)
    (directory / "val.bin").write_bytes(GOOD.tobytes() + b"\x01")
    with pytest.raises(DataError) as error:
        TokenShards(str(tmp_path), seq_len=8)
    assert str(error.value) == (f"{directory / 'val.bin'} is 201 bytes, not a whole number of uint16 tokens (2 bytes "
                                f"each); the file is cut short or meta.json's dtype is wrong")


def test_a_path_without_train_or_val_shards_names_the_names_it_expects(tmp_path):
    write_datafile(tmp_path / "fineweb_000000.bin", GOOD)  # llm.c's first naming, without the split
    with pytest.raises(DataError) as error:
        TokenShards(str(tmp_path), seq_len=8)
    assert str(error.value) == (
        f"data.path={str(tmp_path)!r} holds no train shards; expected llm.c token shards named *_train_*.bin "
        f"(as fineweb_train_000001.bin) or token directories holding train.bin, val.bin and meta.json "
        f"(ringtrain prepare_tokens)")
    write_datafile(tmp_path / "fineweb_train_000001.bin", GOOD)
    with pytest.raises(DataError, match=r"holds no val shards; expected llm.c token shards named \*_val_\*.bin"):
        TokenShards(str(tmp_path), seq_len=8)
    with pytest.raises(DataError, match=r"data.path='.*/nope/\*.bin' matches no file; pass a directory or a glob"):
        TokenShards(str(tmp_path / "nope" / "*.bin"), seq_len=8)
    with pytest.raises(DataError, match=r"data.path='.*/nope' does not exist; pass a directory or a glob"):
        TokenShards(str(tmp_path / "nope"), seq_len=8)


def test_shards_of_two_id_types_are_refused(tmp_path):
    write_datafile(tmp_path / "fineweb_train_000001.bin", GOOD)
    write_token_dir(tmp_path / "big", GOOD.astype(np.uint32), GOOD.astype(np.uint32), 70000)
    with pytest.raises(DataError) as error:
        TokenShards(str(tmp_path), seq_len=8)
    assert str(error.value) == (
        f"{tmp_path / 'fineweb_train_000001.bin'} holds uint16 ids but {tmp_path / 'big' / 'train.bin'} holds uint32; "
        f"the shards of one corpus need one id type (and one tokenizer): tokenize them alike")


def test_an_id_past_the_vocabulary_is_named_with_its_file_and_offset_in_setup(tmp_path, monkeypatch):
    monkeypatch.setattr(token_ids, "CHUNK_TOKENS", 4096)  # the shard is read in 13 chunks, as a big one would be
    write_datafile(tmp_path / "fineweb_val_000000.bin", GOOD)
    ids = np.zeros(50000, dtype=np.uint16)
    ids[[31337, 40000]] = [50300, 50257]
    write_datafile(tmp_path / "fineweb_train_000001.bin", ids)
    data = TokenShards(str(tmp_path), seq_len=8, vocab_size=50257, cache_dir="")  # headers only: no id read yet
    with pytest.raises(DataError) as error:
        data.setup()
    assert str(error.value) == (
        f"{tmp_path / 'fineweb_train_000001.bin'}: token 31337 (byte {1024 + 2 * 31337}) is id 50300, but the vocabulary "
        f"has 50257 ids (data.vocab_size); set data.vocab_size to at least 50301 or tokenize again")
    TokenShards(str(tmp_path), seq_len=8, vocab_size=50301, cache_dir="").setup()


def test_a_shards_largest_id_is_read_once_per_file_version(tmp_path, monkeypatch):
    scans = []
    scan = token_shards._scan_largest
    monkeypatch.setattr(token_shards, "_scan_largest", lambda shard: scans.append(Path(shard.path).name) or scan(shard))
    monkeypatch.setattr(token_ids, "_seen", {})
    write_datafile(tmp_path / "fineweb_val_000000.bin", GOOD)
    write_datafile(tmp_path / "fineweb_train_000001.bin", GOOD)
    for file in tmp_path.iterdir():
        os.utime(file, (1_000_000_000, 1_000_000_000))  # long settled: no change can hide in one file-time tick
    cache = tmp_path.parent / f"{tmp_path.name}-cache"
    TokenShards(str(tmp_path), seq_len=8, cache_dir=str(cache)).setup()
    assert sorted(scans) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"] and len(list(cache.iterdir())) == 2
    token_ids._seen.clear()  # another process: only the cache
    TokenShards(str(tmp_path), seq_len=8, cache_dir=str(cache)).setup()
    assert len(scans) == 2
    # The same ids read from byte 0 (header included) are another key: the header is not ids.
    assert token_ids.largest_token_id(tmp_path / "fineweb_val_000000.bin", "uint16", None, str(cache)) > 50000
    write_datafile(tmp_path / "fineweb_train_000001.bin", GOOD + 50200)  # the same size, a new mtime
    with pytest.raises(DataError, match="token 57 .* is id 50257, but the vocabulary has 50257 ids"):
        TokenShards(str(tmp_path), seq_len=8, vocab_size=50257, cache_dir=str(cache)).setup()


def test_shards_without_a_vocab_size_or_tokenizer_get_their_largest_id_plus_one_said_in_one_line(tmp_path, caplog):
    """65 ids (0-64) give a 65-row vocabulary, not GPT-2's 50257; data.vocab_size still wins."""
    for name, count in (("fineweb_val_000000.bin", 200), ("fineweb_train_000001.bin", 500)):
        write_datafile(tmp_path / name, np.arange(count) % 65)
    data = TokenShards(str(tmp_path), seq_len=8, cache_dir="")
    with caplog.at_level("INFO", logger="ringtrain"):
        data.setup()
    assert data.dims == {"vocab_size": 65}
    assert [r.getMessage() for r in caplog.records if "vocab_size" in r.getMessage()] == [
        "data.vocab_size=65: the largest id in the shards plus one (data.vocab_size or data.tokenizer sets it)"]
    assert TokenShards(str(tmp_path), seq_len=8, vocab_size=128, cache_dir="").dims == {"vocab_size": 128}


def test_a_shards_run_given_its_tokenizer_samples_text_with_it(tmp_path):
    """data.tokenizer names the tokenizer.json the llm.c shards were made with: its size is the
    vocabulary's, the checkpoint keeps it, and `ringtrain sample` encodes and decodes with it."""
    pytest.importorskip("tokenizers")
    from conftest import train_in_process
    from ringtrain.data.bpe import train_bpe
    from ringtrain.tools.sample import sample

    text = "the king and the queen of the land, and the lord of the sea\n" * 40
    tokenizer = train_bpe([text], vocab_size=300)
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text(tokenizer.tokenizer_json)
    ids = tokenizer.encode_array(text)
    write_datafile(tmp_path / "fineweb_val_000000.bin", ids[:200])
    write_datafile(tmp_path / "fineweb_train_000001.bin", ids[200:])
    train_in_process(["data=token_shards", f"data.path={tmp_path}", f"data.tokenizer={tmp_path / 'tok'}",
                      "data.cache_dir=", "model=transformer", "model.block_size=8", "model.d_model=16",
                      "model.n_layers=1", "model.n_heads=2", "trainer.max_steps=2", "trainer.batch_size=4"], tmp_path / "run")
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["vocab"] == tokenizer.to_state() and checkpoint["data_dims"] == {"vocab_size": tokenizer.size}
    (drawn,) = sample(str(tmp_path / "run" / "checkpoints" / "last.pt"), prompt="the queen", max_new_tokens=6)
    assert drawn.startswith("the queen") and len(tokenizer.encode(drawn)) >= len(tokenizer.encode("the queen")) + 1


# --- the command line ---------------------------------------------------------------------------

def _corpus(directory: Path) -> Path:
    """Four llm.c shards of a learnable sequence over 64 ids."""
    directory.mkdir()
    rng = np.random.default_rng(0)
    for shard, count in enumerate((600, 1500, 900, 1200)):
        ids = (np.cumsum(rng.integers(1, 3, count)) % 64).astype(np.uint16)
        write_datafile(directory / f"fineweb_{'val' if shard == 0 else 'train'}_{shard:06d}.bin", ids)
    return directory


def test_training_on_shards_resumes_exactly_through_the_command_line(tmp_path):
    """data=token_shards end to end, as a user runs it: a run stopped at step 3 and continued by
    the same command ends bit for bit where the uninterrupted 6-step run does."""
    common = ["data=token_shards", f"data.path={_corpus(tmp_path / 'corpus')}", "data.vocab_size=64",
              f"data.cache_dir={tmp_path / 'cache'}", "model=transformer", "model.n_layers=1", "model.d_model=32",
              "model.n_heads=2", "model.block_size=16", "model.dropout=0.1", "trainer.batch_size=4",
              "trainer.checkpoint_every_n_steps=3"]
    ok(run_cli(common + ["trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'straight'}"], cwd=tmp_path))
    ok(run_cli(common + ["trainer.max_steps=3", f"hydra.run.dir={tmp_path / 'resumed'}"], cwd=tmp_path))
    ok(run_cli(common + ["trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'resumed'}"], cwd=tmp_path))
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "last.pt", weights_only=True)
    assert resumed["progress"]["step"] == 6
    assert_same_weights(checkpoint_weights(tmp_path / "straight"), checkpoint_weights(tmp_path / "resumed"), atol=0)


def test_an_id_past_the_vocabulary_ends_the_command_in_one_line_before_training(tmp_path):
    corpus = _corpus(tmp_path / "corpus")
    proc = run_cli(["data=token_shards", f"data.path={corpus}", "data.vocab_size=60", "data.cache_dir=",
                    "model=transformer", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    refused(proc, f"error: {corpus / 'fineweb_train_000001.bin'}: token ",
            "but the vocabulary has 60 ids (data.vocab_size); set data.vocab_size to at least 64 or tokenize again")
    assert not (tmp_path / "run" / "checkpoints").exists()


RECORDED_SHARDS = '''
"""data=token_shards whose training split records every window the training loader fetches."""
import os
import sys

from torch.utils.data import Dataset

from ringtrain.data.token_shards import TokenShards


class Recorded(Dataset):
    def __init__(self, windows, record):
        self.windows, self.record = windows, record

    def __len__(self):
        return len(self.windows)

    def __getitem__(self, index):
        if sys._getframe(1).f_code.co_filename.endswith("fetch.py"):  # torch's DataLoader fetching
            os.makedirs(self.record, exist_ok=True)
            with open(os.path.join(self.record, f"rank{os.environ.get('RANK', '0')}-{os.getpid()}.txt"), "a") as f:
                f.write(f"{index}\\n")
        return self.windows[index]


class RecordedShards(TokenShards):
    def __init__(self, record: str, **kwargs):
        super().__init__(**kwargs)
        self.record = record

    def setup(self):
        super().setup()
        self.train = Recorded(self.train, self.record)
'''


@pytest.mark.slow
def test_every_window_trains_once_across_sigterm_and_one_process_two_ranks_one_process(tmp_path):
    """Issue 29's recording test: one process accumulating 2 micro-batches, stopped by SIGTERM at
    an observed step; continued on 2 ranks (torchrun, the same global batch) to a later step;
    finished on one process again. Every window of the epoch is trained exactly once over the
    three, and the weights are the uninterrupted run's to 1e-6 (two ranks only sum in another
    order)."""
    import re
    import signal
    import sys
    from collections import Counter

    from conftest import QUIET, REPO
    from helpers import TORCHRUN, Job

    (tmp_path / "recorded_shards.py").write_text(RECORDED_SHARDS.lstrip())
    corpus = _corpus(tmp_path / "corpus")
    windows = len(ShardWindows(TokenShards(str(corpus), seq_len=16, vocab_size=64, cache_dir="").shards["train"], 16))
    common = ["data=token_shards", "data._target_=recorded_shards.RecordedShards", f"data.path={corpus}",
              "data.vocab_size=64", "data.cache_dir=", "model=transformer", "model.n_layers=1", "model.d_model=32",
              "model.n_heads=2", "model.block_size=16", "model.dropout=0.0", "optimizer=sgd", "optimizer.lr=0.1",
              "trainer.seed=3", "trainer.max_epochs=1"]
    one_process, two_ranks = ["trainer.batch_size=4", "trainer.accumulate_grad_batches=2"], \
        ["strategy=ddp", "trainer.batch_size=4"]

    def args(run: Path, record: str, layout: list[str]) -> list[str]:
        return common + layout + [f"+data.record={tmp_path / record}", f"hydra.run.dir={run}"]

    ok(run_cli(args(tmp_path / "straight", "straight", one_process), cwd=tmp_path))

    run, release = tmp_path / "run", tmp_path / "release"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1", "RINGTRAIN_TEST_STEP_SECONDS": "0",
           "RINGTRAIN_TEST_HOLD_AT_STEP": "5", "RINGTRAIN_TEST_HOLD_UNTIL_FILE": str(release)}
    env.pop("PYTHONPATH", None)
    with Job([sys.executable, str(REPO / "tests" / "interruptible_train.py"), *args(run, "first", one_process),
              *QUIET], cwd=tmp_path, env=env) as first:
        first.wait_for_step(5)
        first.send_signal(signal.SIGTERM)
        release.touch()
        status, output = first.finish()
    assert status == 143 and re.search(r"stopped by SIGTERM after step 5; last.pt saved", output), output[-4000:]
    ok(run_cli(args(run, "second", two_ranks) + ["trainer.max_steps=16"], cwd=tmp_path, launcher=TORCHRUN))
    assert torch.load(run / "checkpoints" / "last.pt", weights_only=True)["layout"]["world_size"] == 2
    ok(run_cli(args(run, "third", one_process), cwd=tmp_path))

    def drawn(*records: str) -> Counter:
        counts: Counter = Counter()
        for record in records:
            for file in (tmp_path / record).glob("rank*.txt"):
                counts.update(int(line) for line in file.read_text().split())
        return counts

    assert sorted(drawn("straight")) == list(range(windows))
    together = drawn("first", "second", "third")
    assert sorted(together) == list(range(windows)), f"{windows - len(together)} windows never trained"
    assert max(together.values()) == 1, [i for i, n in together.items() if n > 1][:10]
    assert all(drawn(record) for record in ("first", "second", "third"))
    ended = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert ended["progress"]["epoch"] == 1 and ended["layout"]["world_size"] == 1
    assert_same_weights(checkpoint_weights(tmp_path / "straight"), checkpoint_weights(run), atol=1e-6)
