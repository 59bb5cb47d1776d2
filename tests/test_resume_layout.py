"""A run continued in another layout (world size, per-rank batch, accumulation) resumes at the
next unseen sample of its epoch, for real: subprocesses, torchrun/gloo on CPU.

A fixture writes a user's Dataset that appends every index it is asked for to a file of its
rank (and process); each test reads those files back and checks that every sample of the
interrupted epoch was drawn exactly once across the run before the stop and the run after it.
The Dataset has no get_batch, so it goes through the torch DataLoader path of the loader.
Every job has a bound (the subprocess timeout), so none of these can hang the suite.
"""
from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from conftest import QUIET, REPO, checkpoint_weights, run_cli, train_in_process
from helpers import TORCHRUN, Job, ok
from test_resilience import copy_run_dir

from ringtrain.loop.loaders import ShuffledShards

RECORDED = '''
"""Samples of a learnable 3-class problem; the training split records each index it serves."""
import os
import sys

import torch
from torch.utils.data import Dataset


class Recorded(Dataset):
    def __init__(self, n: int, seed: int, record: str = ""):
        generator = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(n, 8, generator=generator)
        self.labels = (self.inputs[:, :3] * torch.tensor([1.0, 2.0, 3.0])).argmax(1)
        self.record = record

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        # Only what the training loader serves (torch's DataLoader fetcher calls this), not a
        # sample read to check sizes before any work (config/builders.py), which trains on none.
        if self.record and sys._getframe(1).f_code.co_filename.endswith("fetch.py"):
            os.makedirs(self.record, exist_ok=True)
            name = f"rank{os.environ.get('RANK', '0')}-{os.getpid()}.txt"
            with open(os.path.join(self.record, name), "a") as file:
                file.write(f"{index}\\n")
        return self.inputs[index], self.labels[index]
'''

DATA_YAML = '''
# @package _global_
defaults:
  - override /task: classification

data:
  train:
    _target_: recorded.Recorded
    n: 384
    seed: 0
    record: ""
  val:
    _target_: recorded.Recorded
    n: 64
    seed: 1
  dims:
    in_features: 8
    num_classes: 3
'''

SAMPLES = 384
# No dropout and SGD: one process with a global batch of 32 and two ranks of 16 take the same
# steps up to float rounding. One epoch: 12 steps at a global batch of 32.
COMMON = ["--config-dir", "my_conf", "model=mlp", "data=recorded", "model.hidden_sizes=[16]",
          "optimizer=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9", "trainer.seed=3",
          "trainer.max_epochs=1", "trainer.log_every_n_steps=1"]
ONE_PROCESS_ACCUMULATING = ["trainer.batch_size=16", "trainer.accumulate_grad_batches=2"]
TWO_RANKS = ["strategy=ddp", "trainer.batch_size=16"]
LAYOUT_LINE = r"world size (\d+) -> (\d+), per-rank batch (\d+) -> (\d+).*; continuing at sample (\d+) of epoch 0"
# Every job's bound: the suite fails rather than hangs.
JOB_SECONDS = 240


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("user")
    (root / "recorded.py").write_text(textwrap.dedent(RECORDED).lstrip())
    (root / "my_conf" / "data").mkdir(parents=True)
    (root / "my_conf" / "data" / "recorded.yaml").write_text(textwrap.dedent(DATA_YAML).lstrip())
    return root


def train(user_dir: Path, run_dir: Path, record: Path, args: list[str], launcher: list[str] | None = None):
    return ok(run_cli(COMMON + args + [f"data.train.record={record}", f"hydra.run.dir={run_dir}"],
                      cwd=user_dir, launcher=launcher, timeout=JOB_SECONDS))


def drawn(record: Path) -> Counter:
    """Every index the training Dataset served, counted, over all ranks' files."""
    counts: Counter = Counter()
    for file in record.glob("rank*.txt"):
        counts.update(int(line) for line in file.read_text().split())
    return counts


def assert_each_sample_once(before: Path, after: Path) -> None:
    together = drawn(before) + drawn(after)
    assert sorted(together) == list(range(SAMPLES)), f"{SAMPLES - len(together)} samples never drawn"
    repeated = {index: n for index, n in together.items() if n > 1}
    assert not repeated, f"{len(repeated)} samples drawn twice or more, e.g. {list(repeated.items())[:5]}"


@pytest.fixture(scope="module")
def uninterrupted(user_dir, tmp_path_factory) -> dict[str, torch.Tensor]:
    """One process, global batch 32 (16 x 2 accumulated), the whole epoch at once."""
    run_dir = tmp_path_factory.mktemp("uninterrupted")
    train(user_dir, run_dir, run_dir / "record", ONE_PROCESS_ACCUMULATING)
    return checkpoint_weights(run_dir)


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[key].double() - b[key].double()).abs().max().item() for key in a)


@pytest.fixture(scope="module")
def stopped_at_step_5(user_dir, tmp_path_factory) -> Path:
    """One process, batch 16, stopped by max_steps at step 5 (80 samples in): its run
    directory, and beside it `before`, what it drew. Tests continue copies of it."""
    root = tmp_path_factory.mktemp("stopped")
    train(user_dir, root / "run", root / "before", ["trainer.batch_size=16", "trainer.max_steps=5"])
    return root


def continue_a_copy(stopped: Path, tmp_path: Path) -> Path:
    copy_run_dir(stopped / "run", tmp_path / "run")
    shutil.copytree(stopped / "before", tmp_path / "before")
    return tmp_path / "run"


# Both directions are acceptance tests; 1 -> 2 (the hang) is the one the default suite runs.
@pytest.mark.parametrize("direction", ["1 process -> 2 ranks",
                                       pytest.param("2 ranks -> 1 process", marks=pytest.mark.slow)])
def test_a_run_continued_on_another_number_of_ranks_trains_each_sample_once(user_dir, tmp_path, uninterrupted,
                                                                             direction):
    """Stopped at step 5 of 12 (160 samples in), continued in the other layout at the same
    global batch: the epoch ends at step 12, every sample once, the weights the uninterrupted
    run's up to float rounding (two ranks sum their gradients in another order)."""
    first, then = (ONE_PROCESS_ACCUMULATING, None), (TWO_RANKS, TORCHRUN)
    if direction.startswith("2"):
        first, then = then, first
    run_dir = tmp_path / "run"
    train(user_dir, run_dir, tmp_path / "before", first[0] + ["trainer.max_steps=5"], launcher=first[1])
    proc = train(user_dir, run_dir, tmp_path / "after", then[0], launcher=then[1])
    log = proc.stdout + proc.stderr
    old, new = (1, 2) if direction.startswith("1") else (2, 1)
    assert re.search(LAYOUT_LINE, log).groups() == (str(old), str(new), "16", "16", "160"), log[-3000:]
    assert_each_sample_once(tmp_path / "before", tmp_path / "after")
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert state["progress"]["step"] == 12 and state["progress"]["epoch"] == 1
    assert state["layout"] == {"world_size": new, "batch_size": 16, "accumulate_grad_batches": 2 if new == 1 else 1}
    diff = max_abs_diff(checkpoint_weights(run_dir), uninterrupted)
    print(f"{direction}: max abs weight difference from the uninterrupted run {diff:.3g}")
    assert diff < 1e-5


@pytest.mark.slow
def test_a_per_rank_batch_change_on_resume_trains_each_sample_once(user_dir, tmp_path, stopped_at_step_5):
    """Batch 16 stopped at step 5 (80 samples in), continued with batch 24: 304 samples left
    make 13 batches (the last of 16), so the epoch ends at step 18, each sample drawn once."""
    run_dir = continue_a_copy(stopped_at_step_5, tmp_path)
    proc = train(user_dir, run_dir, tmp_path / "after", ["trainer.batch_size=24"])
    log = proc.stdout + proc.stderr
    assert re.search(LAYOUT_LINE, log).groups() == ("1", "1", "16", "24", "80"), log[-3000:]
    assert "step 5 of 18" in log
    assert_each_sample_once(tmp_path / "before", tmp_path / "after")
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["progress"]["step"] == 18


@pytest.mark.slow
def test_sigterm_stops_a_resumed_job_within_seconds(user_dir, tmp_path, stopped_at_step_5):
    """The issue's hang: a run continued with another batch. SIGTERM as soon as it says where it
    continues: it stops (before or after a step), exits 143, and the same command finishes."""
    run_dir = continue_a_copy(stopped_at_step_5, tmp_path)
    args = COMMON + ["trainer.batch_size=64", f"data.train.record={tmp_path / 'after'}", f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    with Job([sys.executable, str(REPO / "train.py"), *args, *QUIET], cwd=user_dir, env=env) as job:
        job.wait_for_line(r"continuing at sample 80 of epoch 0", timeout=JOB_SECONDS)
        job.send_signal(signal.SIGTERM)
        status, output = job.finish(timeout=30)
    assert status == 143, output[-3000:]
    assert re.search(r"stopped by SIGTERM (before training step 6|after step \d+)", output), output[-3000:]
    train(user_dir, run_dir, tmp_path / "last", ["trainer.batch_size=64"])
    # 304 samples left after step 5, in batches of 64: the run ends at step 10, wherever it stopped
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["progress"]["step"] == 10
    before_stop = drawn(tmp_path / "after")  # the steps the stopped job took (saved in its last.pt)
    together = drawn(tmp_path / "before") + before_stop + drawn(tmp_path / "last")
    assert sorted(together) == list(range(SAMPLES)) and max(together.values()) == 1


@pytest.mark.parametrize(
    "length,before,after,drop_last",
    [(384, (1, 16, 5), (2, 16), False), (384, (2, 16, 5), (1, 32), False), (203, (2, 16, 3), (3, 7), False),
     (203, (1, 10, 7), (4, 16), True), (203, (3, 8, 2), (2, 50), False), (10, (1, 2, 4), (3, 4), False)],
)
def test_a_global_position_continues_at_the_next_unseen_sample_in_any_layout(length, before, after, drop_last):
    """(ranks, per-rank batch, batches taken) before, (ranks, per-rank batch) after: the samples
    before the stop and every rank's rest after it are the epoch's samples, each once (each
    epoch's padding, or under drop_last its tail, aside); every rank has as many batches."""
    ranks, batch, taken = before
    seen = torch.cat([ShuffledShards(length, r, ranks, 7, True, drop_last).indices(3)[: taken * batch]
                      for r in range(ranks)])
    start = taken * batch * ranks
    new_ranks, new_batch = after
    rests = [ShuffledShards(length, r, new_ranks, 7, True, drop_last).indices(3, start) for r in range(new_ranks)]
    assert len({len(rest) for rest in rests}) == 1  # the same share, so the same batch count, on every rank
    together = torch.cat([seen, *rests]).tolist()
    permutation = torch.randperm(length, generator=torch.Generator().manual_seed(7 + 3)).tolist()
    if drop_last:  # at most new_ranks - 1 of the tail left out, nothing twice
        assert len(set(together)) == len(together) and length - len(together) < new_ranks
        assert set(together) == set(permutation[: len(together)])
    else:  # everything, and at most new_ranks - 1 repeats (padding) at the end
        assert set(together) == set(range(length)) and len(together) - length < new_ranks
        assert sorted(together[: length]) == list(range(length))


# --- in-process: an epoch's rest without a batch, stop signals -----------------------------

LINE = ["data.num_samples=256", "data.num_val_samples=32", "trainer.batch_size=16", "optimizer.momentum=0.9",
        "trainer.log_every_n_steps=1"]


def test_an_epochs_rest_without_a_full_batch_moves_on_and_the_cosine_ends_with_the_run(tmp_path, caplog):
    """Batch 8 stopped at step 7 of 8 (56 of 64 samples in), continued with batch 16 and
    drop_last: the 8 samples left make no batch, so epoch 1 starts (4 steps) and the run ends at
    step 11, where the cosine schedule, planned over 16 steps at batch 8, now reaches min_lr."""
    common = ["data.num_samples=64", "data.num_val_samples=16", "trainer.drop_last=true", "scheduler=cosine",
              "scheduler.warmup_steps=0", "trainer.max_epochs=2"]
    train_in_process(common + ["trainer.batch_size=8", "trainer.max_steps=7"], tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.pt"
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        result = train_in_process(common + ["trainer.batch_size=16", f"trainer.resume={last}"], tmp_path / "second")
    assert "per-rank batch 8 -> 16; continuing at sample 56 of epoch 0, step 7 of 11" in caplog.text
    assert "the rest of epoch 0 after sample 56 makes no batch of 16 per rank; continuing with epoch 1" in caplog.text
    state = torch.load(tmp_path / "second" / "checkpoints" / "last.pt", weights_only=True)
    assert result.steps == 11 and state["progress"]["epoch"] == 2 and state["scheduler"]["total_steps"] == 11
    assert state["scheduler"]["_last_lr"][0] == pytest.approx(0.0, abs=1e-12)  # min_lr at the last step


def test_a_stop_signal_while_the_checkpoint_loads_stops_before_the_first_step(tmp_path, caplog, monkeypatch):
    """SIGTERM while a continued run reads its checkpoint (in another layout): it ends before
    training anything, saves nothing new, and says where the run stands."""
    import ringtrain.checkpoints as manager_module

    train_in_process(LINE + ["trainer.max_steps=5"], tmp_path / "first")
    last = tmp_path / "first" / "checkpoints" / "last.pt"
    load = manager_module.load_checkpoint

    def load_while_signalled(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)  # StopSignals' watcher thread takes it and logs it
        deadline = time.monotonic() + 60
        while "received SIGTERM" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        return load(*args, **kwargs)

    monkeypatch.setattr(manager_module, "load_checkpoint", load_while_signalled)
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        result = train_in_process(LINE + ["trainer.batch_size=32", "trainer.max_steps=12", f"trainer.resume={last}"],
                                  tmp_path / "second")
    assert result.stopped == "SIGTERM" and result.steps == 5
    assert "stopped by SIGTERM before training step 6; nothing new to save: the checkpoint it resumed from " \
           "(step 5) is where the run stands" in caplog.text
    assert not list((tmp_path / "second").glob("checkpoints/step-*"))


@pytest.mark.parametrize("steps, checkpoint, said", [
    (0, True, "stopped by SIGTERM before the first step; nothing to save"),
    (5, True, "stopped by SIGTERM at step 5; its checkpoint holds that step"),
    (5, False, "stopped by SIGTERM after step 5 (trainer.checkpoint=false: nothing saved)"),
])
def test_the_exit_line_of_a_stopped_run_says_only_what_was_saved(steps, checkpoint, said):
    """The last line of a stopped run (its exit 143) never claims a last.pt that was not written."""
    from ringtrain.loop import FitResult
    from ringtrain.run import stopped_error

    result = FitResult(metrics={}, monitor="val/loss", mode="min", best_metric=None, steps=steps,
                       train_seconds=0.0, stopped="SIGTERM", stop_kind="signal")
    error = stopped_error(result, checkpoint)
    assert str(error) == said and error.exit_code == 143
