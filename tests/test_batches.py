"""The batch contract (data/batches.py): tensor pairs, tuples and dicts of tensors reach the
model, the model's tensor, tuple or dict output reaches the task, and a batch or output the
task cannot use is one line naming the keys and the fix."""
from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset

from ringtrain.data.batches import first_batch, pick_output, split_batch, to_device, training_loss
from ringtrain.data.tasks import ClassificationTask, LanguageModelTask
from ringtrain.errors import ConfigError

FEATURES, CLASSES, SAMPLES = 4, 3, 96


def _points(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(SAMPLES, FEATURES, generator=generator)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()


class Pairs(Dataset):
    """(features, label) tuples, as a plain map-style Dataset gives them."""

    def __init__(self, seed: int = 0):
        self.x, self.y = _points(seed)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class Rows(Pairs):
    """The same samples as Hugging Face style rows: tensors, a label and a string column."""

    def __getitem__(self, i):
        return {"features": self.x[i], "scale": torch.tensor(1.0), "label": self.y[i], "text": f"row {i}"}


class PairNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(FEATURES, CLASSES)

    def forward(self, features):
        return self.linear(features)


class KeywordNet(PairNet):
    """Keyword inputs, and a dict output of which the task reads `logits`."""

    def forward(self, features, scale):
        return {"hidden": features, "logits": self.linear(features) * scale[:, None]}


def _fit(tmp_path, name: str, model: nn.Module, dataset: Dataset, **options):
    from ringtrain import Trainer

    settings = dict(max_steps=12, batch_size=16, progress_bar=False, checkpoint_every_n_steps=4, seed=3)
    trainer = Trainer(tmp_path / name, optimizer={"_target_": "torch.optim.SGD", "lr": 0.5}, **{**settings, **options})
    result = trainer.fit(model, dataset, type(dataset)(seed=1), task=ClassificationTask())
    return result, {k: v.clone() for k, v in model.state_dict().items()}


def _fresh(kind: type[nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return kind()


def test_dict_batches_with_keyword_inputs_train_exactly_as_tensor_pairs(tmp_path):
    """The same samples as (features, label) pairs into model(features), and as dict rows with
    a string column into model(features=..., scale=...) returning a dict: the same weights,
    bit for bit, and the same validation metric, accumulating 2 micro-batches a step."""
    pairs, pair_weights = _fit(tmp_path, "pairs", _fresh(PairNet), Pairs(), accumulate_grad_batches=2)
    rows, row_weights = _fit(tmp_path, "rows", _fresh(KeywordNet), Rows(), accumulate_grad_batches=2)
    assert pairs.metrics["val/loss"] < 0.8  # it learned: chance is ln 3 = 1.1
    for key, value in pair_weights.items():
        assert torch.equal(row_weights[key], value), key
    assert rows.metrics == pairs.metrics


def test_dict_batches_resume_mid_epoch_bit_for_bit(tmp_path):
    """Stopped at step 8 (mid epoch 2 of 6 batches) and resumed with workers: the weights of the
    uninterrupted run."""
    _, straight = _fit(tmp_path, "straight", _fresh(KeywordNet), Rows(), num_workers=2)
    _fit(tmp_path, "first", _fresh(KeywordNet), Rows(), num_workers=2, max_steps=8)
    _, resumed = _fit(tmp_path, "second", _fresh(KeywordNet), Rows(), num_workers=2,
                      resume=str(tmp_path / "first" / "checkpoints" / "last.pt"))
    for key, value in straight.items():
        assert torch.equal(resumed[key], value), key


def test_a_mapping_goes_to_the_device_key_by_key_and_strings_stay():
    batch = to_device({"ids": torch.ones(2), "pair": (torch.zeros(1), "x"), "text": ["a", "b"]}, torch.device("meta"))
    assert batch["ids"].is_meta and batch["pair"][0].is_meta and batch["pair"][1] == "x" and batch["text"] == ["a", "b"]


def test_which_keys_are_inputs_and_target_comes_from_the_task():
    batch = {"input_ids": torch.ones(2, 3), "attention_mask": torch.ones(2, 3), "labels": torch.zeros(2, 3), "text": ["a", "b"]}
    inputs, target = split_batch(LanguageModelTask(), batch)
    assert list(inputs) == ["input_ids", "attention_mask"] and target is batch["labels"]
    inputs, target = split_batch(LanguageModelTask(input_keys=["input_ids"], target_key="attention_mask"), batch)
    assert list(inputs) == ["input_ids"] and target is batch["attention_mask"]
    x, y, z = torch.ones(2), torch.zeros(2), torch.ones(2)
    assert split_batch(None, (x, y, z)) == ((x, y), z) and split_batch(None, [x, y]) == (x, y)


@pytest.mark.parametrize("task,batch,message", [
    (ClassificationTask(), {"pixels": torch.ones(2), "target": torch.zeros(2)},
     "batches are dicts with keys ['pixels', 'target'] and none is the target (labels or label); set task.target_key"),
    (ClassificationTask(target_key="y"), {"x": torch.ones(2), "label": torch.zeros(2)},
     "without task.target_key='y'; set task.target_key to one of them"),
    (ClassificationTask(input_keys=["x", "mask"]), {"x": torch.ones(2), "label": torch.zeros(2)},
     "without task.input_keys ['mask']"),
    (ClassificationTask(), torch.ones(3), "a batch is a Tensor of shape (3,); a batch must be an (inputs, target) pair"),
])
def test_a_batch_the_task_cannot_split_is_one_line(task, batch, message):
    with pytest.raises(ConfigError, match=None) as caught:
        split_batch(task, batch)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_the_task_reads_logits_the_first_item_or_its_output_key():
    logits, hidden = torch.ones(2, 3), torch.zeros(2, 3)
    assert pick_output(None, logits) is logits
    assert pick_output(None, (logits, hidden)) is logits
    assert pick_output(ClassificationTask(output_key=1), (logits, hidden)) is hidden
    assert pick_output(None, OrderedDict(loss=torch.tensor(1.0), logits=logits)) is logits
    assert pick_output(ClassificationTask(output_key="hidden"), {"logits": logits, "hidden": hidden}) is hidden
    with pytest.raises(ConfigError, match=r"the model returned a dict without logits \(it has \['last_hidden_state'\]\); "
                                          r"set task.output_key to the key of the predictions, e.g. task.output_key=last_hidden_state"):
        pick_output(None, {"last_hidden_state": hidden})
    with pytest.raises(ConfigError, match="without task.output_key='scores'"):
        pick_output(ClassificationTask(output_key="scores"), {"logits": logits})


def test_a_model_loss_task_trains_on_the_loss_the_model_returns():
    class OwnLoss(nn.Module):
        def forward(self, features, labels=None):
            return {"loss": (features.sum() - labels.sum()) ** 2, "logits": features}

    loss, target = training_loss(ClassificationTask(model_loss=True), OwnLoss(), (torch.ones(2, 3), torch.zeros(2)))
    assert loss.item() == 36.0 and target.shape == (2,)
    class NoLoss(nn.Module):
        def forward(self, input, labels=None):
            return input

    with pytest.raises(ConfigError, match="task.model_loss=true but the model returned a Tensor without a scalar loss"):
        training_loss(ClassificationTask(model_loss=True), NoLoss(), {"input": torch.ones(2), "labels": torch.ones(2)})


def test_shifted_labels_score_each_position_against_the_next_token_and_skip_padding():
    logits = torch.randn(1, 4, 5)
    labels = torch.tensor([[1, 2, 3, -100]])
    task = LanguageModelTask(shift_labels=True)
    expected = nn.functional.cross_entropy(logits[0, :2], labels[0, 1:3], reduction="sum")
    sums = task.eval_sums(logits, labels)
    assert torch.allclose(sums["loss"], expected) and sums["count"].item() == 2
    assert torch.allclose(task.loss(logits, labels), expected / 2)


# --- a Dataset's own collate_fn ------------------------------------------------------------

VOCAB = 12
SEEN: list[tuple] = []  # what each forward of LengthsNet got: (device type, input_ids shape, longest row's length)


class Lengths(Dataset):
    """A user's token rows of 1 to 8 tokens (no get_batch), label 1 when the row holds token 1;
    its collate_fn pads each batch to the batch's longest row, as Hugging Face's does."""

    def __init__(self, n: int, seed: int):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 2, (n,), generator=generator)
        self.rows = []
        for label in self.labels.tolist():
            row = torch.randint(2, VOCAB, (int(torch.randint(1, 9, (1,), generator=generator)),), generator=generator)
            if label:
                row[int(torch.randint(0, len(row), (1,), generator=generator))] = 1
            self.rows.append(row)

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i], self.labels[i]

    def collate_fn(self, samples):
        rows, labels = zip(*samples)
        return {"input_ids": nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=0),
                "attention_mask": nn.utils.rnn.pad_sequence([torch.ones_like(r) for r in rows], batch_first=True),
                "label": torch.stack(labels)}


class LengthsNet(nn.Module):
    """Mean of the unmasked tokens' embeddings; records the shape of every batch it is given."""

    def __init__(self, vocab_size: int, num_classes: int):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab_size, 16), nn.Linear(16, num_classes)

    def forward(self, input_ids, attention_mask):
        SEEN.append((tuple(input_ids.shape), int(attention_mask.sum(1).max())))
        mask = attention_mask.unsqueeze(-1).float()
        return self.head((self.embed(input_ids) * mask).sum(1) / mask.sum(1))


def test_a_datasets_own_collate_fn_makes_every_batch_of_the_run(tmp_path):
    """Rows of uneven lengths, which torch's default collate cannot stack: the Dataset's
    collate_fn pads each training and validation batch to its longest row, and the model
    learns through it."""
    from conftest import train_in_process

    node = f"{__name__}.Lengths"
    SEEN.clear()
    result = train_in_process([
        "~data", f"+data.train._target_={node}", "+data.train.n=256", "+data.train.seed=0",
        f"+data.val._target_={node}", "+data.val.n=64", "+data.val.seed=1", f"+data.dims.vocab_size={VOCAB}",
        "+data.dims.num_classes=2", "task=classification", "~model", f"+model._target_={__name__}.LengthsNet",
        "optimizer=adam", "optimizer.lr=0.05", "trainer.batch_size=16", "trainer.max_steps=48",
    ], tmp_path / "run")
    first_two = Lengths(256, 0).rows[:2]
    assert len(first_two[0]) != len(first_two[1])  # so only the collate_fn can batch them
    batches = [shape for shape, _ in SEEN]
    assert len(batches) >= 48 and all(shape[0] == 16 for shape in batches)
    assert len({width for _, width in batches}) > 1  # each batch as wide as its own longest row...
    assert all(width == longest for (_, width), longest in SEEN)
    assert result.metrics["val/acc"] > 0.9  # ...and the model learned whether token 1 is there


def test_a_collate_fn_that_is_not_callable_is_one_line():
    dataset = Lengths(4, 0)
    dataset.collate_fn = "pad"
    with pytest.raises(ConfigError, match="the Lengths dataset's collate_fn is a str, not a callable; make it a function"):
        first_batch(dataset, 2)


class LongLengths(Lengths):
    max_sequence_length = 8  # rows of up to 8 tokens: the longest batch this Dataset makes


class FourPositions(LengthsNet):
    def __init__(self, vocab_size: int, num_classes: int):
        super().__init__(vocab_size, num_classes)
        self.block_size = 4  # what config/builders.py reads as the model's positions


def test_a_dataset_that_says_its_longest_batch_is_checked_against_the_models_positions_before_work(tmp_path):
    """The first two rows are 3 and 2 tokens long here (four positions hold them); the Dataset's
    max_sequence_length says a later batch can be 8 tokens long: refused before the first step."""
    from conftest import train_in_process

    assert [len(row) for row in LongLengths(256, 4).rows[:2]] == [3, 2]
    node = f"{__name__}.LongLengths"
    SEEN.clear()
    with pytest.raises(ConfigError, match=r"the data's sequences are 8 tokens long but the model has 4 positions "
                                          r"\(block_size\); raise the model's block_size to 8 or shorten the data's max_sequence_length"):
        train_in_process([
            "~data", f"+data.train._target_={node}", "+data.train.n=256", "+data.train.seed=4",
            f"+data.val._target_={node}", "+data.val.n=64", "+data.val.seed=1", f"+data.dims.vocab_size={VOCAB}",
            "+data.dims.num_classes=2", "task=classification", "~model", f"+model._target_={__name__}.FourPositions",
        ], tmp_path / "run")
    assert SEEN == [] and not (tmp_path / "run").exists()
