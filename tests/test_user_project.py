"""A user's project whose own packages are called `data` and `models`, with a `trainer.py` of its
own, trained by ringtrain: the names are the project's, never ringtrain's folders of the same
names (installed ringtrain is `ringtrain`, `ringtrain.data`, `ringtrain.models` only).

A fixture writes the project into a temporary directory outside the repository:

    data/shapes.py     Shapes: a data component (4 shapes of 6x6 pixels in noise; the shape is the label)
    models/nets.py     MyNet: an MLP built from `trainer.dense`, the project's own helper
    trainer.py         dense(): imported by models/nets.py as `from trainer import dense`
    conf/model/my_net.yaml, conf/data/shapes.yaml   `_target_: models.nets.MyNet`, `data.shapes.Shapes`

and every run is a real `python <repo>/train.py --config-dir conf ...` started there, as a user
runs it from a clone (the clone's own data/, models/ and trainer/ folders sit beside train.py).
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from conftest import REPO, assert_same_weights, checkpoint_weights, run_cli

HELPERS = '''
"""The project's own helpers: this `trainer` is the project's module, not ringtrain."""
from torch import nn


def dense(in_features: int, out_features: int) -> nn.Module:
    """A linear layer and a ReLU, the block the project's models are made of."""
    return nn.Sequential(nn.Linear(in_features, out_features), nn.ReLU())
'''

NETS = '''
"""The project's model; ringtrain knows it only by its import path, models.nets.MyNet."""
import torch
from torch import nn

from trainer import dense  # the project's trainer.py


class MyNet(nn.Module):
    def __init__(self, in_features: int, num_classes: int, hidden: int = 32):
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), dense(in_features, hidden))
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(images))
'''

SHAPES = '''
"""The project's data: 6x6 images of one of four shapes in Gaussian noise; the shape is the label.

Shapes follows LightningDataModule's contract: the constructor stores its arguments and the
sizes they give the model, setup() builds the two map-style splits."""
import torch
from torch.utils.data import Dataset


def _templates() -> torch.Tensor:
    shapes = torch.zeros(4, 6, 6)
    shapes[0, 2:4, :] = 1  # horizontal bar
    shapes[1, :, 2:4] = 1  # vertical bar
    shapes[2] = torch.eye(6)  # diagonal
    shapes[3, [0, 5], :] = 1  # ring
    shapes[3, :, [0, 5]] = 1
    return shapes


class ShapeImages(Dataset):
    def __init__(self, n: int, seed: int, noise: float):
        generator = torch.Generator().manual_seed(seed)
        self.labels = torch.randint(0, 4, (n,), generator=generator)
        self.images = _templates()[self.labels] + noise * torch.randn(n, 6, 6, generator=generator)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int):
        return self.images[index], self.labels[index]


class Shapes:
    def __init__(self, n_train: int, n_val: int, noise: float = 0.7, seed: int = 0):
        self.n_train, self.n_val, self.noise, self.seed = n_train, n_val, noise, seed
        self.dims = {"in_features": 36, "num_classes": 4}

    def setup(self) -> None:
        self.train = ShapeImages(self.n_train, self.seed, self.noise)
        self.val = ShapeImages(self.n_val, self.seed + 1, self.noise)
'''

MODEL_YAML = '''
# @package _global_
# The project's MLP; in_features and num_classes come from the data (Shapes.dims).
defaults:
  - override /data: shapes

model:
  _target_: models.nets.MyNet
  hidden: 32
'''

DATA_YAML = '''
# @package _global_
defaults:
  - override /task: classification

data:
  _target_: data.shapes.Shapes
  n_train: 256
  n_val: 128
'''

# 256 samples, batch 32: 8 steps an epoch, 24 in all. SGD with momentum and no dropout, so 2
# ranks with batch 16 take exactly the steps of one process with batch 32.
COMMON = ["--config-dir", "conf", "model=my_net", "data=shapes", "optimizer=sgd", "optimizer.lr=0.1",
          "optimizer.momentum=0.9", "trainer.max_epochs=3", "trainer.seed=0"]
LAUNCHES = {"single": ["trainer.batch_size=32"],
            "ddp": ["strategy=ddp", "strategy.nproc_per_node=2", "trainer.batch_size=16"]}

# Run in the project: the checkpoint's weights into the project's class, strictly, and that
# model's accuracy on the project's validation split.
LOAD_INTO_USER_CLASS = '''
import json, sys
import torch
from data.shapes import Shapes
from models.nets import MyNet

model = MyNet(in_features=36, num_classes=4, hidden=32)
model.load_state_dict(torch.load(sys.argv[1], weights_only=True)["model"])  # strict: every key, no prefix
shapes = Shapes(n_train=256, n_val=128)
shapes.setup()
with torch.no_grad():
    accuracy = (model(shapes.val.images).argmax(1) == shapes.val.labels).float().mean().item()
print(json.dumps({"acc": accuracy}))
'''

PROBE = "import data, models, trainer; print(data.__file__, models.__file__, trainer.__file__)"


def _python(code: str, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """`python -c CODE` in cwd as a user starts it: no PYTHONPATH, so only the install and cwd."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def project(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("project")
    files = {
        "data/__init__.py": "", "data/shapes.py": SHAPES, "models/__init__.py": "", "models/nets.py": NETS,
        "trainer.py": HELPERS, "conf/model/my_net.yaml": MODEL_YAML, "conf/data/shapes.yaml": DATA_YAML,
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    assert REPO not in root.parents
    return root


@pytest.fixture(scope="module")
def runs(project, tmp_path_factory) -> dict[str, Path]:
    """The project's model trained in one process and on 2 self-launched DDP ranks."""
    root = tmp_path_factory.mktemp("runs")
    for launch, args in LAUNCHES.items():
        proc = run_cli(COMMON + args + [f"hydra.run.dir={root / launch}"], cwd=project)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return {launch: root / launch for launch in LAUNCHES}


def test_in_the_project_data_models_and_trainer_are_the_projects_own(project, tmp_path):
    printed = _python(PROBE, project).stdout.split()
    assert printed == [str(project / "data" / "__init__.py"), str(project / "models" / "__init__.py"),
                       str(project / "trainer.py")]
    # And outside any project, the install gives none of those names: ringtrain is its only one.
    found = _python("import importlib.util as u; print([u.find_spec(n) is None for n in "
                    "('data', 'models', 'trainer')], u.find_spec('ringtrain') is None)", tmp_path).stdout
    assert found.strip() == "[True, True, True] False"


@pytest.mark.parametrize("launch", list(LAUNCHES))
def test_the_projects_net_learns_its_shapes_and_the_checkpoint_loads_into_its_class(runs, project, launch):
    run_dir = runs[launch]
    final = json.loads((run_dir / "metrics.json").read_text())["final"]
    assert final["val/acc"] > 0.9 and final["val/loss"] < 0.5 * math.log(4), final  # chance: 1/4 and log 4

    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    logged = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    for config in (state["config"], logged):
        assert config["model"]["_target_"] == "models.nets.MyNet"
        assert config["data"]["_target_"] == "data.shapes.Shapes"

    loaded = json.loads(_python(LOAD_INTO_USER_CLASS, project, str(run_dir / "checkpoints" / "last.pt")).stdout)
    assert loaded["acc"] == pytest.approx(final["val/acc"], abs=1e-6)


def test_two_ranks_with_batch_b_reach_the_weights_of_one_process_with_batch_2b(runs):
    assert_same_weights(checkpoint_weights(runs["ddp"]), checkpoint_weights(runs["single"]), atol=1e-5)
