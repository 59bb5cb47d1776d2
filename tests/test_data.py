"""The data sets on their own, and the loader that feeds them to the Trainer."""
from __future__ import annotations

import os

import pytest
import torch
from torch.utils.data import Dataset, DistributedSampler

from ringtrain.data import DataError
from ringtrain.data.classification import ClassificationData
from ringtrain.data.regression import RegressionData
from ringtrain.data.tasks import ClassificationTask, LanguageModelTask, LossTask, RegressionTask
from ringtrain.data.text import CharText, check_text_file
from ringtrain.data.tokens import MarkovTokens
from ringtrain.loop.loaders import ShuffledShards, build_train_loader, build_val_loader

CPU = torch.device("cpu")


def made(data_class, **arguments):
    """A data component built and set up, as each rank does."""
    data = data_class(**arguments)
    data.setup()
    return data


def test_data_components_know_the_model_sizes_they_give_before_setup():
    assert RegressionData().dims == {"in_features": 1, "out_features": 1}
    assert ClassificationData(num_features=8, num_classes=3).dims == {"in_features": 8, "num_classes": 3}
    assert MarkovTokens(vocab_size=32).dims == {"vocab_size": 32}


def test_regression_is_the_tutorial_line_with_its_noise():
    data = made(RegressionData)
    x, y = data.train.inputs, data.train.targets
    residual = y - (2 * x + 3)
    assert len(data.train) == 10000 and len(data.val) == 1000
    assert abs(residual.mean().item()) < 0.005 and residual.std().item() == pytest.approx(0.1, rel=0.05)


def test_classification_is_learnable_far_above_chance():
    data = made(ClassificationData, num_features=64, num_samples=4000, num_val_samples=1000)
    x, y = data.train.inputs, data.train.targets
    centres = torch.stack([x[y == c].mean(0) for c in range(10)])
    guess = torch.cdist(data.val.inputs, centres).argmin(1)  # nearest class mean, learned from train
    assert (guess == data.val.targets).float().mean().item() > 0.9  # chance: 0.1


def test_tokens_follow_a_fixed_chain_with_the_promised_branching():
    config = dict(vocab_size=16, branching=3, seq_len=8, num_train_tokens=4000, num_val_tokens=800)
    data = made(MarkovTokens, **config)
    windows = torch.cat([data.train.windows, data.val.windows])
    followers = {}
    for a, b in zip(windows[:, :-1].flatten().tolist(), windows[:, 1:].flatten().tolist()):
        followers.setdefault(a, set()).add(b)
    assert all(len(f) == 3 for f in followers.values()) and len(followers) == 16
    assert made(MarkovTokens, **config).train.windows.equal(data.train.windows)  # the seed fixes it


def test_batches_equal_the_per_sample_items_they_gather():
    for data in (made(RegressionData, num_samples=50),
                 made(MarkovTokens, num_train_tokens=640, seq_len=8)):
        indices = torch.tensor([3, 0, 7, 7])
        inputs, targets = data.train.get_batch(indices)
        items = [data.train[i] for i in indices.tolist()]
        assert torch.equal(inputs, torch.stack([x for x, _ in items]))
        assert torch.equal(targets, torch.stack([y for _, y in items]))


# --- text ------------------------------------------------------------------------------------


@pytest.fixture
def text_file(tmp_path):
    path = tmp_path / "play.txt"
    path.write_text("To be, or not to be, that is the question. Ñ\n" * 30, encoding="utf-8")
    return path


def test_text_vocabulary_ids_and_windows_round_trip(text_file, tmp_path):
    config = dict(path=str(text_file), seq_len=16, val_fraction=0.2, cache_dir="")
    data = made(CharText, **config)
    text = text_file.read_text(encoding="utf-8")
    vocab = "".join(sorted(set(text)))
    assert data.dims == {"vocab_size": len(vocab)} and data.vocab == {"kind": "char", "chars": vocab}
    inputs, targets = data.train.get_batch(torch.arange(len(data.train)))
    decoded = "".join(vocab[i] for i in inputs[0].tolist())
    assert decoded == text[:16] and torch.equal(inputs[1:, 0], targets[:-1, -1])  # windows chain up
    # Every character of the training part is a target exactly once (up to the last partial window).
    split = int(len(text) * 0.8)
    assert targets.numel() == (split - 1) // 16 * 16


def test_a_text_stride_starts_a_training_window_at_every_stride_and_leaves_validation_alone(text_file):
    config = dict(path=str(text_file), seq_len=16, val_fraction=0.2, cache_dir="")
    plain, every_3 = made(CharText, **config), made(CharText, **config, stride=3)
    text = text_file.read_text(encoding="utf-8")
    vocab, split = plain.vocab["chars"], int(len(text) * 0.8)
    inputs, targets = every_3.train.get_batch(torch.arange(len(every_3.train)))
    assert len(every_3.train) == (split - 17) // 3 + 1
    for i in (0, 1, len(inputs) - 1):
        assert "".join(vocab[c] for c in inputs[i].tolist()) == text[3 * i: 3 * i + 16]
        assert "".join(vocab[c] for c in targets[i].tolist()) == text[3 * i + 1: 3 * i + 17]
    assert torch.equal(every_3.val.windows, plain.val.windows)  # each validation token scored once
    with pytest.raises(ValueError, match="data.stride=0 must be a positive integer"):
        CharText(**config, stride=0)


def test_text_encoding_is_cached_by_path_size_and_mtime(text_file, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    config = dict(path=str(text_file), seq_len=16, cache_dir=str(cache))
    first = made(CharText, **config)
    (cached,) = cache.glob("text-play-*.pt")
    # A second build reads the cache, not the file.
    import pathlib

    def no_reading(*args, **kwargs):
        raise AssertionError("the text was read again")

    monkeypatch.setattr(pathlib.Path, "read_text", no_reading)
    assert torch.equal(made(CharText, **config).train.windows, first.train.windows)
    monkeypatch.undo()
    # A changed file gets a new cache entry.
    text_file.write_text(text_file.read_text(encoding="utf-8") + "More.\n", encoding="utf-8")
    os.utime(text_file, ns=(1, 1))
    assert made(CharText, **config).train.windows.numel() > first.train.windows.numel()
    assert len(list(cache.glob("text-play-*.pt"))) == 2 and cached.exists()


def test_an_empty_cache_dir_turns_the_cache_off(text_file, tmp_path, monkeypatch):
    import ringtrain.data.text as text_module

    def no_writing(*args):
        raise AssertionError("the cache was written")

    monkeypatch.setattr(text_module, "_write_cache", no_writing)
    made(CharText, path=str(text_file), seq_len=16, cache_dir="")
    with pytest.raises(AssertionError, match="the cache was written"):  # the control: a cache_dir writes
        made(CharText, path=str(text_file), seq_len=16, cache_dir=str(tmp_path / "cache"))


def test_a_damaged_cache_is_rebuilt_not_fatal(text_file, tmp_path):
    config = dict(path=str(text_file), seq_len=16, cache_dir=str(tmp_path / "cache"))
    expected = made(CharText, **config).train.windows
    (cached,) = (tmp_path / "cache").glob("*.pt")
    cached.write_bytes(b"garbage")
    assert torch.equal(made(CharText, **config).train.windows, expected)


@pytest.mark.parametrize(
    "content,message",
    [
        (b"", "is empty"),
        ("caf\u00e9".encode("latin-1") + b" and more text" * 10, "is not UTF-8 text"),
        (b"short", "fewer than one window"),
    ],
)
def test_unusable_text_files_are_refused_with_the_fix(tmp_path, content, message):
    path = tmp_path / "bad.txt"
    path.write_bytes(content)
    with pytest.raises(DataError, match=message):
        check_text_file(str(path))
        made(CharText, path=str(path), seq_len=16, cache_dir="")


def test_missing_or_unset_text_path_is_refused(tmp_path):
    with pytest.raises(DataError, match="data.path is not set"):
        check_text_file("")
    with pytest.raises(DataError, match="does not exist"):
        check_text_file(str(tmp_path / "nope.txt"))
    with pytest.raises(DataError, match="is not a file"):
        check_text_file(str(tmp_path))


# --- the loader --------------------------------------------------------------------------------


class ItemsOnly(Dataset):
    """A Dataset without get_batch: the loader falls back to a torch DataLoader."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, index):
        return self.inner[index]


@pytest.mark.parametrize("rank,world_size", [(0, 1), (1, 2)])
def test_gathered_batches_equal_a_torch_dataloader_in_the_same_order(rank, world_size):
    data = made(RegressionData, num_samples=203).train
    fast = build_train_loader(data, 16, rank, world_size, seed=5, drop_last=False, device=CPU)
    slow = build_train_loader(ItemsOnly(data), 16, rank, world_size, seed=5, drop_last=False, device=CPU)
    assert len(fast) == len(slow) == (7 if world_size == 2 else 13)  # ceil(102 / 16), ceil(203 / 16)
    for epoch in (0, 1):
        pairs = list(zip(fast.batches(epoch), slow.batches(epoch)))
        assert len(pairs) == len(fast)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in pairs)
    # Resuming mid-epoch skips exactly the batches already seen, on both paths.
    assert torch.equal(next(fast.batches(1, start=3 * 16 * world_size))[0], list(slow.batches(1))[3][0])
    assert torch.equal(next(slow.batches(1, start=3 * 16 * world_size))[0], list(fast.batches(1))[3][0])


@pytest.mark.parametrize("length,world_size", [(10, 1), (10, 3), (7, 4), (2, 5), (12, 4)])
@pytest.mark.parametrize("shuffle", [True, False])
@pytest.mark.parametrize("drop_last", [True, False])
def test_training_order_is_distributed_samplers_index_for_index(length, world_size, shuffle, drop_last):
    for rank in range(world_size):
        ours = ShuffledShards(length, rank, world_size, seed=3, shuffle=shuffle, drop_last=drop_last)
        theirs = DistributedSampler(range(length), world_size, rank, shuffle=shuffle, seed=3, drop_last=drop_last)
        assert len(ours) == len(theirs)
        for epoch in (0, 1, 7):
            theirs.set_epoch(epoch)
            assert ours.indices(epoch).tolist() == list(theirs)


@pytest.mark.parametrize("length,world_size,batch", [(21, 2, 4), (7, 4, 1), (10, 3, 2)])
def test_a_resumed_epoch_pads_its_end_as_the_uninterrupted_epoch_does(length, world_size, batch):
    """An epoch that does not split evenly over the ranks is padded with its first samples,
    whatever position it resumed from: the rest of each rank's order is the uninterrupted
    order's tail, sample for sample, padding included."""
    for rank in range(world_size):
        order = ShuffledShards(length, rank, world_size, seed=5, shuffle=True, drop_last=False)
        whole = order.indices(3).tolist()
        for steps_done in range(1, len(whole) // batch):
            start = steps_done * batch * world_size  # the global position after those steps
            assert order.indices(3, start=start).tolist() == whole[steps_done * batch:], (rank, start)


def test_epochs_shuffle_differently_and_ranks_split_each_epoch_exactly():
    data = made(RegressionData, num_samples=200).train
    loaders = [build_train_loader(data, 10, r, 2, seed=0, drop_last=False, device=CPU) for r in (0, 1)]
    seen = [torch.cat([x for x, _ in loader.batches(0)]) for loader in loaders]
    assert sorted(torch.cat(seen).flatten().tolist()) == sorted(data.inputs.flatten().tolist())
    assert not torch.equal(torch.cat([x for x, _ in loaders[0].batches(1)]), seen[0])


def test_validation_shards_cover_every_sample_once_without_padding():
    data = made(RegressionData, num_samples=10, num_val_samples=101).val
    shards = [torch.cat([x for x, _ in build_val_loader(data, 8, r, 3, CPU).batches()]) for r in range(3)]
    assert [len(s) for s in shards] == [34, 34, 33]
    assert sorted(torch.cat(shards).flatten().tolist()) == sorted(data.inputs.flatten().tolist())


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_limit_val_batches_is_one_processs_first_batches_shared_among_the_ranks(world_size):
    """limit_batches=3 with batches of 8: the first 24 samples of the order, each on one rank,
    for any number of ranks (not 3 batches per rank)."""
    data = made(RegressionData, num_samples=10, num_val_samples=101).val
    loaders = [build_val_loader(data, 8, r, world_size, CPU, limit_batches=3) for r in range(world_size)]
    seen = torch.cat([x for loader in loaders for x, _ in loader.batches()])
    assert sorted(seen.flatten().tolist()) == sorted(data.inputs[:24].flatten().tolist())
    # With the training's overfit limit too, the smaller of the two is the set.
    small = [build_val_loader(data, 8, r, world_size, CPU, limit_samples=10, limit_batches=3) for r in range(world_size)]
    assert sum(len(x) for loader in small for x, _ in loader.batches()) == 10


@pytest.mark.parametrize("task,outputs,targets", [
    (RegressionTask(), (4, 1), ("float", (4, 1))),
    (ClassificationTask(), (4, 3), ("long", (4,))),
    (LanguageModelTask(), (2, 5, 7), ("long", (2, 5))),
    (LossTask(loss=torch.nn.SmoothL1Loss(), metrics={"mae": torch.nn.L1Loss()}), (4, 1), ("float", (4, 1))),
])
def test_every_validation_sum_lives_on_the_models_device(task, outputs, targets):
    # "meta" stands in for a GPU: a sum made on the CPU instead would not stack with the others.
    meta = torch.device("meta")
    dtype, shape = targets
    target = torch.empty(shape, dtype=torch.long if dtype == "long" else torch.float, device=meta)
    sums = task.eval_sums(torch.empty(outputs, device=meta), target)
    assert "count" in sums and {value.device for value in sums.values()} == {meta}


def test_a_loss_task_weights_batch_means_so_any_split_gives_the_whole_sets_mean():
    from ringtrain.data.tasks import metrics_from_sums

    task = LossTask(loss=torch.nn.MSELoss(), metrics={"mae": torch.nn.L1Loss()})
    outputs, targets = torch.randn(10, 1), torch.randn(10, 1)
    whole = metrics_from_sums(task.eval_sums(outputs, targets))
    parts = [task.eval_sums(outputs[a:b], targets[a:b]) for a, b in ((0, 3), (3, 10))]
    split = metrics_from_sums({k: parts[0][k] + parts[1][k] for k in parts[0]})
    assert whole["loss"] == pytest.approx(((outputs - targets) ** 2).mean().item())
    assert split == pytest.approx(whole) and whole["mae"] == pytest.approx((outputs - targets).abs().mean().item())


class _SignalDispositions(Dataset):
    """Each item: whether the process reading it ignores SIGTERM, and its pid."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        import signal

        return torch.tensor([int(signal.getsignal(signal.SIGTERM) == signal.SIG_IGN), os.getpid()])


def test_dataloader_workers_leave_the_stop_signals_to_the_main_process():
    """torchrun sends SIGTERM to a rank's whole process group: a worker that died of it failed
    the rank's next batch before the rank could save (tests/test_hf_text.py stops such a job)."""
    import signal

    from ringtrain.loop.loaders import BatchLoader, Shards, WorkerOptions

    workers = WorkerOptions(num_workers=1, stop_signals=("SIGTERM", "SIGINT"))
    loader = BatchLoader(_SignalDispositions(), 2, Shards(4, 0, 1), torch.device("cpu"), workers=workers)
    rows = torch.cat(list(loader.batches()))
    assert rows[:, 0].tolist() == [1, 1, 1, 1] and os.getpid() not in rows[:, 1].tolist()  # read in a worker, ignoring
    assert signal.getsignal(signal.SIGTERM) != signal.SIG_IGN  # the main process still handles it
