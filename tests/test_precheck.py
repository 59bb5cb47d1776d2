"""Issue 19, acceptance 1c and 2: a `**kwargs` model factory (as torchvision's and timm's are)
trains on cifar10-format data with YAML only, the data's sizes reach only what the config
asks, and each mismatch between model, data and task is one line, exit 2, before anything is
on disk: what the built components find, as they are built or at the first step, refuses the
run (ringtrain/run.py takes back what it put in the run directory).

The mismatches run `ringtrain`'s own entry point in this process (the same code path as the
command, without a new interpreter importing torch and transformers for each)."""
from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from conftest import QUIET, compose_config, run_cli
from helpers import TORCHRUN, ok
from ringtrain.data.cifar10 import write_fake_cifar10

NETS = '''
import torch
from torch import nn


class SmallCNN(nn.Module):
    """(N, 3, 32, 32) images -> num_classes logits."""

    def __init__(self, num_classes: int = 1000, width: int = 8):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(2))
        self.head = nn.Linear(4 * width, num_classes)

    def forward(self, images):
        return self.head(self.features(images).flatten(1))


def small_cnn(**kwargs) -> SmallCNN:
    """A factory as torchvision's resnet18 and timm's create_model are: **kwargs, passed on."""
    return SmallCNN(**kwargs)


class Head(nn.Module):
    def __init__(self, in_features: int, num_classes: int):
        super().__init__()
        self.linear = nn.Linear(in_features, num_classes)

    def forward(self, x):
        return self.linear(x)


def forwarding_head(**kwargs) -> Head:
    return Head(**kwargs)


class Picky(Head):
    def __init__(self, in_features: int, num_classes: int, width: int = 4):
        if width % 2:
            raise RuntimeError(f"width={width} must be even")
        super().__init__(in_features, num_classes)


class Encoder(Head):
    """Returns its features under a name the task does not read."""

    def forward(self, x):
        return {"last_hidden_state": self.linear(x)}
'''

DATA = '''
import torch
from torch.utils.data import Dataset


class DictRows(Dataset):
    """Rows keyed x and y: no key says it is the target."""

    def __init__(self, n: int):
        self.x, self.y = torch.randn(n, 4), torch.arange(n) % 2

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        return {"x": self.x[i], "y": self.y[i]}
'''

CONF = {
    "model/head.yaml": """
        _target_: precheck_pkg.nets.Head
        """,
    "model/cnn.yaml": """
        _target_: precheck_pkg.nets.small_cnn
        num_classes: ${data.dims.num_classes}
        """,
    "model/gpt2.yaml": """
        # @package _global_
        defaults:
          - override /data: text
        model:
          _target_: transformers.GPT2LMHeadModel
          config:
            _target_: transformers.GPT2Config
            vocab_size: ${data.dims.vocab_size}
            n_positions: 16
            n_embd: 8
            n_layer: 1
            n_head: 2
            bos_token_id: null
            eos_token_id: null
        data:
          seq_len: 16
        """,
    "data/dict_rows.yaml": """
        # @package _global_
        defaults:
          - override /task: classification
        data:
          train: {_target_: precheck_pkg.data.DictRows, n: 32}
          val: {_target_: precheck_pkg.data.DictRows, n: 8}
          dims: {in_features: 4, num_classes: 2}
        """,
}


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """A user's folder outside the repository: precheck_pkg, conf/ and a fake CIFAR-10 on disk."""
    root = tmp_path_factory.mktemp("precheck_user")
    (root / "precheck_pkg").mkdir()
    (root / "precheck_pkg" / "__init__.py").write_text("")
    (root / "precheck_pkg" / "nets.py").write_text(NETS)
    (root / "precheck_pkg" / "data.py").write_text(DATA)
    for name, text in CONF.items():
        (root / "conf" / name).parent.mkdir(parents=True, exist_ok=True)
        (root / "conf" / name).write_text(textwrap.dedent(text))
    write_fake_cifar10(root / "cifar", n_train_per_batch=16, n_test=16)
    (root / "input.txt").write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 50)
    return root


CIFAR = ["model=cnn", "data=cifar10", "data.root=cifar", "trainer.batch_size=16"]


def _refused_here(user_dir: Path, monkeypatch, capsys, args: list[str]) -> str:
    """`ringtrain ARGS` run from user_dir by its entry point in this process: exit 2, one
    line on stderr, and no run directory; returns the line."""
    from ringtrain.__main__ import main

    monkeypatch.chdir(user_dir)
    monkeypatch.setattr(sys, "path", list(sys.path))  # main() puts the current directory first
    monkeypatch.setattr(sys, "argv", ["ringtrain", "--config-dir", "conf", *args, "hydra.run.dir=run", *QUIET])
    with pytest.raises(SystemExit) as exit:
        main()
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not (user_dir / "run").exists() and not (user_dir / "outputs").exists()
    return lines[0]


def test_a_kwargs_factory_trains_on_cifar10_format_data_with_its_size_from_the_yaml(user_dir, tmp_path):
    """The factory gets num_classes from `${data.dims.num_classes}`, and nothing else: the
    data's in_features never reaches its **kwargs. Trained on one batch (overfit), its loss falls."""
    ok(run_cli(["--config-dir", "conf", *CIFAR, "trainer.overfit_batches=1", "trainer.max_steps=30", "optimizer=adam",
                "optimizer.lr=1e-2", "trainer.eval_every_n_steps=15", f"hydra.run.dir={tmp_path / 'run'}"],
               cwd=user_dir))
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["model"]["head.weight"].shape == (10, 32)
    log = (tmp_path / "run" / "train.log").read_text()
    losses = [float(line.split("val/loss=")[1].split()[0]) for line in log.splitlines() if "val/loss=" in line]
    assert losses[-1] < losses[0] * 0.8, losses


@pytest.mark.slow
def test_a_kwargs_factory_trains_as_a_two_rank_ddp_job(user_dir, tmp_path):
    ok(run_cli(["--config-dir", "conf", *CIFAR, "strategy=ddp", "trainer.max_steps=6", f"hydra.run.dir={tmp_path / 'run'}"],
               cwd=user_dir, launcher=TORCHRUN))
    assert json.loads((tmp_path / "run" / "metrics.json").read_text())["steps"] == 6


def test_torchvision_resnet18_itself_trains_on_cifar10_format_data(user_dir, tmp_path):
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # the wheel beside this CPU torch: "operator torchvision::nms does not exist"
        pytest.skip(f"torchvision does not import here ({err})")
    (user_dir / "conf" / "model" / "resnet18.yaml").write_text(
        "_target_: torchvision.models.resnet18\nnum_classes: ${data.dims.num_classes}\n")
    ok(run_cli(["--config-dir", "conf", *CIFAR, "model=resnet18", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"],
               cwd=user_dir))


def test_sizes_fill_named_arguments_a_kwargs_catch_all_only_when_asked_and_never_when_off(user_dir, monkeypatch):
    from ringtrain.config.builders import build_model

    monkeypatch.syspath_prepend(str(user_dir))
    dims = {"in_features": 4, "num_classes": 2}
    assert build_model({"_target_": "precheck_pkg.nets.Head"}, dims).linear.weight.shape == (2, 4)
    with pytest.raises(Exception, match="missing 2 required positional arguments"):
        build_model({"_target_": "precheck_pkg.nets.forwarding_head"}, dims)  # named (the default): **kwargs gets nothing
    assert build_model({"_target_": "precheck_pkg.nets.forwarding_head", "fill_sizes": "all"}, dims).linear.out_features == 2
    only = {"_target_": "precheck_pkg.nets.forwarding_head", "fill_sizes": ["num_classes"], "in_features": 3}
    assert build_model(only, dims).linear.weight.shape == (2, 3)
    off = {"_target_": "precheck_pkg.nets.Head", "fill_sizes": "none", "in_features": 5, "num_classes": 7}
    assert build_model(off, dims).linear.weight.shape == (7, 5)


def test_data_sizes_interpolate_inside_nested_nodes(user_dir, monkeypatch):
    pytest.importorskip("transformers")
    from ringtrain.config.builders import build_model
    from ringtrain.config.schema import validate

    monkeypatch.chdir(user_dir)
    run = validate(compose_config(["model=hf_gpt2", "data.path=input.txt", "data.cache_dir="]))
    assert run.model["config"]["vocab_size"] == "${data.dims.vocab_size}"
    with torch.device("meta"):
        model = build_model(run.model, {"vocab_size": 27})
    assert model.config.vocab_size == 27 == model.get_input_embeddings().num_embeddings


MISMATCHES = {
    "a constructor that raises": (["model=head", "data=dict_rows", "model._target_=precheck_pkg.nets.Picky", "+model.width=3"],
                                  "building the model precheck_pkg.nets.Picky failed: RuntimeError: width=3 must be even "
                                  "(raised at precheck_pkg/nets.py:"),
    "an output the task cannot read": (["model=head", "data=dict_rows", "model._target_=precheck_pkg.nets.Encoder", "task.target_key=y"],
                                       "the model returned a dict without logits (it has ['last_hidden_state']); set "
                                       "task.output_key to the key of the predictions, e.g. task.output_key=last_hidden_state"),
    "a dict batch without the target key": (["model=head", "data=dict_rows"],
                                            "batches are dicts with keys ['x', 'y'] and none is the target (labels or "
                                            "label); set task.target_key=<the key of the targets>"),
    "a typo on a kwargs factory": (CIFAR + ["+model.num_clases=10"],
                                   "model.num_clases: precheck_pkg.nets.small_cnn passes it on to SmallCNN, which takes no "
                                   "argument 'num_clases'; did you mean model.num_classes?"),
    "a vocabulary larger than the embedding": (["model=gpt2", "data.path=input.txt", "data.cache_dir=", "model.config.vocab_size=10"],
                                               "the data's vocabulary has 27 tokens but the model's input embedding has 10 "
                                               "rows; set the model's vocab_size to ${data.dims.vocab_size} (or at least 27)"),
    "a sequence longer than the positions": (["model=gpt2", "data.path=input.txt", "data.cache_dir=", "data.seq_len=24"],
                                             "the data's sequences are 24 tokens long but the model has 16 positions "
                                             "(n_positions); raise the model's n_positions to 24 or shorten data.seq_len"),
}


@pytest.mark.parametrize("args,message", list(MISMATCHES.values()), ids=list(MISMATCHES))
def test_each_mismatch_is_one_line_exit_2_and_nothing_on_disk(user_dir, monkeypatch, capsys, args, message):
    if "model=gpt2" in args:
        pytest.importorskip("transformers")
    line = _refused_here(user_dir, monkeypatch, capsys, args)
    assert message in line, line
