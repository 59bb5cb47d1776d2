"""data=hf_rows: records of local files (json, parquet, csv) as dict batches, one key per column,
a text column tokenized once into input_ids and attention_mask; the model is called with them
as keyword arguments and the label is the target (data/batches.py)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from torch import nn

pytest.importorskip("datasets", reason="the hf extra (pip install 'ringtrain[hf]') is not installed")

from conftest import compose_config, train_in_process  # noqa: E402
from ringtrain.config.schema import validate  # noqa: E402
from ringtrain.data.bpe import train_bpe  # noqa: E402
from ringtrain.data.hf_rows import HFRows  # noqa: E402
from ringtrain.data.vocab import BPEVocab  # noqa: E402
from ringtrain.errors import UserError  # noqa: E402

WORDS = "the king and queen of rome speak to romeo while juliet sleeps under a pale moon".split()
MOODS = ["glad", "sad", "angry"]  # the label is the mood word a row holds
MAX_LENGTH = 12
WIDTHS: list[int] = []  # input_ids' width of each batch BagOfTokens is given


class BagOfTokens(nn.Module):
    """A user's model of Hugging Face's shape: keyword inputs input_ids and attention_mask."""

    def __init__(self, vocab_size: int, num_classes: int, width: int = 16, block_size: int | None = None):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab_size, width), nn.Linear(width, num_classes)
        if block_size is not None:  # the longest sequence it says it takes (config/builders.py reads it)
            self.block_size = block_size

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        WIDTHS.append(input_ids.shape[1])
        mask = attention_mask.unsqueeze(-1).float()
        pooled = (self.embed(input_ids) * mask).sum(1) / mask.sum(1).clamp(min=1)
        return {"logits": self.head(pooled)}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("rows")
    rng = random.Random(0)
    records = []
    for i in range(400):
        words = [rng.choice(WORDS) for _ in range(rng.randint(2, 6))]
        label = i % 3
        words.insert(rng.randint(0, 2), MOODS[label])  # within the first max_length tokens
        records.append({"text": " ".join(words), "label": label, "tokens": list(range(i % 5 + 1)), "id": f"r{i}"})
    with (root / "rows.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    (root / "tokenizer.json").write_text(train_bpe([r["text"] for r in records], 280).tokenizer_json)
    return root


def test_columns_become_batch_keys_with_the_text_tokenized_and_batches_padded_to_their_longest_row(rows, tmp_path):
    data = HFRows(str(rows / "rows.jsonl"), tokenizer=str(rows / "tokenizer.json"), max_length=MAX_LENGTH,
                  cache_dir=str(tmp_path / "cache"))
    assert data.dims == {"vocab_size": 280, "num_classes": None}  # the labels are read in setup()
    data.setup()
    assert data.dims == {"vocab_size": 280, "num_classes": 3} and len(data.train) == 360 and len(data.val) == 40
    vocab = BPEVocab((rows / "tokenizer.json").read_text())
    records = [json.loads(line) for line in (rows / "rows.jsonl").read_text().splitlines()]
    stored = [len(ids) for ids in data.train.rows["input_ids"]]
    assert max(stored) == MAX_LENGTH and min(stored) < MAX_LENGTH  # truncated, never padded
    items = _short_rows(data.train, 8)
    assert sorted(items[0]) == ["attention_mask", "input_ids", "label", "tokens"]  # numbers only: no text, no id
    sources = []
    for item in items:  # each row as stored: its tokens (at most max_length), unpadded
        source = next(r for r in records if r["label"] == int(item["label"]) and
                      vocab.encode(r["text"])[:MAX_LENGTH] == item["input_ids"].tolist())
        assert item["attention_mask"].tolist() == [1] * len(item["input_ids"])
        assert item["tokens"].tolist() == source["tokens"]
        sources.append(source)
    batch = data.train.collate_fn(items)
    lengths = [len(item["input_ids"]) for item in items]
    longest = max(lengths)
    assert min(lengths) < longest < MAX_LENGTH  # short rows, of uneven lengths: padded to the longest only
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (8, longest)
    assert batch["tokens"].shape == (8, max(len(s["tokens"]) for s in sources))
    for i, (item, source) in enumerate(zip(items, sources)):
        ids = vocab.encode(source["text"])[:MAX_LENGTH]
        assert batch["input_ids"][i].tolist() == ids + [0] * (longest - len(ids))
        assert batch["attention_mask"][i].tolist() == [1] * len(ids) + [0] * (longest - len(ids))
    assert batch["label"].tolist() == [int(item["label"]) for item in items]  # scalars stacked
    # The same rows validate on every run, and none of them trains.
    again = HFRows(str(rows / "rows.jsonl"), tokenizer=str(rows / "tokenizer.json"), max_length=MAX_LENGTH,
                   cache_dir=str(tmp_path / "cache"))
    again.setup()
    assert again.val.rows["label"] == data.val.rows["label"] and len(set(map(tuple, again.val.rows["input_ids"])) &
                                                                       set(map(tuple, again.train.rows["input_ids"]))) < 3


def test_padding_max_length_pads_every_batch_to_max_length_and_masks_pad_with_zero_whatever_pad_id(rows, tmp_path):
    data = HFRows(str(rows / "rows.jsonl"), tokenizer=str(rows / "tokenizer.json"), max_length=MAX_LENGTH,
                  padding="max_length", pad_id=7, cache_dir=str(tmp_path / "cache"))
    data.setup()
    items = _short_rows(data.train, 4)
    batch = data.train.collate_fn(items)
    assert batch["input_ids"].shape == batch["attention_mask"].shape == (4, MAX_LENGTH)
    for i, item in enumerate(items):
        n = len(item["input_ids"])
        assert n < MAX_LENGTH and batch["input_ids"][i].tolist() == item["input_ids"].tolist() + [7] * (MAX_LENGTH - n)
        assert batch["attention_mask"][i].tolist() == [1] * n + [0] * (MAX_LENGTH - n)  # 0, never pad_id
    longest = HFRows(str(rows / "rows.jsonl"), tokenizer=str(rows / "tokenizer.json"), max_length=MAX_LENGTH,
                     pad_id=7, cache_dir=str(tmp_path / "cache"))
    longest.setup()
    mask = longest.train.collate_fn(items)["attention_mask"]
    assert mask.shape[1] < MAX_LENGTH and set(mask.flatten().tolist()) == {0, 1}


def test_a_cache_of_padded_rows_from_before_is_not_read_as_unpadded_rows(rows, tmp_path):
    """The Arrow file of the tokenized rows as the code before dynamic padding wrote it (every
    row padded to max_length; here all zeros), named by the same options, sits in the cache:
    the rows are tokenized anew, not read from it."""
    import datasets

    from ringtrain.data.hf_files import cache_key, load_rows, mapped

    cache, files, tokenizer = str(tmp_path / "cache"), [str(rows / "rows.jsonl")], (rows / "tokenizer.json").read_text()
    old = load_rows(files, "json", cache, "data.path")
    features = old.features.copy()
    del features["text"]
    features["input_ids"] = datasets.Sequence(datasets.Value("int64"), length=MAX_LENGTH)
    features["attention_mask"] = datasets.Sequence(datasets.Value("int8"), length=MAX_LENGTH)
    name = "rows-" + cache_key("json", "text", MAX_LENGTH, 0, tokenizer, files=files)  # the old key's parts

    def padded(texts: list[str]) -> dict[str, list[list[int]]]:
        return {"input_ids": [[0] * MAX_LENGTH] * len(texts), "attention_mask": [[0] * MAX_LENGTH] * len(texts)}

    mapped(old, padded, name, cache, datasets.Features(features), input_columns=["text"], remove_columns=["text"])
    assert (tmp_path / "cache" / "hf-mapped" / f"{name}.arrow").is_file()
    data = HFRows(files[0], tokenizer=str(rows / "tokenizer.json"), max_length=MAX_LENGTH, cache_dir=cache)
    data.setup()
    stored = data.train.rows["input_ids"]
    assert min(map(len, stored)) < MAX_LENGTH and all(any(ids) for ids in stored)


def _short_rows(split, count: int) -> list[dict[str, torch.Tensor]]:
    """The split's first `count` items shorter than MAX_LENGTH tokens (of uneven lengths)."""
    return [item for item in map(split.__getitem__, range(len(split))) if len(item["input_ids"]) < MAX_LENGTH][:count]


def test_chosen_columns_are_renamed_and_labels_lists_pad_with_ignore_index(rows, tmp_path):
    data = HFRows(str(rows / "rows.jsonl"), columns={"input_ids": "tokens", "labels": "tokens"}, max_length=6,
                  cache_dir="")
    data.setup()
    assert data.dims == {}  # a list of labels is not classes
    items = [data.train[i] for i in range(5)]
    batch = data.train.collate_fn(items)
    longest = max(len(item["labels"]) for item in items)
    assert batch["labels"].shape == (5, longest) and longest < 6
    for i, item in enumerate(items):
        n = len(item["labels"])  # the row's tokens are 0, 1, ..., n - 1
        assert sorted(item) == ["input_ids", "labels"] and 1 <= n <= 5
        assert item["input_ids"].tolist() == item["labels"].tolist() == list(range(n))
        assert batch["input_ids"][i].tolist() == list(range(n)) + [0] * (longest - n)  # padded with pad_id
        assert batch["labels"][i].tolist() == list(range(n)) + [-100] * (longest - n)  # -100: ignored by the loss
    with pytest.raises(UserError, match=r"data.columns.labels='nope': rows.jsonl has no such column"):
        HFRows(str(rows / "rows.jsonl"), columns={"labels": "nope"})


def classifier(rows: Path, cache: Path) -> list[str]:
    return ["data=hf_rows", f"data.path={rows / 'rows.jsonl'}", f"data.tokenizer={rows / 'tokenizer.json'}",
            "data.max_length=40", "data.columns=[input_ids,attention_mask,label]", f"data.cache_dir={cache}",
            "~model", f"+model._target_={__name__}.BagOfTokens", "optimizer=adam", "optimizer.lr=0.05",
            "trainer.batch_size=16", "trainer.num_workers=2", "trainer.checkpoint_every_n_steps=10"]


def test_a_classifier_trains_on_dict_batches_through_two_workers_and_resumes_exactly(rows, tmp_path):
    """60 steps straight, and 10 steps then the same run continued to 60 (mid-epoch, 23 steps
    an epoch): the same weights and optimizer state, bit for bit. `ringtrain evaluate` on the
    checkpoint, batching the rows otherwise, gives the run's final metrics."""
    common = classifier(rows, tmp_path / "cache")
    WIDTHS.clear()
    result = train_in_process(common + ["trainer.max_steps=60"], tmp_path / "straight")
    # Each batch, collated in the workers, as wide as its longest row (the longest of all is 34
    # tokens), never data.max_length=40.
    assert max(WIDTHS) <= 34 and len(set(WIDTHS)) > 5
    train_in_process(common + ["trainer.max_steps=10"], tmp_path / "resumed")
    train_in_process(common + ["trainer.max_steps=60"], tmp_path / "resumed")
    a, b = (torch.load(tmp_path / run / "checkpoints" / "last.pt", weights_only=True) for run in ("straight", "resumed"))
    assert a["data_dims"] == {"vocab_size": 280, "num_classes": 3}
    assert result.metrics["val/acc"] > 0.9  # the mood word decides the label: it learned that
    assert b["progress"] == a["progress"]
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    assert all(torch.equal(x, y) for x, y in zip(_tensors(a["optimizer"]), _tensors(b["optimizer"])))
    # `ringtrain evaluate`'s plan and rank (in process: its Hydra app only composes their
    # arguments) rebuild the data from the checkpoint's config and pad its batches of 5 through
    # the same collate, without workers: the metrics are per-sample sums, so the run's.
    from ringtrain.tools import composed_job
    from ringtrain.tools.checkpoint_model import read_checkpoint
    from ringtrain.tools.evaluate import evaluate_worker, plan

    path = str(tmp_path / "straight" / "checkpoints" / "last.pt")
    state = read_checkpoint(path)  # the job as the command line gives it: the recorded one, changed
    # The user's own model node, given again: a checkpoint replays no _target_ (config/recipe.py).
    job_config = composed_job(state, path, ["~model", f"+model._target_={__name__}.BagOfTokens",
                                            "trainer.val_batch_size=5", "trainer.num_workers=0"])
    job, _ = plan(path, state, "val", None, job_config, "single")
    evaluated = evaluate_worker(job).metrics
    assert set(evaluated) == {"val/loss", "val/acc"}
    assert evaluated == pytest.approx({k: result.metrics[k] for k in evaluated}, abs=1e-5)


def test_sample_refuses_a_classifier_whose_data_keeps_a_tokenizer(rows, tmp_path):
    """The classifier's checkpoint keeps a BPE vocabulary, but its task is classification:
    `ringtrain sample` says so in one line, exit 2 (it crashed indexing (batch, classes) logits)."""
    from conftest import run_module
    from helpers import refused

    common = [o for o in classifier(rows, tmp_path / "cache") if not o.startswith("trainer.num_workers")]
    train_in_process(common + ["trainer.max_steps=1"], tmp_path / "run")
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    assert torch.load(checkpoint, weights_only=True)["vocab"]  # what the old refusal looked at
    refused(run_module("sample", [f"checkpoint={checkpoint}", "~model", f"+model._target_={__name__}.BagOfTokens"],
                       cwd=tmp_path),
            f"{checkpoint} holds {__name__}.BagOfTokens, trained with ringtrain.data.tasks.ClassificationTask "
            f"on data of sizes (num_classes, vocab_size): not a language model", "task=language_model")


def _tensors(state) -> list[torch.Tensor]:
    if isinstance(state, torch.Tensor):
        return [state]
    values = state.values() if isinstance(state, dict) else state if isinstance(state, (list, tuple)) else ()
    return [t for value in values for t in _tensors(value)]


def test_rows_mistakes_are_refused_before_any_work(rows):
    base = ["model=mlp", "data=hf_rows", f"data.path={rows / 'rows.jsonl'}"]
    for override, message in [
        ("data.text_column=body", "data.text_column='body': rows.jsonl has no such column (it has text, label, tokens, id)"),
        (f"data.path={rows / 'none.jsonl'}", "none.jsonl does not exist"),
        (f"data.tokenizer={rows / 'none.json'}", "no tokenizer file at"),
        ("data.padding=do_not_pad", "data.padding='do_not_pad' is not one of longest, max_length; longest pads each batch"),
    ]:
        extra = [f"data.tokenizer={rows / 'tokenizer.json'}"] if "tokenizer" not in override else []
        with pytest.raises(UserError) as error:
            validate(compose_config(base + extra + [override]))
        assert message in str(error.value), str(error.value)


@pytest.mark.parametrize("padding", ["longest", "max_length"])
def test_a_model_with_fewer_positions_than_max_length_is_refused_before_work(rows, tmp_path, padding):
    """The first rows are 25 tokens at most, but a later batch may be as long as
    data.max_length=40: a model of 30 positions is refused before its first step, whichever the
    padding."""
    with pytest.raises(UserError) as error:
        train_in_process(classifier(rows, tmp_path / "cache") + [f"data.padding={padding}", "+model.block_size=30"],
                         tmp_path / "run")
    assert str(error.value) == ("the data's sequences are 40 tokens long but the model has 30 positions (block_size); "
                                "raise the model's block_size to 40 or shorten data.max_length")
    assert not (tmp_path / "run").exists()


HF_CLASSIFIER = """
# @package _global_
# YAML only: the rows through Hugging Face datasets into a transformers classifier.
defaults:
  - override /data: hf_rows
  - override /optimizer: adamw
data:
  path: {rows}/rows.jsonl
  tokenizer: {rows}/tokenizer.json
  max_length: {max_length}
  columns: [input_ids, attention_mask, label]
  cache_dir: {cache}
model:
  _target_: transformers.GPT2ForSequenceClassification
  config: {{_target_: transformers.GPT2Config, vocab_size: 280, n_positions: {max_length}, n_embd: 32, n_layer: 1,
           n_head: 2, num_labels: 3, pad_token_id: 0, bos_token_id: 0, eos_token_id: 0}}
optimizer: {{lr: 3.0e-3}}
trainer: {{batch_size: 16, max_steps: 60, num_workers: 2}}
"""


@pytest.mark.slow
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_transformers_classifier_trains_on_hf_rows_from_yaml_alone(rows, tmp_path, ranks):
    """Batches padded each to its own longest row train a transformers model, also under ddp
    (each rank's batches have widths of their own: DDP needs only equal batch counts)."""
    pytest.importorskip("transformers")
    from conftest import run_cli
    from helpers import ok

    (tmp_path / "my_conf" / "experiment").mkdir(parents=True)
    (tmp_path / "my_conf" / "experiment" / "reviews.yaml").write_text(
        HF_CLASSIFIER.format(rows=rows, max_length=MAX_LENGTH, cache=tmp_path / "cache"))
    strategy = ["strategy=ddp", f"strategy.nproc_per_node={ranks}"] if ranks > 1 else []
    ok(run_cli(["--config-dir", "my_conf", "experiment=reviews", "hydra.run.dir=run", *strategy], cwd=tmp_path, timeout=600))
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())["final"]
    assert metrics["val/acc"] > 0.9, metrics
