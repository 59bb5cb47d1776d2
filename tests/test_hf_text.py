"""data=hf_text: a text column of local files (text, json, parquet, csv) read with Hugging Face
`datasets`, tokenized once with a BPE tokenizer into a cached Arrow file, cut into next-token
windows that DataLoader workers read from the memory-mapped file."""
from __future__ import annotations

import csv
import json
import pickle
import random
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

pytest.importorskip("datasets", reason="the hf extra (pip install 'ringtrain[hf]') is not installed")

from conftest import compose_config, run_cli, train_in_process  # noqa: E402
from helpers import ok, refused  # noqa: E402
from ringtrain.config.schema import validate  # noqa: E402
from ringtrain.data.bpe import train_bpe  # noqa: E402
from ringtrain.data.hf_text import HFText  # noqa: E402
from ringtrain.data.vocab import BPEVocab  # noqa: E402
from ringtrain.errors import UserError  # noqa: E402

WORDS = "the king and queen of rome speak to romeo while juliet sleeps under a pale moon".split()
_RNG = random.Random(0)
# Rows of a few sentences; 2400 of them, so the tokenized Arrow file has several record batches
# (datasets writes 1000 rows per batch) and windows cross from one to the next.
ROWS = [" ".join(" ".join(_RNG.choice(WORDS) for _ in range(6)).capitalize() + "." for _ in range(_RNG.randint(1, 3)))
        + "\n" for _ in range(2400)]
SEQ_LEN = 16
TINY_MODEL = ["model=transformer", f"model.block_size={SEQ_LEN}", "model.d_model=32", "model.n_layers=1",
              "model.n_heads=2", "model.dropout=0.1", "optimizer=adamw", "optimizer.lr=3e-3", "trainer.batch_size=8"]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """The rows as .jsonl (with a label column), .csv, .parquet and .txt, and a BPE tokenizer."""
    import pyarrow
    import pyarrow.parquet

    root = tmp_path_factory.mktemp("hf")
    with (root / "rows.jsonl").open("w", encoding="utf-8") as f:
        for i, row in enumerate(ROWS):
            f.write(json.dumps({"id": i, "body": row, "label": i % 3}) + "\n")
    with (root / "rows.csv").open("w", newline="", encoding="utf-8") as f:
        csv.writer(f).writerows([["body", "label"]] + [[row, i % 3] for i, row in enumerate(ROWS)])
    pyarrow.parquet.write_table(pyarrow.table({"body": ROWS}), root / "rows.parquet")
    (root / "rows.txt").write_text("".join(ROWS), encoding="utf-8")
    (root / "tokenizer.json").write_text(train_bpe(ROWS, 300).tokenizer_json, encoding="utf-8")
    return root


def expected_stream(corpus: Path) -> list[int]:
    vocab = BPEVocab((corpus / "tokenizer.json").read_text())
    return [i for row in ROWS for i in vocab.encode(row)]


def hf_text(corpus: Path, file: str, cache_dir: Path | str, **options) -> HFText:
    column = "text" if file.endswith(".txt") else "body"
    data = HFText(str(corpus / file), str(corpus / "tokenizer.json"), text_column=column, seq_len=SEQ_LEN,
                  cache_dir=str(cache_dir), **options)
    data.setup()
    return data


@pytest.mark.parametrize("file", ["rows.jsonl", "rows.csv", "rows.parquet", "rows.txt"])
def test_windows_are_the_rows_tokens_end_to_end_in_every_format(corpus, tmp_path, file):
    data = hf_text(corpus, file, tmp_path / "cache")
    stream = expected_stream(corpus)
    split = int(len(stream) * 0.9)
    assert data.dims == {"vocab_size": 300} and data.vocab == BPEVocab((corpus / "tokenizer.json").read_text()).to_state()
    assert len(data.train.stream.parts) > 1  # several record batches: windows cross between them
    for dataset, part in ((data.train, stream[:split]), (data.val, stream[split:])):
        assert len(dataset) == (len(part) - 1) // SEQ_LEN
        for i in (0, 1, len(dataset) // 2, len(dataset) - 1):
            inputs, targets = dataset[i]
            assert inputs.dtype == torch.int64 and inputs.tolist() == part[i * SEQ_LEN: (i + 1) * SEQ_LEN]
            assert targets.tolist() == part[i * SEQ_LEN + 1: (i + 1) * SEQ_LEN + 1]
    with pytest.raises(IndexError):
        data.train[len(data.train)]


def test_tokens_are_mapped_once_into_the_cache_and_again_when_the_file_changes(corpus, tmp_path, monkeypatch):
    first = hf_text(corpus, "rows.jsonl", tmp_path / "cache")
    cached = sorted((tmp_path / "cache" / "hf-mapped").glob("*.arrow"))
    assert len(cached) == 1 and first.train.stream.tokens.cache_files[0]["filename"] == str(cached[0])

    def no_tokenizing(self, texts):
        raise AssertionError("tokenized again although the cache holds the tokens")

    with monkeypatch.context() as patch:
        patch.setattr(BPEVocab, "encode_many", no_tokenizing)
        again = hf_text(corpus, "rows.jsonl", tmp_path / "cache")  # a later run, or another rank
    assert again.train[5][0].equal(first.train[5][0]) and len(again.val) == len(first.val)

    changed = tmp_path / "changed.jsonl"
    changed.write_text((corpus / "rows.jsonl").read_text().replace("king", "moon"))
    data = HFText(str(changed), str(corpus / "tokenizer.json"), text_column="body", seq_len=SEQ_LEN,
                  cache_dir=str(tmp_path / "cache"))
    data.setup()
    assert len(sorted((tmp_path / "cache" / "hf-mapped").glob("*.arrow"))) == 2

    in_memory = hf_text(corpus, "rows.jsonl", "")  # cache_dir "": nothing written anywhere we can see
    assert in_memory.train.stream.tokens.cache_files == [] and in_memory.train[5][0].equal(first.train[5][0])


def test_val_path_files_validate_and_workers_read_the_pickled_windows(corpus, tmp_path):
    data = hf_text(corpus, "rows.jsonl", tmp_path / "cache", val_path=str(corpus / "rows.csv"))
    stream = expected_stream(corpus)
    assert len(data.train) == len(data.val) == (len(stream) - 1) // SEQ_LEN  # all of each file
    # A worker (or a spawned rank) receives the file's path, not its tokens, and maps it again.
    assert len(pickle.dumps(data.train)) < 20_000 < 2 * len(stream)
    copy = pickle.loads(pickle.dumps(data.train))
    assert copy.stream._parts is None and copy[7][0].equal(data.train[7][0])
    order = torch.randperm(len(data.train), generator=torch.Generator().manual_seed(0))[:40].tolist()
    loader = DataLoader(data.train, batch_size=8, sampler=order, num_workers=2)
    batches = list(loader)
    assert torch.equal(torch.cat([inputs for inputs, _ in batches]), torch.stack([data.train[i][0] for i in order]))


def test_stopped_mid_epoch_with_two_workers_then_resumed_is_bit_identical(corpus, tmp_path):
    """The issue's acceptance 1d (fast form: one process, the stop is the step limit): a BPE
    tokenizer trained from a local file, the text through Hugging Face datasets, two
    DataLoader workers; 6 steps, then the same run continued to 16, equals 16 straight."""
    common = TINY_MODEL + ["data=hf_text", f"data.path={corpus / 'rows.jsonl'}", "data.text_column=body",
                           f"data.tokenizer={corpus / 'tokenizer.json'}", f"data.cache_dir={tmp_path / 'cache'}",
                           "trainer.num_workers=2", "trainer.checkpoint_every_n_steps=6", "trainer.eval_every_n_steps=16",
                           "trainer.limit_val_batches=4"]
    straight = train_in_process(common + ["trainer.max_steps=16"], tmp_path / "straight")
    train_in_process(common + ["trainer.max_steps=6"], tmp_path / "resumed")
    train_in_process(common + ["trainer.max_steps=16"], tmp_path / "resumed")  # auto-resume from step 6
    a, b = (torch.load(tmp_path / run / "checkpoints" / "last.pt", weights_only=True) for run in ("straight", "resumed"))
    assert b["progress"] == a["progress"] and a["progress"]["step"] == 16
    assert a["progress"]["epoch"] == 0  # the stop and the end are mid-epoch
    for part in ("model", "optimizer"):
        flat_a, flat_b = _tensors(a[part]), _tensors(b[part])
        assert flat_a.keys() == flat_b.keys() and all(torch.equal(flat_a[k], flat_b[k]) for k in flat_a), part
    assert straight.metrics["val/loss"] < 0.8 * torch.log(torch.tensor(300.0)).item()  # it learned


def _tensors(state, prefix: str = "") -> dict[str, torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return {prefix: state}
    items = state.items() if isinstance(state, dict) else enumerate(state) if isinstance(state, (list, tuple)) else ()
    return {k: v for key, value in items for k, v in _tensors(value, f"{prefix}.{key}").items()}


@pytest.mark.parametrize("override,message", [
    ("data.path={root}/missing.jsonl", "data.path='{root}/missing.jsonl': {root}/missing.jsonl does not exist"),
    ("data.text_column=txt", "data.text_column='txt': rows.jsonl has no such column (it has id, body, label); set "
                             "data.text_column to one of them"),
    ("data.tokenizer={root}/none.json", "data.tokenizer='{root}/none.json': no tokenizer file at {root}/none.json"),
    ("data.format=xml", "data.format='xml' is not one of text, json, parquet, csv"),
])
def test_each_mistake_is_refused_before_any_work_in_one_line(corpus, override, message):
    root = str(corpus)
    settings = ["data=hf_text", f"data.path={corpus / 'rows.jsonl'}", "data.text_column=body",
                f"data.tokenizer={corpus / 'tokenizer.json'}"]
    with pytest.raises(UserError) as error:
        validate(compose_config(TINY_MODEL + settings + [override.format(root=root)]))
    assert message.format(root=root) in str(error.value) and "\n" not in str(error.value)


def test_too_little_text_for_one_window_names_the_files_and_the_fixes(corpus, tmp_path):
    (tmp_path / "short.jsonl").write_text(json.dumps({"body": "The king."}) + "\n")
    with pytest.raises(UserError, match=r"data.val_path gives \d+ validation tokens, fewer than one window of "
                                         r"data.seq_len \+ 1 = 17; use more data, a smaller seq_len"):
        hf_text(corpus, "rows.jsonl", "", val_path=str(tmp_path / "short.jsonl"))


def test_the_command_refuses_a_missing_column_with_exit_2_and_no_run_directory(corpus, tmp_path):
    proc = run_cli(TINY_MODEL + ["data=hf_text", f"data.path={corpus / 'rows.csv'}", "data.text_column=text",
                                 f"data.tokenizer={corpus / 'tokenizer.json'}", f"hydra.run.dir={tmp_path / 'run'}"])
    refused(proc, "data.text_column='text': rows.csv has no such column (it has body, label)")
    assert not (tmp_path / "run").exists()


EXPERIMENT = """
# @package _global_
# The user's whole setup, YAML only: ringtrain's Transformer on their json rows through
# Hugging Face datasets, with the BPE tokenizer they trained from a local file.
defaults:
  - override /model: transformer
  - override /data: hf_text
  - override /optimizer: adamw
model: {{block_size: 16, d_model: 32, n_layers: 1, n_heads: 2, dropout: 0.1}}
optimizer: {{lr: 3.0e-3}}
data:
  path: {corpus}/rows.jsonl
  text_column: body
  tokenizer: {corpus}/tokenizer.json
  cache_dir: {cache}
trainer: {{batch_size: 8, num_workers: 2, max_steps: 24, eval_every_n_steps: 24}}
"""


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [1, 2])
def test_a_yaml_only_hf_text_run_stopped_by_sigterm_mid_epoch_resumes_bit_identical(corpus, tmp_path, world_size):
    """The issue's acceptance 1d as a user meets it: a config dir outside the repository, the
    tokenizer trained by `ringtrain prepare_tokens`, two DataLoader workers, one process or two
    torchrun ranks; SIGTERM at step 10 (mid-epoch), the same command continues, and the end is
    bit for bit the uninterrupted run's. The checkpoint loads into ringtrain's Transformer with
    weights_only=True, and `ringtrain evaluate` reproduces the run's last validation loss."""
    from conftest import run_module
    from helpers import TORCHRUN, job_ok
    from ringtrain.models.transformer import Transformer
    from test_resilience import SIGNAL_STEP_SECONDS, assert_identical, checkpoint, run_job, training_job

    project = tmp_path / "project"
    (project / "my_conf" / "experiment").mkdir(parents=True)
    ok(run_module("prepare_tokens", [f"input={corpus / 'rows.txt'}", f"output={project / 'tokens'}", "vocab=bpe",
                                     "vocab_size=300"], cwd=project))
    (project / "my_conf" / "experiment" / "corpus.yaml").write_text(
        EXPERIMENT.format(corpus=project / "tokens", cache=project / "cache").replace(
            f"path: {project / 'tokens'}/rows.jsonl", f"path: {corpus / 'rows.jsonl'}"))
    launcher = TORCHRUN if world_size == 2 else None
    args = ["--config-dir", "my_conf", "experiment=corpus"] + (["strategy=ddp"] if world_size == 2 else [])

    job_ok(run_job(args + ["hydra.run.dir=straight"], launcher=launcher, cwd=project))
    with training_job(args + ["hydra.run.dir=run"], launcher=launcher, cwd=project,
                      step_seconds=SIGNAL_STEP_SECONDS, hold_at_step=10) as job:
        job.wait_for_step(10)
        job.send_signal(signal.SIGTERM)
        status, output = job.finish(timeout=120)
    assert "last.pt saved" in output and 10 <= checkpoint(project / "run")["progress"]["step"] < 24, output[:8000]
    job_ok(run_job(args + ["hydra.run.dir=run"], launcher=launcher, cwd=project))
    reference = checkpoint(project / "straight")
    assert reference["progress"]["step"] == 24 and reference["progress"]["epoch"] == 0  # mid-epoch throughout
    assert_identical(project / "run", reference)

    state = torch.load(project / "run" / "checkpoints" / "last.pt", weights_only=True)
    model = Transformer(vocab_size=300, block_size=16, d_model=32, n_layers=1, n_heads=2)
    model.load_state_dict(state["model"])
    logged = json.loads((project / "run" / "metrics.json").read_text())["final"]["val/loss"]
    assert logged < 0.8 * torch.log(torch.tensor(300.0)).item()  # the loss fell from log(vocab)
    ok(run_module("evaluate", [f"checkpoint={project / 'run' / 'checkpoints' / 'last.pt'}"], cwd=project))
    record = json.loads((project / "run" / "eval" / "last-val.json").read_text())
    assert record["metrics"]["val/loss"] == pytest.approx(logged, abs=1e-6)
