"""data=stream and data=mixture (data/streams.py, data/mixture.py): local files streamed and
tokenized on the fly into next-token windows, shared over ranks and DataLoader workers and
resumed exactly through torchdata's StatefulDataLoader; and the protocol a user's own stream
follows to go the same way (`NumberedSamples` below)."""
from __future__ import annotations

import io
import json
import random
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

pytest.importorskip("tokenizers", reason="the hf extra (pip install 'ringtrain[hf]') is not installed")
pytest.importorskip("pyarrow", reason="the hf extra (pip install 'ringtrain[hf]') is not installed")
pytest.importorskip("torchdata", reason="torchdata is not installed (pip install torchdata)")

import pyarrow  # noqa: E402
import pyarrow.parquet  # noqa: E402
from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: E402

from conftest import compose_config  # noqa: E402
from ringtrain.data import DataError  # noqa: E402
from ringtrain.data.bpe import train_bpe  # noqa: E402
from ringtrain.data.mixture import MixedStream, StreamMixture  # noqa: E402
from ringtrain.data.streams import StreamText  # noqa: E402
from ringtrain.data.vocab import vocab_from_state  # noqa: E402

_RNG = random.Random(0)
WORDS = "the king and queen of rome speak to romeo while juliet sleeps under a pale moon café 🙂".split()
CODE = "def return import class self value if else for in range print lambda yield".split()
# Each document names itself ("doc 17:"), so a test can tell which documents a reader read; they
# vary in length (one window to many) and hold runs of spaces and multi-byte characters.
DOCS = [f"doc {i}:{'  ' if i % 7 == 0 else ' '}" + " ".join(_RNG.choice(WORDS) for _ in range(_RNG.randint(1, 40)))
        for i in range(400)]
CODE_DOCS = [f"code {i}: " + " ".join(_RNG.choice(CODE) for _ in range(_RNG.randint(1, 30))) for i in range(200)]
VAL_DOCS = [f"held {i}: " + " ".join(_RNG.choice(WORDS) for _ in range(12)) for i in range(20)]
SEQ_LEN = 8
# torchdata 0.11's StatefulDataLoader calls torch.set_vital, which torch 2.13 deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")


def write_jsonl(path: Path, texts: list[str], column: str = "text") -> Path:
    with path.open("w", encoding="utf-8") as f:
        for i, text in enumerate(texts):
            f.write(json.dumps({"id": i, column: text}) + "\n")
    return path


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """DOCS as JSON Lines, Parquet (row groups of 25) and text, also cut into three JSON Lines
    files; CODE_DOCS; VAL_DOCS; and a BPE tokenizer trained on them."""
    root = tmp_path_factory.mktemp("streams")
    write_jsonl(root / "docs.jsonl", DOCS)
    pyarrow.parquet.write_table(pyarrow.table({"text": DOCS}), root / "docs.parquet", row_group_size=25)
    (root / "docs.txt").write_text("".join(doc + "\n" for doc in DOCS), encoding="utf-8")
    (root / "parts").mkdir()
    for part in range(3):
        write_jsonl(root / "parts" / f"part-{part}.jsonl", DOCS[part::3])
    write_jsonl(root / "code.jsonl", CODE_DOCS, column="content")
    write_jsonl(root / "val.jsonl", VAL_DOCS)
    (root / "tokenizer.json").write_text(train_bpe(DOCS + CODE_DOCS, 300).tokenizer_json, encoding="utf-8")
    return root


def stream(corpus: Path, path: str, **options) -> StreamText:
    options = {"seq_len": SEQ_LEN, "val_path": str(corpus / "val.jsonl"), "piece_bytes": 2048, **options}
    data = StreamText(str(corpus / path), str(corpus / "tokenizer.json"), **options)
    data.setup()
    return data


def token_stream(data: StreamText, docs: list[str]) -> list[int]:
    """The documents tokenized whole, each followed by the end-of-text id."""
    return [i for doc in docs for i in data.tokenizer.encode(doc) + [data.eot_id]]


def loader(dataset, workers: int, batch_size: int = 4) -> StatefulDataLoader:
    return StatefulDataLoader(dataset, batch_size=batch_size, num_workers=workers)


def take(batches, count: int) -> list:
    return [next(batches) for _ in range(count)]


def through_a_checkpoint(state: dict) -> dict:
    """The state as ringtrain's checkpoint gives it back: saved, and loaded with weights_only."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@pytest.mark.parametrize("file", ["docs.jsonl", "docs.parquet", "docs.txt"])
def test_one_reader_cuts_the_documents_tokenized_whole_into_windows_epoch_after_epoch(corpus, file):
    data = stream(corpus, file)
    ids = token_stream(data, DOCS)
    batches = iter(loader(data.train, workers=0))
    epoch_windows = (len(ids) - 1) // SEQ_LEN
    samples = [pair for inputs, targets in take(batches, epoch_windows // 4 + 30) for pair in zip(inputs, targets)]
    cycled = ids * 2  # the second epoch continues the same stream: the carry crosses the epoch's end
    for k, (inputs, targets) in enumerate(samples):
        assert inputs.tolist() == cycled[k * SEQ_LEN: (k + 1) * SEQ_LEN], k
        assert targets.tolist() == cycled[k * SEQ_LEN + 1: (k + 1) * SEQ_LEN + 1], k
    assert data.train.position["epoch"] == 1 and data.train.completed_epochs(batches.state_dict()) == 1
    # One id more than the tokenizer had: the end-of-text token, which sampling decodes.
    assert data.dims == {"vocab_size": 301} and data.eot_id == 300
    assert vocab_from_state(data.vocab).decode([*data.tokenizer.encode("doc 1"), 300]) == "doc 1<|endoftext|>"


def test_validation_holds_out_the_first_documents_and_training_starts_after_them(corpus):
    data = stream(corpus, "docs.jsonl", val_path=None, val_documents=30)
    held_out = token_stream(data, DOCS[:30])
    assert len(data.val) == (len(held_out) - 1) // SEQ_LEN
    assert [data.val[i][0].tolist() for i in range(3)] == [held_out[i * SEQ_LEN: (i + 1) * SEQ_LEN] for i in range(3)]
    training = token_stream(data, DOCS[30:])
    count = len(training) // SEQ_LEN // 4 + 10  # into the second epoch, which starts at DOCS[30] again
    samples = [inputs for batch, _ in take(iter(loader(data.train, workers=0)), count) for inputs in batch]
    cycled = training * 2
    assert [s.tolist() for s in samples] == [cycled[k * SEQ_LEN: (k + 1) * SEQ_LEN] for k in range(len(samples))]


def test_the_first_batch_reads_a_bounded_part_of_the_files_however_large(corpus, tmp_path):
    many = DOCS * 25  # 10,000 documents, 0.9 MB
    write_jsonl(tmp_path / "big.jsonl", many)
    pyarrow.parquet.write_table(pyarrow.table({"text": many}), tmp_path / "big.parquet", row_group_size=500)
    (tmp_path / "tokenizer.json").write_text((corpus / "tokenizer.json").read_text())
    (tmp_path / "val.jsonl").write_text((corpus / "val.jsonl").read_text())
    # JSON Lines: the few lines the first 8 windows need; Parquet: the first row group.
    for name, unit, bound in (("big.jsonl", "bytes", 4096), ("big.parquet", "rows", 500)):
        data = stream(tmp_path, name, piece_bytes=1 << 20)
        next(iter(loader(data.train, workers=0, batch_size=8)))
        whole = (tmp_path / name).stat().st_size if unit == "bytes" else len(many)
        read = data.train.reads[unit]
        assert 0 < read <= bound and whole >= 20 * bound, (name, read, whole)


def resumed_batches(corpus: Path, file: str, workers: int, state: dict, count: int) -> tuple[list, Counter]:
    """`count` batches of a fresh dataset and loader given `state`, and what the dataset had read for the
    first of them (in this process: without workers)."""
    data = stream(corpus, file)
    resumed = loader(data.train, workers)
    resumed.load_state_dict(through_a_checkpoint(state))
    batches = iter(resumed)
    first = next(batches)
    return [first, *take(batches, count - 1)], Counter(data.train.reads)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("file", ["docs.jsonl", "docs.parquet"])
def test_a_resumed_loader_gives_the_next_batches_and_reads_as_little_at_90_as_at_1_percent(corpus, file, workers):
    data = stream(corpus, file)
    epoch_batches = len(token_stream(data, DOCS)) // SEQ_LEN // 4
    stops = (max(1, epoch_batches // 100), epoch_batches * 9 // 10)
    uninterrupted = take(iter(loader(data.train, workers)), stops[1] + 5)
    read_for_first = {}
    for stop in stops:
        interrupted = loader(stream(corpus, file).train, workers)
        take(iter(interrupted), stop)
        after, read_for_first[stop] = resumed_batches(corpus, file, workers, interrupted.state_dict(), 5)
        for got, expected in zip(after, uninterrupted[stop:stop + 5], strict=True):
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1]), stop
    if workers == 0:  # bytes (JSON Lines) or rows (Parquet): a seek and one document or row group, not k's part
        early, late = (sum(read_for_first[stop].values()) for stop in stops)
        assert 0 < late <= 2 * early + 1024, (early, late)
        assert late < sum(data.train.reads.values()) / 4  # what the uninterrupted loader read to get there


def test_two_ranks_of_two_workers_read_every_document_once_per_epoch(corpus):
    # seq_len 1: window k's input is the reader's token k, so a reader's inputs are its token stream.
    epochs = []
    for rank in range(2):
        data = stream(corpus, "parts/*.jsonl", seq_len=1, piece_bytes=1024)
        data.train.set_rank(rank, 2)
        batches = take(iter(loader(data.train, workers=2, batch_size=64)), 240)  # 7,680 tokens a reader, its share 4,800
        for worker in range(2):  # the loader takes batches from its workers in turn
            ids = [i for inputs, _ in batches[worker::2] for i in inputs[:, 0].tolist()]
            docs = documents_of(ids, data)
            epochs.append(docs[: docs.index(docs[0], 1)])  # up to where its first document comes again
    assert all(epochs) and Counter(doc for epoch in epochs for doc in epoch) == Counter(DOCS)


def documents_of(ids: list[int], data: StreamText) -> list[str]:
    """The texts of the documents a token stream holds whole (each ended by end-of-text)."""
    docs, current = [], []
    for i in ids:
        if i == data.eot_id:
            docs.append(data.tokenizer.decode(current))
            current = []
        else:
            current.append(i)
    return docs


def test_resuming_on_another_layout_or_other_data_is_refused_in_one_line(corpus, tmp_path):
    saved = loader(stream(corpus, "docs.jsonl").train, workers=2)
    take(iter(saved), 3)
    state = saved.state_dict()
    train = stream(corpus, "docs.jsonl").train
    assert train.check_resume(state, rank=0, world_size=1, num_workers=2) is None
    assert train.check_resume(state, rank=0, world_size=2, num_workers=2) == (
        "the data stream was saved with 1 rank, not 2: a position continues exactly only with the same ranks, "
        "DataLoader workers and data settings; resume on 1 (torchrun --nproc_per_node=1, or strategy.nproc_per_node=1), "
        "or keep the weights and start the data afresh in a new run (trainer.init_from=<the checkpoint>)")
    assert train.check_resume(state, 0, 1, num_workers=0).startswith(
        "the data stream was saved with trainer.num_workers=2, not 0: a position continues exactly only with the same "
        "ranks, DataLoader workers and data settings; resume with trainer.num_workers=2, or keep the weights")
    longer = stream(corpus, "docs.jsonl", seq_len=16).train
    assert longer.check_resume(state, 0, 1, 2).startswith("the data stream was saved with data.seq_len=8, not 16")
    # A file that changed since: what the user can do, never a digest to set (files='<hash>').
    changed = tmp_path / "changed.jsonl"
    changed.write_bytes((corpus / "docs.jsonl").read_bytes())
    saved_over_changed = loader(stream(corpus, str(changed)).train, workers=2)
    take(iter(saved_over_changed), 3)
    with changed.open("a") as file:
        file.write(json.dumps({"text": "one more document"}) + "\n")
    reason = stream(corpus, str(changed)).train.check_resume(saved_over_changed.state_dict(), 0, 1, 2)
    assert reason.startswith("the data stream was saved with other files (data.path: their names or sizes, or the "
                             "held-out documents, differ): a position continues exactly only"), reason
    assert "resume over the files it read, unchanged, or keep the weights and start the data afresh" in reason
    assert "files=" not in reason
    # A reader refuses a state of another reader's too, should it be given one without the check.
    single = loader(stream(corpus, "docs.jsonl").train, workers=0)
    take(iter(single), 3)
    other_rank = stream(corpus, "docs.jsonl").train
    other_rank.set_rank(1, 2)
    with pytest.raises(DataError, match=r"^the data stream was saved with 1 rank, not 2: "):
        other_rank.load_state_dict(single.state_dict()["dataset_state"])


class NumberedSamples(IterableDataset):
    """A user's own stream, as ringtrain's loop takes it (the contract, in full): an infinite
    IterableDataset of the numbers first, first + 1, ..., first + size - 1, over and over.

    - set_rank(rank, world_size): called on every rank before iterating;
    - __iter__: each reader (rank x DataLoader worker, get_worker_info()) yields its own share;
    - state_dict() / load_state_dict(state): this reader's position, after the last sample it
      yielded; the StatefulDataLoader keeps one per worker and gives each back to its worker;
    - check_resume(loader_state, rank, world_size, num_workers) (optional): why a saved loader
      state cannot resume here, in one line, or None.
    """

    def __init__(self, size: int, first: int = 0):
        self.size, self.first = size, first
        self.rank, self.world_size = 0, 1
        self.epoch, self.index = 0, 0  # the position: the next sample is number `index` of this reader's share

    def set_rank(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size

    def readers(self) -> tuple[int, int]:
        worker = get_worker_info()
        workers = worker.num_workers if worker else 1
        return self.rank * workers + (worker.id if worker else 0), self.world_size * workers

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "index": self.index, "readers": self.readers()[1]}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.index = state["epoch"], state["index"]

    def check_resume(self, loader_state: dict, rank: int, world_size: int, num_workers: int) -> str | None:
        saved = loader_state["_snapshot"]["_worker_snapshots"]["worker_0"]["dataset_state"]["readers"] \
            if "_snapshot" in loader_state else loader_state["dataset_state"]["readers"]
        readers = world_size * max(1, num_workers)
        return None if saved == readers else f"numbered samples were shared by {saved} readers, not {readers}"

    def __iter__(self):
        reader, readers = self.readers()
        share = range(reader, self.size, readers)
        while True:
            while self.index < len(share):
                number = self.first + share[self.index]
                self.index += 1  # the position after this sample, before it is handed out
                yield torch.tensor(number)
            self.epoch, self.index = self.epoch + 1, 0


def test_a_users_own_stateful_stream_resumes_exactly_through_the_same_loader_with_two_workers():
    uninterrupted = [batch.tolist() for batch in take(iter(loader(NumberedSamples(48), workers=2, batch_size=4)), 30)]
    # Each worker yields 6 batches of its 24 numbers an epoch: the first 12 batches are every number once.
    assert sorted(n for batch in uninterrupted[:12] for n in batch) == list(range(48)) and uninterrupted[12] == uninterrupted[0]
    stopped = loader(NumberedSamples(48), workers=2, batch_size=4)
    take(iter(stopped), 13)
    state = through_a_checkpoint(stopped.state_dict())
    fresh = NumberedSamples(48)
    assert fresh.check_resume(state, 0, 1, 2) is None
    assert fresh.check_resume(state, 0, 2, 2) == "numbered samples were shared by 2 readers, not 4"
    resumed = loader(fresh, workers=2, batch_size=4)
    resumed.load_state_dict(state)
    assert [batch.tolist() for batch in take(iter(resumed), 17)] == uninterrupted[13:]


def mixture(corpus: Path, weights: dict[str, float], **options) -> StreamMixture:
    """DOCS (web) and CODE_DOCS (code) mixed by `weights`."""
    sources = {"web": {"path": str(corpus / "docs.jsonl"), "val_path": str(corpus / "val.jsonl"), "piece_bytes": 2048},
               "code": {"path": str(corpus / "code.jsonl"), "text_column": "content", "val_documents": 20,
                        "piece_bytes": 2048}}
    data = StreamMixture(sources, weights, str(corpus / "tokenizer.json"), seq_len=SEQ_LEN, **options)
    data.setup()
    return data


def test_a_mixture_draws_each_source_in_proportion_to_its_weight(corpus):
    data = mixture(corpus, {"web": 0.7, "code": 0.3})
    batches = iter(loader(data.train, workers=0, batch_size=100))
    take(batches, 100)
    proportions = data.train.realized_proportions(batches.state_dict())
    assert sum(data.train.drawn_counts(batches.state_dict()).values()) == 10_000
    assert abs(proportions["web"] - 0.7) <= 0.02 and abs(proportions["code"] - 0.3) <= 0.02, proportions
    assert data.train.realized_proportions() == proportions  # this process's own counts, without workers
    assert data.dims == {"vocab_size": 301} and len(data.val) == len(data.streams["web"].val) + len(data.streams["code"].val)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_mixture_continues_the_same_sequence_of_sources_and_windows(corpus, workers):
    weights = {"web": 0.5, "code": 0.5}
    reference = mixture(corpus, weights).train
    whole = loader(reference, workers)
    uninterrupted = take(iter(whole), 40)
    stopped = loader(mixture(corpus, weights).train, workers)
    take(iter(stopped), 15)
    state = through_a_checkpoint(stopped.state_dict())
    fresh = mixture(corpus, weights).train
    assert fresh.check_resume(state, 0, 1, workers) is None and fresh.resume_note(state) is None
    resumed = loader(fresh, workers)
    resumed.load_state_dict(state)
    for got, expected in zip(take(iter(resumed), 25), uninterrupted[15:], strict=True):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert fresh.drawn_counts(resumed.state_dict()) == reference.drawn_counts(whole.state_dict())


def test_changed_weights_on_resume_apply_from_there_and_are_reported():
    def numbered(weights: dict[str, float]) -> MixedStream:
        return MixedStream({"a": NumberedSamples(10**6), "b": NumberedSamples(10**6, first=10**7)}, weights, seed=3)

    stopped = loader(numbered({"a": 1, "b": 1}), workers=0, batch_size=50)
    before = [n for batch in take(iter(stopped), 20) for n in batch.tolist()]
    state = through_a_checkpoint(stopped.state_dict())
    reweighted = numbered({"a": 9, "b": 1})
    assert reweighted.resume_note(state) == (
        "data mixture weights changed on resume: a 0.5 -> 0.9, b 0.5 -> 0.1; the sources continue from their saved "
        "positions and the new weights apply from here")
    resumed = loader(reweighted, workers=0, batch_size=50)
    resumed.load_state_dict(state)
    after = [n for batch in take(iter(resumed), 100) for n in batch.tolist()]
    a_before, a_after = ([n for n in part if n < 10**7] for part in (before, after))
    b_before, b_after = ([n for n in part if n >= 10**7] for part in (before, after))
    assert a_after[0] == a_before[-1] + 1 and b_after[0] == b_before[-1] + 1  # each source where it was
    assert abs(len(a_after) / len(after) - 0.9) <= 0.02
    assert reweighted.drawn_counts() == {"a": len(a_before) + len(a_after), "b": len(b_before) + len(b_after)}


def test_mixture_weights_that_do_not_match_the_sources_are_refused(corpus):
    with pytest.raises(DataError) as info:
        mixture(corpus, {"web": 0.7, "books": 0.3})
    assert str(info.value) == ("data.weights names ['books', 'web'] but data.sources has ['code', 'web']; "
                               "give each source one weight, e.g. +data.weights.web=0.5")


def test_the_stream_and_mixture_configs_compose_and_build_language_model_data(corpus):
    from hydra.utils import instantiate

    tokenizer = f"data.tokenizer={corpus / 'tokenizer.json'}"
    cfg = compose_config(["model=transformer", "model.block_size=16", "data=stream", f"data.path={corpus / 'docs.parquet'}",
                          tokenizer, "data.val_documents=10"])
    data = instantiate(cfg.data, _convert_="all")
    data.setup()
    assert cfg.task._target_ == "ringtrain.data.tasks.LanguageModelTask"
    assert isinstance(data, StreamText) and data.seq_len == 16 and next(iter(data.train))[0].shape == (16,)
    cfg = compose_config(["model=transformer", "model.block_size=16", "data=mixture", tokenizer,
                          f"+data.sources.web.path={corpus / 'docs.txt'}", "+data.sources.web.val_documents=10", f"+data.sources.code.path={corpus / 'code.jsonl'}",
                          "+data.sources.code.text_column=content", "+data.sources.code.val_documents=10",
                          "+data.weights.web=0.7", "+data.weights.code=0.3"])
    data = instantiate(cfg.data, _convert_="all")
    data.setup()
    assert cfg.task._target_ == "ringtrain.data.tasks.LanguageModelTask"
    assert isinstance(data.train, MixedStream) and data.train.weights == {"web": 0.7, "code": 0.3}
    assert next(iter(data.train))[0].shape == (16,)


# --- bad data: one line each, naming the file (and the line), the problem and the fix ----------------------


def constructed(corpus: Path, path: Path | str, **options) -> str:
    """The DataError message a StreamText over `path` is refused with when it is built."""
    with pytest.raises(DataError) as info:
        StreamText(str(path), str(corpus / "tokenizer.json"), **options)
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_corrupt_parquet_file_is_refused_naming_it(corpus, tmp_path):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this was cut short")
    message = constructed(corpus, tmp_path / "*.parquet")
    assert message.startswith(f"data.path: {bad} is not a readable Parquet file (")
    assert message.endswith("); rewrite it or leave it out of data.path")


def test_a_parquet_file_damaged_inside_is_refused_naming_its_row_group(corpus, tmp_path):
    path = tmp_path / "damaged.parquet"
    pyarrow.parquet.write_table(pyarrow.table({"text": DOCS}), path, row_group_size=100)
    data = bytearray(path.read_bytes())
    page = pyarrow.parquet.read_metadata(path).row_group(2).column(0).data_page_offset
    data[page + 10: page + 200] = b"Z" * 190  # the footer still reads: only the third row group is garbage
    path.write_bytes(bytes(data))
    with pytest.raises(DataError) as info:
        take(iter(loader(stream(corpus, str(path)).train, workers=0)), 2000)
    assert str(info.value).startswith(f"data.path: {path} row group 2 cannot be read (")
    assert str(info.value).endswith("); rewrite the file or leave it out of data.path") and "\n" not in str(info.value)


def test_a_line_that_is_not_utf8_is_refused_with_its_file_and_line(corpus, tmp_path):
    path = tmp_path / "latin1.txt"
    path.write_bytes("first line\nsecond line\ncaf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError) as info:
        take(iter(stream(corpus, str(path)).train), 20)  # the stream is lazy: the first windows come before line 3
    assert str(info.value) == (f"data.path: {path} line 3 (byte 23) is not UTF-8 (invalid continuation byte): "
                               f"fix or remove that line")


def test_a_missing_or_non_text_column_is_refused_before_any_reading(corpus, tmp_path):
    assert constructed(corpus, corpus / "code.jsonl") == (
        "data.text_column='text': code.jsonl has no such column (it has id, content); set data.text_column to one of them")
    pyarrow.parquet.write_table(pyarrow.table({"body": ["a"], "n": [1]}), tmp_path / "rows.parquet")
    assert constructed(corpus, tmp_path / "rows.parquet") == (
        "data.text_column='text': rows.parquet has no such column (it has body, n); set data.text_column to one of them")
    assert constructed(corpus, tmp_path / "rows.parquet", text_column="n") == (
        "data.text_column='n': rows.parquet's column holds int64; set it to a text column")


def test_a_mixture_sources_missing_column_names_the_sources_own_key(corpus):
    """data.text_column is no key of a mixture (refused if set): the fix is the source's own."""
    sources = {"code": {"path": str(corpus / "code.jsonl")}}
    with pytest.raises(DataError) as info:
        StreamMixture(sources, {"code": 1.0}, str(corpus / "tokenizer.json"), seq_len=SEQ_LEN)
    assert str(info.value) == ("data.sources.code.text_column='text': code.jsonl has no such column (it has id, "
                               "content); set data.sources.code.text_column to one of them")


def test_an_empty_file_set_is_refused(corpus, tmp_path):
    assert constructed(corpus, tmp_path / "none" / "*.jsonl") == (
        f"data.path={str(tmp_path / 'none' / '*.jsonl')!r} matches no file; check the pattern")
    for name in ("a.jsonl", "b.jsonl"):
        (tmp_path / name).write_text("")
    assert constructed(corpus, tmp_path / "*.jsonl") == (
        f"data.path={str(tmp_path / '*.jsonl')!r}: every file is empty (a.jsonl, b.jsonl); point data.path at files with text")


def bad_jsonl(tmp_path: Path, line: str) -> tuple[Path, int]:
    """Ten good records with `line` as line 6, and the byte where it starts."""
    lines = [json.dumps({"text": doc}) for doc in DOCS[:5]] + [line] + [json.dumps({"text": doc}) for doc in DOCS[5:10]]
    path = tmp_path / "bad.jsonl"
    path.write_text("".join(f"{text}\n" for text in lines), encoding="utf-8")
    return path, sum(len(text.encode()) + 1 for text in lines[:5])


def test_a_jsonl_line_that_is_not_json_is_refused_with_its_file_and_line(corpus, tmp_path):
    path, offset = bad_jsonl(tmp_path, '{"text": "cut')
    with pytest.raises(DataError) as info:
        take(iter(loader(stream(corpus, str(path)).train, workers=0)), 200)
    assert str(info.value) == (
        f"data.path: {path} line 6 (byte {offset}) is not JSON (Unterminated string starting at: line 1 column 10 "
        f"(char 9)); a stream reads JSON Lines, one object per line: fix or remove that line")


def test_a_jsonl_line_without_the_text_column_is_refused_with_its_file_and_line_also_from_a_worker(corpus, tmp_path):
    path, offset = bad_jsonl(tmp_path, '{"id": 5, "body": "no text here"}')
    data = stream(corpus, str(path), piece_bytes=256)
    with pytest.raises(DataError) as info:
        take(iter(loader(data.train, workers=2)), 200)
    # torch re-raises a worker's exception with its own lines first; the last is the exception's.
    assert str(info.value).splitlines()[-1] == (
        f"ringtrain.data.DataError: data.path: {path} line 6 (byte {offset}) has no 'text' text (it has id, body); "
        f"fix the line or set data.text_column")


def test_more_readers_than_pieces_are_refused_naming_the_fix(corpus):
    data = stream(corpus, "val.jsonl", piece_bytes=1 << 20)
    data.train.set_rank(1, 2)
    with pytest.raises(DataError) as info:
        next(iter(data.train))
    assert str(info.value) == ("data.path: the files make 1 pieces, fewer than the 2 readers (2 ranks x 1 workers); "
                               "lower data.piece_bytes, add files (Parquet: smaller row groups) or use fewer workers")
