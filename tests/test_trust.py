"""A checkpoint is data: the config it keeps runs no code the user did not name.

A real checkpoint of a tiny run is edited (torch.load, change `state["config"]`, torch.save)
so that rebuilding its run would run code, and every command a user points at a checkpoint
runs on it, as a user runs it (`python -m ringtrain <tool> checkpoint=...`, and training with
`trainer.resume=<file>`), from a directory where the planted code is importable:

  hf_remote_code  model: transformers.AutoModelForCausalLM.from_pretrained over a directory of a
                  custom-code model (config.json's auto_map names a module of that directory),
                  trust_remote_code: true
  model_package   model._target_: a class of a package in the current directory
  data_target     data._target_: likewise
  data_split      data.train._target_ / data.val._target_: likewise (a data node of two Datasets)

The planted code writes a marker file when it is imported. Refused: the marker is never
written, the refusal is exactly one `error:` line, exit 2, naming the flag that lets a user
who trusts the file go on; nothing is written next to the checkpoint (its run directory is
compared byte for byte) nor in the current directory. With that flag (`trust_checkpoint=true`,
`trainer.trust_checkpoint=true`), or with the user's own --config-dir naming the target, the
code does run.

The default run takes one command per case (every command at least once); `-m slow` runs the
whole matrix.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import QUIET, run_module, train_in_process
from helpers import refused

PACKAGE = "planted_code"  # the package in the user's current directory
TOOLS = ("evaluate", "sample", "export", "consolidate")
COMMANDS = (*TOOLS, "resume")
CASES = ("hf_remote_code", "model_package", "data_target", "data_split")
# Each command and each case once by default; the rest of the matrix with -m slow.
DEFAULT = {("evaluate", "data_split"), ("sample", "hf_remote_code"), ("export", "model_package"),
           ("consolidate", "data_target"), ("resume", "hf_remote_code")}

PLANTED = '''
"""Code a checkpoint names; importing it leaves a marker, what hostile code would do worse."""
from pathlib import Path

Path({marker!r}).write_text("the planted code ran")

import torch
from torch import nn
from torch.utils.data import Dataset


class Net(nn.Module):
    """The default run's LinearRegression, under another name (its weights fit)."""

    def __init__(self, in_features: int = 1, out_features: int = 1):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return self.linear(x)


class Line(Dataset):
    """y = 2x + 3 at n points."""

    def __init__(self, n: int = 64):
        self.x = torch.linspace(-1, 1, n).unsqueeze(1)
        self.y = 2 * self.x + 3

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


class LineData:
    """A data component: train and val splits and the model's sizes."""

    def __init__(self, n: int = 64):
        self.train, self.val = Line(n), Line(16)
        self.dims = {{"in_features": 1, "out_features": 1}}
'''

REMOTE_CODE = '''
"""A custom-code model's module, as a Hub repository ships it: from_pretrained with
trust_remote_code imports it."""
from pathlib import Path

Path({marker!r}).write_text("the model directory's code ran")

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel


class PlantedConfig(PretrainedConfig):
    model_type = "ringtrain_planted"


class PlantedModel(PreTrainedModel):
    config_class = PlantedConfig

    def __init__(self, config):
        super().__init__(config)
        self.linear = nn.Linear(1, 1)

    def forward(self, x):
        return self.linear(x)
'''


# --- the checkpoints ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_state(tmp_path_factory) -> dict:
    """The last.pt of a real two-step run of the default job (linear regression)."""
    run_dir = tmp_path_factory.mktemp("real") / "run"
    train_in_process(["trainer.max_steps=2"], run_dir)
    return torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)


class World:
    """A user's machine: the current directory `cwd` holding the planted package, a model
    directory of custom code, and a downloaded checkpoint in a run directory of its own."""

    def __init__(self, root: Path, state: dict):
        self.root, self.state = root, state
        self.marker = root / "the-planted-code-ran"
        self.cwd = root / "work"
        (self.cwd / PACKAGE).mkdir(parents=True)
        (self.cwd / PACKAGE / "__init__.py").write_text(PLANTED.format(marker=str(self.marker)))
        self.model_dir = root / "hub-model"
        self.model_dir.mkdir()
        (self.model_dir / "planted_modeling.py").write_text(REMOTE_CODE.format(marker=str(self.marker)))
        (self.model_dir / "config.json").write_text(json.dumps({
            "model_type": "ringtrain_planted", "architectures": ["PlantedModel"],
            "auto_map": {"AutoConfig": "planted_modeling.PlantedConfig",
                         "AutoModelForCausalLM": "planted_modeling.PlantedModel"},
        }))
        self.run_dir = root / "downloaded"
        self.checkpoint = self.run_dir / "checkpoints" / "last.pt"

    def craft(self, case: str) -> Path:
        """The downloaded checkpoint: the real one with its config changed as `case` says."""
        state = dict(self.state)
        state.pop("architecture", None)  # so the model node is what would be rebuilt
        config = state["config"] = json.loads(json.dumps(state["config"]))  # a deep copy
        if case == "hf_remote_code":
            config["model"] = {"_target_": "transformers.AutoModelForCausalLM.from_pretrained",
                               "pretrained_model_name_or_path": str(self.model_dir), "trust_remote_code": True}
        elif case == "model_package":
            config["model"] = {"_target_": f"{PACKAGE}.Net"}
        elif case == "data_target":
            config["data"] = {"_target_": f"{PACKAGE}.LineData", "n": 64}
        elif case == "data_split":
            config["data"] = {"train": {"_target_": f"{PACKAGE}.Line", "n": 64},
                              "val": {"_target_": f"{PACKAGE}.Line", "n": 16},
                              "dims": {"in_features": 1, "out_features": 1}}
        else:
            raise ValueError(case)
        self.checkpoint.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, self.checkpoint)
        return self.checkpoint

    def files(self) -> dict[str, bytes | None]:
        """Every file (its bytes) and folder (None) of this machine, dot files included."""
        return {str(path.relative_to(self.root)): path.read_bytes() if path.is_file() else None
                for path in sorted(self.root.rglob("*"))}

    def run(self, command: str, *args: str):
        """`python -m ringtrain <tool> checkpoint=<file> ARGS` or, for `resume`, training with
        trainer.resume=<file>, from the user's current directory."""
        if command == "resume":
            return run_module("ringtrain", [f"trainer.resume={self.checkpoint}", *args, *QUIET], cwd=self.cwd)
        return run_module("ringtrain", [command, f"checkpoint={self.checkpoint}", *args], cwd=self.cwd)


@pytest.fixture
def world(tmp_path, real_state, monkeypatch) -> World:
    # Where transformers would copy a model directory's code to before importing it.
    monkeypatch.setenv("HF_MODULES_CACHE", str(tmp_path / "hf-modules"))
    return World(tmp_path, real_state)


def flag(command: str) -> str:
    return "trainer.trust_checkpoint=true" if command == "resume" else "trust_checkpoint=true"


NAMED = {"hf_remote_code": "sets model.trust_remote_code=true, which would run Python from the model's directory",
         "model_package": f"model._target_={PACKAGE}.Net",
         "data_target": f"data._target_={PACKAGE}.LineData",
         "data_split": f"data.train._target_={PACKAGE}.Line"}


# --- 1. refused: nothing runs, one line, nothing written -----------------------------------------


@pytest.mark.parametrize("command, case", [
    pytest.param(command, case, marks=() if (command, case) in DEFAULT else pytest.mark.slow)
    for command in COMMANDS for case in CASES
])
def test_a_checkpoint_whose_config_would_run_code_is_refused_in_one_line(world, command, case):
    world.craft(case)
    before = world.files()
    line = refused(world.run(command), str(world.checkpoint), NAMED[case], flag(command))
    if command != "resume":
        assert "trainer.trust_checkpoint" not in line, line  # the tool's own flag
    assert not world.marker.exists(), f"`{command}` ran the code the checkpoint names"
    assert world.files() == before, "the refused command wrote something"


# --- 2. the flag: a user who trusts the file goes on --------------------------------------------


@pytest.mark.parametrize("command", ["export", "resume", pytest.param("evaluate", marks=pytest.mark.slow)])
def test_the_trust_flag_lets_the_named_code_run(world, command):
    world.craft("model_package")
    args = ["trainer.trust_checkpoint=true", "trainer.max_steps=3"] if command == "resume" else ["trust_checkpoint=true"]
    proc = world.run(command, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert world.marker.read_text() == "the planted code ran"


@pytest.mark.slow
@pytest.mark.parametrize("command, reason", [("sample", "not a language model"),
                                             ("consolidate", "already one plain file")])
def test_the_trust_flag_gets_the_other_tools_past_the_check(world, command, reason):
    """sample and consolidate refuse this checkpoint for what it is (a regression model, a
    plain file) before they build its model: with the flag, that is their only objection."""
    world.craft("model_package")
    line = refused(world.run(command, "trust_checkpoint=true"), reason)
    assert "trust_checkpoint" not in line


# --- 3. the user's own config names the target: trusted without the flag ------------------------


def _user_config(world: World, node: dict) -> str:
    """conf/model/mine.yaml in the user's directory, naming `node`; returns the --config-dir."""
    folder = world.cwd / "conf" / "model"
    folder.mkdir(parents=True)
    lines = "\n".join(f"  {key}: {value}" for key, value in node.items())
    (folder / "mine.yaml").write_text(f"# @package _global_\nmodel:\n{lines}\n")
    return str(world.cwd / "conf")


@pytest.mark.parametrize("command", ["export", pytest.param("resume", marks=pytest.mark.slow)])
def test_a_target_the_users_own_config_dir_names_is_trusted_without_the_flag(world, command):
    world.craft("model_package")
    config_dir = _user_config(world, {"_target_": f"{PACKAGE}.Net"})
    args = ["trainer.max_steps=3"] if command == "resume" else []
    tool = [] if command == "resume" else [command]
    target = (["trainer.resume=" + str(world.checkpoint), *QUIET] if command == "resume"
              else [f"checkpoint={world.checkpoint}"])
    proc = run_module("ringtrain", [*tool, "--config-dir", config_dir, *target, *args], cwd=world.cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert world.marker.exists()


def test_trust_remote_code_is_refused_even_where_the_users_config_names_the_loader(world):
    """The user's config loads Hugging Face models with AutoModelForCausalLM.from_pretrained
    (without remote code): a checkpoint that turns trust_remote_code on is still refused."""
    world.craft("hf_remote_code")
    config_dir = _user_config(world, {"_target_": "transformers.AutoModelForCausalLM.from_pretrained",
                                      "pretrained_model_name_or_path": "gpt2"})
    before = world.files()
    proc = run_module("ringtrain", ["export", "--config-dir", config_dir, f"checkpoint={world.checkpoint}"],
                      cwd=world.cwd)
    refused(proc, "model.trust_remote_code=true", "trust_checkpoint=true")
    assert not world.marker.exists()
    assert world.files() == before


# --- ways around the check, closed -------------------------------------------


@pytest.mark.parametrize("value", [1, pytest.param("True", marks=pytest.mark.slow)])
def test_a_truthy_trust_remote_code_other_than_true_is_refused_too(world, value):
    world.craft("hf_remote_code")
    state = torch.load(world.checkpoint, weights_only=True)
    state["config"]["model"]["trust_remote_code"] = value
    torch.save(state, world.checkpoint)
    config_dir = _user_config(world, {"_target_": "transformers.AutoModelForCausalLM.from_pretrained",
                                      "pretrained_model_name_or_path": "gpt2"})
    proc = run_module("ringtrain", ["export", "--config-dir", config_dir, f"checkpoint={world.checkpoint}"],
                      cwd=world.cwd)
    assert not world.marker.exists(), "the model directory's code ran"
    refused(proc, "trust_remote_code", "trust_checkpoint=true")


def _with_architecture(world: World, base: bool) -> None:
    """The model_package checkpoint that also keeps a transformers architecture (what a run of
    a Hugging Face model keeps), and a frozen base's record when `base` (a run with adapters)."""
    world.craft("model_package")
    state = torch.load(world.checkpoint, weights_only=True)
    state["architecture"] = {"class": "transformers.GPT2LMHeadModel",
                             "config": {"n_layer": 1, "n_embd": 8, "n_head": 2, "vocab_size": 16, "n_positions": 8}}
    if base:
        state["base"] = {}
    torch.save(state, world.checkpoint)


@pytest.mark.parametrize("command, base", [pytest.param("evaluate", False, marks=pytest.mark.slow), ("export", True)])
def test_a_checkpoint_keeping_an_architecture_does_not_let_its_model_node_past_the_check(world, command, base):
    _with_architecture(world, base)
    proc = world.run(command)
    assert not world.marker.exists(), f"`{command}` ran the code the checkpoint's model node names"
    refused(proc, NAMED["model_package"], "trust_checkpoint=true")


@pytest.mark.slow
def test_the_planted_model_directory_really_runs_its_code_under_trust_remote_code(world):
    """The attack is real: transformers itself, told to trust the directory, runs its code
    (so a marker that stays absent above means the check held, not a broken fixture)."""
    script = (f"from transformers import AutoConfig; "
              f"AutoConfig.from_pretrained({str(world.model_dir)!r}, trust_remote_code=True)")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert world.marker.read_text() == "the model directory's code ran"
