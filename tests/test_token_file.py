"""Vocabularies, the prepare_tokens command and binary token files (data=token_file)."""
from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from conftest import run_cli, run_module
from helpers import refused
from ringtrain.data import DataError, token_ids, windows_of
from ringtrain.data.prepare_tokens import PrepareError, prepare_random, prepare_text
from ringtrain.data.text import encode_text
from ringtrain.data.token_file import token_file, write_meta
from ringtrain.data.vocab import ByteVocab, CharVocab, vocab_from_state
from ringtrain.errors import ConfigError
from ringtrain.tools.prepare_tokens import prepare_tokens


# Non-ASCII on purpose: 2-, 3- and 4-byte UTF-8 characters, which a chunk boundary can cut.
TEXT = "".join(f"Line {i}: naïve café, €{i * 7 % 100}, 🙂 — the quick brown fox.\n" for i in range(60))


@pytest.fixture
def text_file(tmp_path: Path) -> Path:
    path = tmp_path / "input.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def make_token_dir(directory: Path, train: np.ndarray, val: np.ndarray, meta: dict | None = None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    train.tofile(directory / "train.bin")
    val.tofile(directory / "val.bin")
    (directory / "meta.json").write_text(json.dumps(meta or {"dtype": str(train.dtype), "vocab_size": 100}))
    return directory


def test_vocabularies_round_trip_text_and_their_state():
    chars = CharVocab.from_text(TEXT)
    assert chars.chars == "".join(sorted(set(TEXT))) and chars.size == len(set(TEXT))
    assert chars.decode(chars.encode(TEXT)) == TEXT
    assert CharVocab("ba").encode("abba") == [1, 0, 0, 1]  # ids follow the order of `chars`
    assert chars.encode_tensor(TEXT).tolist() == chars.encode(TEXT)
    with pytest.raises(ValueError, match="'Z' is not in the vocabulary"):
        chars.encode("Zebra")

    data = ByteVocab()
    assert data.size == 256 and data.encode("é🙂") == list("é🙂".encode("utf-8"))
    assert data.decode(data.encode(TEXT)) == TEXT
    assert data.decode(list("é".encode())[:1] + [ord("x")]) == "\ufffdx"  # a cut character, replaced

    # An id a padded output layer can emit decodes as U+FFFD rather than failing the sample.
    assert chars.decode([chars.size, 0]) == "\ufffd" + chars.chars[0] and data.decode([300]) == "\ufffd"


def test_vocab_states_are_plain_data_that_weights_only_loads(tmp_path):
    for vocab in (CharVocab("abc\n€"), ByteVocab()):
        torch.save({"vocab": vocab.to_state()}, tmp_path / "ckpt.pt")
        state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["vocab"]
        assert vocab_from_state(state) == vocab and json.loads(json.dumps(state)) == state
    assert CharVocab("ab").to_state() == {"kind": "char", "chars": "ab"} and ByteVocab().to_state() == {"kind": "byte"}
    with pytest.raises(ValueError, match="unknown vocabulary kind 'wordpiece'; expected one of char, byte, bpe"):
        vocab_from_state({"kind": "wordpiece"})


@pytest.mark.parametrize("vocab_kind", ["char", "byte"])
def test_prepared_windows_are_the_encoded_text(text_file, tmp_path, vocab_kind):
    # 13-byte chunks: boundaries fall inside multi-byte characters many times.
    meta = prepare_text(text_file, tmp_path / "tokens", vocab_kind, val_fraction=0.1, chunk_bytes=13)
    data = token_file(str(tmp_path / "tokens"), block_size=8)
    vocab = vocab_from_state(data.vocab)
    ids = vocab.encode(TEXT)
    split = int(len(ids) * 0.9)
    assert meta["dtype"] == "uint16" and data.dims == {"vocab_size": vocab.size}
    if vocab_kind == "char":
        assert (vocab.chars, ids) == (encode_text(TEXT)[0], encode_text(TEXT)[1].tolist())  # data=text's ids
    for dataset, part in ((data.train, ids[:split]), (data.val, ids[split:])):
        expected = windows_of(torch.tensor(part), 8)
        assert len(dataset) == (len(part) - 1) // 8 == len(expected)
        for i in (0, 1, len(dataset) - 1):
            inputs, targets = dataset[i]
            assert inputs.dtype == torch.int64 and inputs.tolist() == part[i * 8 : i * 8 + 8]
            assert targets.tolist() == part[i * 8 + 1 : i * 8 + 9]
        order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0))
        inputs, targets = dataset.get_batch(order)
        assert inputs.equal(expected[order, :-1]) and targets.equal(expected[order, 1:])
        items = [dataset[i] for i in order.tolist()]
        assert inputs.equal(torch.stack([x for x, _ in items])) and targets.equal(torch.stack([y for _, y in items]))
    assert vocab.decode(data.train[0][0]) == TEXT[:8]  # "Line 0: ", the same in either vocabulary


def test_the_command_writes_a_directory_that_decodes_on_its_own(text_file, tmp_path):
    proc = run_module("prepare_tokens", [f"input={text_file}", f"output={tmp_path / 'out'}", "vocab=byte",
                                         "val_fraction=0.25"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    meta = json.loads((tmp_path / "out" / "meta.json").read_text())
    num_bytes = len(TEXT.encode())
    assert meta["vocab"] == {"kind": "byte"} and meta["vocab_size"] == 256 and meta["dtype"] == "uint16"
    assert (meta["train_tokens"], meta["val_tokens"]) == (int(num_bytes * 0.75), num_bytes - int(num_bytes * 0.75))
    assert os.path.getsize(tmp_path / "out" / "train.bin") == 2 * meta["train_tokens"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["meta.json", "train.bin", "val.bin"]  # no temporaries
    assert "wrote" in proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["input.txt", "out"]  # nothing of Hydra's


def test_unusable_inputs_end_the_command_with_one_line_and_exit_2(tmp_path):
    missing = run_module("prepare_tokens", [f"input={tmp_path / 'nope.txt'}", f"output={tmp_path / 'out'}"])
    assert refused(missing) == f"error: {tmp_path / 'nope.txt'} does not exist or is not a file; pass a UTF-8 text file"
    assert missing.stdout == ""
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("ab".encode() * 50 + "café".encode("latin-1") + b"z" * 100)
    not_utf8 = run_module("prepare_tokens", [f"input={latin1}", f"output={tmp_path / 'out'}", "vocab=char"])
    refused(not_utf8, "is not UTF-8 text (byte 103); convert it to UTF-8 first")
    with pytest.raises(PrepareError, match=r"is not UTF-8 text \(byte 103\); convert it to UTF-8 first"):
        prepare_text(latin1, tmp_path / "out", "byte")
    assert not (tmp_path / "out").exists()  # nothing half-written is left behind
    with pytest.raises(ConfigError, match="give vocab_size=V"):
        prepare_tokens(str(tmp_path / "rnd"), random_tokens=100)


def test_random_tokens_fill_a_directory_in_range(tmp_path):
    prepare_tokens(str(tmp_path / "rnd"), random_tokens=100000, vocab_size=50257)
    data = token_file(str(tmp_path / "rnd"), block_size=64)
    assert data.train.num_tokens == 100000 and data.val.num_tokens == 10000 and data.vocab is None
    tokens = np.fromfile(tmp_path / "rnd" / "train.bin", dtype=np.uint16)
    assert tokens.max() < 50257 and tokens.max() > 50000 and len(np.unique(tokens)) > 40000  # uniform-ish
    assert prepare_random(tmp_path / "big", 10, 70000)["dtype"] == "uint32"  # ids past 65535 need 4 bytes


def test_a_dataset_pickles_as_a_path_and_reopens_the_map(tmp_path):
    tokens = np.arange(50000, dtype=np.uint16) % 97
    directory = make_token_dir(tmp_path / "d", tokens, tokens[:100])
    dataset = token_file(str(directory), block_size=16).train
    expected = dataset.get_batch(torch.tensor([5, 0, 3000]))  # the map is open now
    blob = pickle.dumps(dataset)
    assert len(blob) < 1000 < tokens.nbytes  # the pages did not travel
    copy = pickle.loads(blob)
    assert all(a.equal(b) for a, b in zip(copy.get_batch(torch.tensor([5, 0, 3000])), expected))
    assert copy[-1][1][-1].item() == tokens[len(dataset) * 16] and dataset[len(dataset) - 1][0].equal(copy[-1][0])
    with pytest.raises(IndexError):
        dataset.get_batch(torch.tensor([len(dataset)]))


def test_the_file_is_never_read_whole(tmp_path):
    """A 256 MB file: building it (which checks every id, a mapped chunk at a time) and
    gathering windows from all over it must not take it into the resident set."""
    directory = tmp_path / "sparse"
    make_token_dir(directory, np.zeros(1000, dtype=np.uint16), np.zeros(1000, dtype=np.uint16))
    size = 256 << 20
    with open(directory / "train.bin", "r+b") as handle:
        handle.truncate(size)  # sparse: zeros that cost no disk
        handle.seek(size - 2)
        handle.write(np.uint16(99).tobytes())  # the largest id, at the very end
    rss_before = _resident_mb()
    data = token_file(str(directory), block_size=256)
    assert token_ids.largest_token_id(directory / "train.bin", "uint16") == 99  # the whole file was read
    assert len(data.train) == (size // 2 - 1) // 256
    inputs, targets = data.train.get_batch(torch.linspace(0, len(data.train) - 2, 200).long())
    assert inputs.shape == (200, 256) and inputs.sum().item() == 0
    if rss_before is not None:
        assert _resident_mb() - rss_before < 64, "a 256 MB file was read into memory"


def test_an_id_past_the_vocabulary_anywhere_in_the_file_is_one_line_before_any_work(tmp_path):
    directory = make_token_dir(tmp_path / "tokens", np.zeros(1000, dtype=np.uint16), np.zeros(1000, dtype=np.uint16))
    with open(directory / "train.bin", "r+b") as handle:
        handle.truncate(16 << 20)  # sparse zeros, and past the first 4 MB (once all that was checked) ...
        handle.seek(9 << 20)
        handle.write(np.uint16(100).tobytes())  # ... the id 100 of a 100-id vocabulary
    proc = run_cli(["model=transformer", "data=token_file", f"data.path={directory}", f"data.cache_dir={tmp_path / 'cache'}",
                    f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path)
    assert refused(proc) == (
        f"error: data.path={str(directory)!r}: train.bin holds token id 100, but the vocabulary has 100 ids "
        f"(meta.json's vocab_size); fix vocab_size or the dtype in meta.json, or tokenize again"
    )
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()


def test_the_largest_id_is_read_once_per_file_version(tmp_path, monkeypatch):
    """prepare_tokens records each split's largest id in meta.json; another directory's is
    found by reading its files once and kept in cache_dir, keyed by path, size and mtime."""
    reads = []
    scan = token_ids._scan
    monkeypatch.setattr(token_ids, "_scan", lambda path, *args: reads.append(Path(path).name) or scan(path, *args))
    prepare_random(tmp_path / "prepared", 5000, 300)
    meta = json.loads((tmp_path / "prepared" / "meta.json").read_text())
    for split in ("train", "val"):
        assert meta["max_ids"][split]["max_id"] == np.fromfile(tmp_path / "prepared" / f"{split}.bin", dtype=np.uint16).max()
    token_file(str(tmp_path / "prepared"), block_size=16)
    assert reads == []  # meta.json said, and the files are the ones it describes

    tokens = np.arange(1000, dtype=np.uint16) % 97
    directory = make_token_dir(tmp_path / "d", tokens, tokens)
    old = 1_000_000_000  # long settled: no change can hide inside one tick of the file time
    for split in ("train", "val"):
        os.utime(directory / f"{split}.bin", (old, old))
    cache = tmp_path / "cache"
    token_file(str(directory), block_size=16, cache_dir=str(cache))
    assert sorted(reads) == ["train.bin", "val.bin"] and len(list(cache.iterdir())) == 2
    token_ids._seen.clear()  # another process: only the cache
    token_file(str(directory), block_size=16, cache_dir=str(cache))
    assert len(reads) == 2
    (directory / "train.bin").write_bytes((tokens + 10).tobytes())  # the same size, a new mtime
    with pytest.raises(DataError, match="train.bin holds token id 106, but the vocabulary has 100 ids"):
        token_file(str(directory), block_size=16, cache_dir=str(cache))


def _resident_mb() -> float | None:
    try:
        status = Path("/proc/self/status").read_text()
    except OSError:
        return None
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def _write(directory: Path, name: str, content: bytes) -> None:
    (directory / name).write_bytes(content)


TOKENS = np.arange(1000, dtype=np.uint16) % 100


@pytest.mark.parametrize("damage, message", [
    (lambda d: os.remove(d / "val.bin"), "has no val.bin; a token directory holds train.bin, val.bin and meta.json"),
    (lambda d: os.remove(d / "train.bin"), "has no train.bin"),
    (lambda d: os.remove(d / "meta.json"), "has no meta.json"),
    (lambda d: _write(d, "meta.json", b'{"dtype": "int16", "vocab_size": 100}'),
     "meta.json has dtype='int16'; set it to \"uint16\" or \"uint32\""),
    (lambda d: _write(d, "meta.json", b'{"dtype": "uint16"}'), "meta.json has vocab_size=None; set it to the number"),
    (lambda d: _write(d, "meta.json", b"{dtype: uint16"), "meta.json is not valid JSON"),
    (lambda d: _write(d, "meta.json", b'{"dtype": "uint16", "vocab_size": 100, "vocab": {"kind": "wordpiece"}}'),
     "meta.json's vocab is unusable (unknown vocabulary kind 'wordpiece'"),
    (lambda d: _write(d, "train.bin", TOKENS.tobytes() + b"\x01"),
     "train.bin is 2001 bytes, not a whole number of uint16 tokens (2 bytes each)"),
    (lambda d: _write(d, "val.bin", TOKENS[:16].tobytes()),
     "val.bin holds 16 tokens, fewer than one window of block_size + 1 = 17; use more data or a smaller model.block_size"),
    (lambda d: _write(d, "train.bin", (TOKENS + 50).tobytes()),
     "train.bin holds token id 149, but the vocabulary has 100 ids (meta.json's vocab_size)"),
])
def test_each_broken_directory_is_refused_in_one_line(tmp_path, damage, message):
    directory = make_token_dir(tmp_path / "d", TOKENS, TOKENS)
    token_file(str(directory), block_size=16)  # the control: intact, it builds
    damage(directory)
    with pytest.raises(DataError) as error:
        token_file(str(directory), block_size=16)
    assert message in str(error.value) and "\n" not in str(error.value)
    assert str(error.value).startswith(f"data.path={str(directory)!r}")


def test_a_missing_or_unset_directory_is_refused(tmp_path, monkeypatch):
    # A relative path names the directory it was looked for in (every data set's missing path
    # says it the same way, data/__init__.py's looked_in); an absolute one needs no such note.
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError) as error:
        token_file("nope", block_size=8)
    assert str(error.value).startswith(f"data.path='nope' does not exist (looked in {tmp_path}); ringtrain prepare_tokens input=")
    with pytest.raises(DataError) as error:
        token_file(str(tmp_path / "nope"), block_size=8)
    assert str(error.value).startswith(f"data.path={str(tmp_path / 'nope')!r} does not exist; ringtrain prepare_tokens input=")
    with pytest.raises(DataError, match="data.path is not set"):
        token_file("", block_size=8)
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="is not a directory"):
        token_file(str(tmp_path / "file"), block_size=8)


def test_uint32_files_and_meta_written_by_write_meta(tmp_path):
    tokens = (np.arange(3000, dtype=np.uint32) * 37) % 70000
    directory = make_token_dir(tmp_path / "d", tokens, tokens, meta={})
    write_meta(directory, "uint32", 70000, CharVocab("xy").to_state())
    data = token_file(str(directory), block_size=32)
    assert data.dims == {"vocab_size": 70000} and data.vocab == {"kind": "char", "chars": "xy"}
    assert data.train[2][0].tolist() == tokens[64:96].tolist()


def test_a_dataloader_with_spawned_workers_reads_the_windows(tmp_path):
    """Workers started with spawn receive the pickled dataset and reopen the map themselves."""
    tokens = (np.arange(20000, dtype=np.uint16) * 7) % 1000
    dataset = token_file(str(make_token_dir(tmp_path / "d", tokens, tokens[:100], {"dtype": "uint16", "vocab_size": 1000})),
                         block_size=32).train
    dataset[0]  # open the map in the parent first: it must not be what the workers get
    loader = DataLoader(dataset, batch_size=50, num_workers=2, multiprocessing_context="spawn")
    inputs, targets = zip(*loader)
    everything = dataset.get_batch(torch.arange(len(dataset)))
    assert torch.cat(inputs).equal(everything[0]) and torch.cat(targets).equal(everything[1])
    assert len(dataset) == 624 and everything[0][1, 0].item() == tokens[32]


def test_without_pread_batches_come_from_the_memory_map_the_same(tmp_path, monkeypatch):
    tokens = (np.arange(5000, dtype=np.uint16) * 13) % 500
    dataset = token_file(str(make_token_dir(tmp_path / "d", tokens, tokens[:100], {"dtype": "uint16", "vocab_size": 500})),
                         block_size=20).train
    indices = torch.tensor([248, 0, -1, 17])
    by_reads = dataset.get_batch(indices)
    assert dataset.tokens.shape == (5000,) and np.array_equal(dataset.tokens[:40], tokens[:40])
    monkeypatch.delattr(os, "pread")  # as on Windows
    by_map = dataset.get_batch(indices)
    assert by_map[0].equal(by_reads[0]) and by_map[1].equal(by_reads[1])
    assert by_map[1][0].tolist() == tokens[248 * 20 + 1 : 249 * 20 + 1].tolist()


def test_a_file_cut_short_while_in_use_is_an_error_not_garbage(tmp_path):
    directory = make_token_dir(tmp_path / "d", TOKENS, TOKENS)
    dataset = token_file(str(directory), block_size=16).train
    dataset.get_batch(torch.tensor([len(dataset) - 1]))
    os.truncate(directory / "train.bin", 1000)
    with pytest.raises(DataError, match="train.bin is shorter than when it was opened; it changed while in use"):
        dataset.get_batch(torch.tensor([len(dataset) - 1]))


@pytest.mark.slow
def test_training_on_a_token_file_resumes_exactly_and_keeps_its_vocabulary(text_file, tmp_path):
    """data=token_file end to end: a run stopped at step 7 and continued by the same command
    ends bit for bit where the uninterrupted run does; the checkpoint carries the vocabulary."""
    from conftest import train_in_process

    prepare_text(text_file, tmp_path / "tokens", vocab_kind="char")
    common = ["model=transformer", "data=token_file", f"data.path={tmp_path / 'tokens'}", "model.block_size=8",
              "model.d_model=16", "model.n_heads=2", "model.n_layers=1", "trainer.batch_size=4",
              "trainer.checkpoint_every_n_steps=7", "model.dropout=0.1"]
    train_in_process(common + ["trainer.max_steps=20"], tmp_path / "straight")
    train_in_process(common + ["trainer.max_steps=7"], tmp_path / "resumed")
    train_in_process(common + ["trainer.max_steps=20"], tmp_path / "resumed")  # auto-resume from step 7
    straight = torch.load(tmp_path / "straight" / "checkpoints" / "last.pt", weights_only=True)
    resumed = torch.load(tmp_path / "resumed" / "checkpoints" / "last.pt", weights_only=True)
    assert resumed["progress"]["step"] == 20
    assert all(torch.equal(straight["model"][k], resumed["model"][k]) for k in straight["model"])
    assert vocab_from_state(resumed["vocab"]).decode([0, 1]) == "".join(sorted(set(text_file.read_text()))[:2])
