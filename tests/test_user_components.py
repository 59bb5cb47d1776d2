"""A user's own package trained by ringtrain, as a user runs it (the issue's acceptance 1, 3, 5, 7).

A fixture writes `my_pkg/` (a CNN and a map-style Dataset without get_batch) and a config
folder `my_conf/` into a temporary directory outside the repository; every run is a real
`python <repo>/train.py --config-dir my_conf ...` subprocess started there, as a user would:
single process, 2-rank gloo DDP under torchrun and self-launched, command-line-only
components, worker processes, resume mid-epoch, and every kind of bad component refused in
one line before anything is created.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO, assert_same_weights, checkpoint_weights, run_cli, run_module
from helpers import TORCHRUN, ok, refused, user_package

NETS = '''
"""A user's own model: ringtrain knows it only by its import path, my_pkg.nets.SmallCNN."""
import torch
from torch import nn


class SmallCNN(nn.Module):
    """Two 3x3 convolutions and a linear head over (N, in_channels, 8, 8) images."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 8):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, width, 3, padding=1), nn.ReLU(),
            nn.Conv2d(width, width, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(2),
        )
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(images).flatten(1))
'''

DATA = '''
"""A user's own map-style Dataset (no get_batch): 1x8x8 noisy images of a 3x3 blob whose
place is the label."""
import torch
from torch.utils.data import Dataset

PLACES = ((0, 0), (0, 5), (5, 2))  # top left corner of each class's blob


class Blobs(Dataset):
    def __init__(self, n: int, seed: int, noise: float = 0.8):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, len(PLACES), (n,), generator=generator)
        self.images = noise * torch.randn(n, 1, 8, 8, generator=generator)
        for i, label in enumerate(self.labels.tolist()):
            row, col = PLACES[label]
            self.images[i, 0, row:row + 3, col:col + 3] += 1.0

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]


class StartMethodRecorder(Blobs):
    """Blobs whose DataLoader workers each write how multiprocessing started them."""

    def __init__(self, n: int, seed: int, record_dir: str):
        super().__init__(n, seed)
        self.record_dir = record_dir

    def __getitem__(self, index: int):
        import multiprocessing, os
        if torch.utils.data.get_worker_info() is not None:
            with open(os.path.join(self.record_dir, f"{os.getpid()}.txt"), "w") as record:
                record.write(multiprocessing.get_start_method())
        return super().__getitem__(index)
'''

MODEL_YAML = '''
# @package _global_
# The user's CNN; in_channels and num_classes come from the data (data.dims).
defaults:
  - override /data: blobs

model:
  _target_: my_pkg.nets.SmallCNN
  width: 8
'''

DATA_YAML = '''
# @package _global_
# Two Datasets of the user's and the sizes they dictate to the model.
defaults:
  - override /task: classification

data:
  train:
    _target_: my_pkg.data.Blobs
    n: 384
    seed: 0
  val:
    _target_: my_pkg.data.Blobs
    n: 128
    seed: 1
  dims:
    in_channels: 1
    num_classes: 3
'''

# 384 samples, batch 32: 12 steps an epoch, 48 in all. SGD with momentum and no dropout or
# batch norm, so 2 ranks with batch 16 take exactly the steps of one process with batch 32.
COMMON = ["--config-dir", "my_conf", "data=blobs", "optimizer=sgd", "optimizer.lr=0.1", "optimizer.momentum=0.9",
          "trainer.max_epochs=4", "trainer.seed=3"]
USER = COMMON + ["model=small_cnn"]


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """A directory outside the repository with the user's package and config folder; the
    test process can import my_pkg too (to load checkpoints into the user's class)."""
    root = tmp_path_factory.mktemp("user")
    files = {
        "my_pkg/__init__.py": "", "my_pkg/nets.py": NETS, "my_pkg/data.py": DATA,
        "my_conf/model/small_cnn.yaml": MODEL_YAML, "my_conf/data/blobs.yaml": DATA_YAML,
    }
    with user_package(root, files, "my_pkg"):
        yield root


def _train(user_dir: Path, args: list[str], launcher: list[str] | None = None,
           base: list[str] = USER) -> subprocess.CompletedProcess:
    return ok(run_cli(base + args, cwd=user_dir, launcher=launcher))


def _final(run_dir: Path) -> dict[str, float]:
    return json.loads((run_dir / "metrics.json").read_text())["final"]


@pytest.fixture(scope="module")
def single_run(user_dir, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("runs") / "single"
    _train(user_dir, ["trainer.batch_size=32", f"hydra.run.dir={run_dir}"])
    return run_dir


def test_the_users_cnn_learns_and_its_checkpoint_loads_into_the_users_class(single_run, user_dir):
    metrics = _final(single_run)
    assert metrics["val/acc"] > 0.8 and metrics["val/loss"] < 0.5 * math.log(3)  # chance: 1/3 and log 3
    from my_pkg.data import Blobs
    from my_pkg.nets import SmallCNN

    state = torch.load(single_run / "checkpoints" / "last.pt", weights_only=True)
    model = SmallCNN(in_channels=1, num_classes=3)
    model.load_state_dict(state["model"])  # strict: every key, no `module.` prefix
    val = Blobs(n=128, seed=1)
    with torch.no_grad():
        accuracy = (model(val.images).argmax(1) == val.labels).float().mean().item()
    assert accuracy == pytest.approx(metrics["val/acc"], abs=1e-6)


def test_evaluate_rebuilds_the_users_model_from_its_checkpoint(single_run, user_dir, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    # --config-dir: the user's own options, which the checkpoint's recipe names (config/recipe.py)
    proc = subprocess.run([sys.executable, "-m", "ringtrain.tools.evaluate", "--config-dir", "my_conf",
                           f"checkpoint={single_run / 'checkpoints/last.pt'}", f"output={tmp_path / 'eval.json'}"],
                          cwd=user_dir, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    evaluated = json.loads((tmp_path / "eval.json").read_text())["metrics"]
    for key, value in _final(single_run).items():
        assert evaluated[key] == pytest.approx(value, abs=1e-6), key


@pytest.mark.parametrize("launch", ["torchrun", pytest.param("self-launched", marks=pytest.mark.slow)])
def test_two_ranks_with_batch_b_equal_one_process_with_batch_2b(single_run, user_dir, tmp_path, launch):
    args = ["strategy=ddp", "trainer.batch_size=16", f"hydra.run.dir={tmp_path / 'ddp'}"]
    if launch == "torchrun":
        _train(user_dir, args, launcher=TORCHRUN)
    else:
        _train(user_dir, args + ["strategy.nproc_per_node=2"])
    assert_same_weights(checkpoint_weights(tmp_path / "ddp"), checkpoint_weights(single_run), atol=1e-5)
    ddp, single = _final(tmp_path / "ddp"), _final(single_run)
    for key, value in single.items():  # validation sharded over the ranks, summed exactly
        assert ddp[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key


@pytest.mark.slow
def test_fsdp_with_sharded_checkpoints_trains_the_users_cnn_and_consolidates_into_its_class(
        single_run, user_dir, tmp_path):
    run_dir = tmp_path / "fsdp"
    _train(user_dir, ["strategy=fsdp", "strategy.nproc_per_node=2", "strategy.state_dict_type=sharded",
                      "trainer.batch_size=16", f"hydra.run.dir={run_dir}"])
    assert (run_dir / "checkpoints" / "step-00000048.shards" / ".metadata").is_file()
    # --config-dir: the user's own options, which the checkpoint's recipe names (config/recipe.py)
    proc = run_module("ringtrain.tools.consolidate", ["--config-dir", "my_conf", f"checkpoint={run_dir / 'checkpoints/last.pt'}",
                                              f"output={tmp_path / 'cnn.pt'}"], cwd=user_dir)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from my_pkg.nets import SmallCNN

    model = SmallCNN(in_channels=1, num_classes=3)
    model.load_state_dict(torch.load(tmp_path / "cnn.pt", weights_only=True)["model"])  # strict
    assert_same_weights(model.state_dict(), checkpoint_weights(single_run), atol=1e-5)


def test_a_component_given_on_the_command_line_alone(user_dir, tmp_path):
    """No model YAML: the default model's node, retargeted at the user's class, plus a new argument."""
    _train(user_dir, ["model._target_=my_pkg.nets.SmallCNN", "+model.width=4", "trainer.max_epochs=1",
                      f"hydra.run.dir={tmp_path}"], base=COMMON)
    weights = checkpoint_weights(tmp_path)
    assert weights["features.0.weight"].shape == (4, 1, 3, 3) and weights["head.weight"].shape == (3, 16)


BAD_COMPONENTS = {
    "misspelt module": (["model._target_=my_pkgg.nets.SmallCNN"], "no module named 'my_pkgg'"),
    "misspelt class": (["model._target_=my_pkg.nets.SmallCN"], "has no attribute 'SmallCN'; did you mean SmallCNN?"),
    "unknown argument": (["+model.widht=3"], "takes no argument 'widht'; did you mean model.width?"),
    "missing argument": (["~data.train.seed"], "data.train.seed is required by my_pkg.data.Blobs"),
    "size the data lacks": (["~data.dims.num_classes"], "model.num_classes is required by my_pkg.nets.SmallCNN"),
    "wrong type": (["model.width=abc"], "model.width='abc' does not fit my_pkg.nets.SmallCNN's annotation int"),
    "a list for an int": (["model.width=[4,8]"], "model.width=[4, 8] does not fit"),
    "model not a Module": (["model._target_=my_pkg.data.Blobs"],
                           "is a Blobs (a torch.utils.data.Dataset), not a torch.nn.Module"),
    "split not a Dataset": (["data.val._target_=my_pkg.nets.SmallCNN"],
                            "data.val._target_='my_pkg.nets.SmallCNN' is a SmallCNN (a torch.nn.Module), not a "
                            "torch.utils.data.Dataset"),
    "optimizer not an optimizer": (["optimizer._target_=torch.nn.Linear"],
                                   "is a Linear (a torch.nn.Module), not a torch.optim.Optimizer"),
}


@pytest.mark.parametrize("overrides,message", list(BAD_COMPONENTS.values()), ids=list(BAD_COMPONENTS))
def test_a_bad_component_is_one_line_exit_2_and_no_run_directory(user_dir, tmp_path, overrides, message):
    proc = run_cli(USER + overrides + [f"hydra.run.dir={tmp_path / 'run'}"], cwd=user_dir)
    refused(proc, message)
    assert not (tmp_path / "run").exists() and not (user_dir / "outputs").exists()


@pytest.mark.slow
def test_a_self_launched_ranks_workers_start_as_a_torchrun_ranks_do(user_dir, tmp_path):
    """The ranks ringtrain starts itself are spawned; a spawned process takes "spawn" as its
    own default, so its DataLoader workers re-imported torch and the user's code every epoch
    (60 steps of an hf_rows classifier, 2 workers a rank: 50 s, against 1.8 s under torchrun).
    They start as the platform's default makes them, as under torchrun."""
    import multiprocessing

    (tmp_path / "records").mkdir()
    _train(user_dir, ["strategy=ddp", "strategy.nproc_per_node=2", "trainer.num_workers=1", "trainer.max_steps=2",
                      "data.train._target_=my_pkg.data.StartMethodRecorder",
                      f"+data.train.record_dir={tmp_path / 'records'}", f"hydra.run.dir={tmp_path / 'run'}"])
    methods = [path.read_text() for path in (tmp_path / "records").iterdir()]
    assert len(methods) == 2 and set(methods) == {multiprocessing.get_start_method()}  # one worker per rank


@pytest.mark.slow
def test_worker_processes_and_a_resume_mid_epoch_change_no_bit(single_run, user_dir, tmp_path):
    """num_workers=2 loads the user's Dataset in 2 processes: the same batches, so the same
    weights as the main process alone (single_run). Then a run stopped at step 18, half way
    through epoch 2 (last.pt saved every 5 steps and at its end), resumed into a new directory
    with workers, ends bit for bit where the uninterrupted run does."""
    workers = ["trainer.batch_size=32", "trainer.num_workers=2", "trainer.checkpoint_every_n_steps=5"]
    _train(user_dir, workers + [f"hydra.run.dir={tmp_path / 'straight'}"])
    straight = checkpoint_weights(tmp_path / "straight")
    for key, value in checkpoint_weights(single_run).items():
        assert torch.equal(straight[key], value), key

    _train(user_dir, workers + ["trainer.max_steps=18", f"hydra.run.dir={tmp_path / 'first'}"])
    stopped = torch.load(tmp_path / "first" / "checkpoints" / "last.pt", weights_only=True)["progress"]
    assert stopped["step"] == 18 and stopped["samples_into_epoch"] == 6 * 32  # mid-epoch
    # The checkpoint's stored config says max_steps=18: back to the epochs of the straight run.
    _train(user_dir, workers + [f"trainer.resume={tmp_path / 'first/checkpoints/last.pt'}", "trainer.max_steps=-1",
                                f"hydra.run.dir={tmp_path / 'second'}"])
    resumed = checkpoint_weights(tmp_path / "second")
    for key, value in straight.items():
        assert torch.equal(resumed[key], value), key
