"""A checkpoint is data: nothing in a file chooses what code runs.

The attacker controls the whole file (torch.save recomputes the CRC-32s ringtrain checks). A real
checkpoint of a tiny run is edited as each case below says, put in a downloaded run directory,
and every way a user points ringtrain at a checkpoint runs on it, as a user runs it, from a
directory where a planted package (`planted_code`, whose import leaves a marker file) is
importable:

  evaluate, sample, export, consolidate   `python -m ringtrain <tool> checkpoint=<file>`
  resume                                  training with trainer.resume=<file>
  init_from                               a new run with trainer.init_from=<file>
  same_command                            the plain command on the downloaded run directory
                                          (hydra.run.dir=<it>: auto-resume finds the file)

The planted code never runs: the marker is never written, and no file outside the run directory
changes. Each command either works (the plant is inert: the stored config is a record nothing
builds from, an architecture's class is never the file's) or is refused in exactly one `error:`
line, exit 2, leaving the run directory as it was. `-m slow` runs the whole matrix; the default
run takes each case and each command at least once.
"""
from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from conftest import QUIET, run_module, train_in_process
from helpers import refused

from ringtrain.errors import ConfigError

PACKAGE = "planted_code"
COMMANDS = ("evaluate", "sample", "export", "consolidate", "resume", "init_from", "same_command")
# The stored config and architecture are records: planting in them changes nothing that runs.
RECORD_CASES = ("model", "data", "task", "optimizer", "scheduler", "strategy", "callbacks", "logger", "architecture")
# The recipe, replayed through Hydra: each of these is refused before anything is composed.
RECIPE_CASES = {
    "target_override": "model._target_=planted_code.Net",
    "attribute_walk": "optimizer._target_=torch.nn.functional.torch.load",
    "added_node": "+model.head={_target_: planted_code.Net}",
    "callbacks_node": "+callbacks.evil={_target_: planted_code.Net}",  # a tool replays no callbacks: inert there
    "nested_target": "data={_target_: planted_code.LineData}",
    "interpolation": "data.noise_std=${oc.create:x}",
    "remote_code": "model.trust_remote_code=true",
    "weights_only": "+model.weights_only=false",
    "hydra_setting": "hydra.searchpath=[file://planted]",
    "package": "model@callbacks.evil=linear",
}
CHOICE_CASES = {"choice_path": "../../planted", "choice_user_option": "my_net"}
SHARD_CASES = ("shards_absolute", "shards_relative", "dcp_metadata")
CASES = (*(f"config_{name}" for name in RECORD_CASES), *RECIPE_CASES, *CHOICE_CASES, *SHARD_CASES)
# Every case once and every command at least once by default; the rest with -m slow.
# Evaluate on target_override, attribute_walk, hydra_setting and choice_user_option runs by default
# in test_each_kind_of_refusal_says_what_the_file_holds_and_why, with these same checks.
DEFAULT = {("sample", "interpolation"), ("export", "config_model"),
           ("consolidate", "dcp_metadata"), ("resume", "added_node"), ("init_from", "shards_absolute"),
           ("same_command", "config_callbacks"), ("export", "remote_code"),
           ("resume", "choice_path"), ("evaluate", "shards_relative"), ("same_command", "dcp_metadata"),
           ("export", "weights_only"), ("sample", "nested_target"),
           ("evaluate", "package"), ("resume", "config_architecture"),
           ("evaluate", "config_data"), ("resume", "callbacks_node"), ("export", "callbacks_node")}

PLANTED = '''
"""Code a checkpoint names; importing it leaves a marker, what hostile code would do worse."""
from pathlib import Path

Path({marker!r}).write_text("the planted code ran")

from torch import nn


class Net(nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
        self.linear = nn.Linear(1, 1)

    def forward(self, x):
        return self.linear(x)


class LineData:
    pass


def mark(*args, **kwargs):
    return {{}}
'''


class _Planted:
    """Pickles as a call of planted_code.mark: unpickling it imports the planted package."""

    def __reduce__(self):
        import importlib

        return (importlib.import_module, (PACKAGE,))


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    """A real four-step run of the default job (linear regression)."""
    run_dir = tmp_path_factory.mktemp("real") / "run"
    train_in_process(["trainer.max_steps=4"], run_dir)
    return run_dir


class World:
    """A user's machine: the current directory `cwd` holding the planted package, and a
    downloaded run directory holding the crafted checkpoint."""

    def __init__(self, root: Path, real_run: Path):
        self.root = root
        self.marker = root / "the-planted-code-ran"
        self.cwd = root / "work"
        (self.cwd / PACKAGE).mkdir(parents=True)
        (self.cwd / PACKAGE / "__init__.py").write_text(PLANTED.format(marker=str(self.marker)))
        self.run_dir = root / "downloaded"
        shutil.copytree(real_run, self.run_dir)
        self.checkpoint = self.run_dir / "checkpoints" / "last.pt"

    def craft(self, case: str) -> Path:
        """The downloaded run's last.pt (and the step file it links) changed as `case` says."""
        state = torch.load(self.checkpoint, weights_only=True)
        job, config = state["job"], state["config"]
        if case.startswith("config_") and case != "config_architecture":
            section = case.removeprefix("config_")
            node = {"_target_": f"{PACKAGE}.Net", "trust_remote_code": True}
            config[section] = {"evil": node} if section in ("callbacks", "logger") else node
        elif case == "config_architecture":
            state["architecture"] = {"class": f"{PACKAGE}.Net", "config": {"model_type": "gpt2"}}
        elif case in RECIPE_CASES:
            job["overrides"].append(RECIPE_CASES[case])
        elif case in CHOICE_CASES:
            job["choices"]["model"] = CHOICE_CASES[case]
        elif case in SHARD_CASES:
            shards = self._planted_shards(case, state["progress"]["step"])
            state = {k: v for k, v in state.items() if k not in ("model", "optimizer")}
            state["shards"] = shards
        else:
            raise ValueError(case)
        for path in (self.checkpoint, *self.checkpoint.parent.glob("step-*.pt")):
            path.unlink()
            torch.save(state, path)
        return self.checkpoint

    def _planted_shards(self, case: str, step: int) -> str:
        """A DCP directory whose index (.metadata) unpickles the planted package."""
        name = f"step-{step:08d}.shards"
        folder = {"shards_absolute": self.root / "elsewhere" / name, "shards_relative": self.root / "up" / name,
                  "dcp_metadata": self.checkpoint.parent / name}[case]
        folder.mkdir(parents=True)
        (folder / ".metadata").write_bytes(pickle.dumps(_Planted()))
        return {"shards_absolute": str(folder), "shards_relative": f"../../up/{name}", "dcp_metadata": name}[case]

    def files(self, under: Path) -> dict[str, bytes | None]:
        """Every file (its bytes) and folder (None) under `under`, dot files included."""
        return {str(path.relative_to(self.root)): path.read_bytes() if path.is_file() else None
                for path in sorted(under.rglob("*"))}

    def outside_the_run(self) -> dict[str, bytes | None]:
        return {k: v for k, v in self.files(self.root).items() if not k.startswith("downloaded")}

    def run(self, command: str, *args: str):
        """The command as a user types it, from the user's current directory."""
        if command == "resume":
            args = (f"trainer.resume={self.checkpoint}", *args, *QUIET)
        elif command == "init_from":
            args = (f"trainer.init_from={self.checkpoint}", f"hydra.run.dir={self.root / 'work' / 'new'}", *args, *QUIET)
        elif command == "same_command":
            args = ("trainer.max_steps=4", f"hydra.run.dir={self.run_dir}", *args, *QUIET)
        else:
            args = (command, f"checkpoint={self.checkpoint}", f"output={self.root / 'work' / 'out'}", *args)
        return run_module("ringtrain", list(args), cwd=self.cwd)


@pytest.fixture
def world(tmp_path, real_run) -> World:
    return World(tmp_path, real_run)


@pytest.mark.parametrize("command, case", [
    pytest.param(command, case, marks=() if (command, case) in DEFAULT else pytest.mark.slow)
    for command in COMMANDS for case in CASES
])
def test_no_crafted_checkpoint_runs_code(world, command, case):
    run_crafted(world, command, case)


def run_crafted(world: World, command: str, case: str):
    """`command` on the checkpoint crafted as `case`: the planted code never runs, nothing outside
    the run directory changes, and a refusal is one line leaving the run directory as it was."""
    world.craft(case)
    run_before, outside_before = world.files(world.run_dir), world.outside_the_run()
    proc = world.run(command)
    assert not world.marker.exists(), f"{command} ran the planted code of {case}:\n{proc.stderr[-2000:]}"
    outside_after = world.outside_the_run()
    new = {k: v for k, v in outside_after.items() if k.startswith("work/out") or k.startswith("work/new")}
    assert {k: v for k, v in outside_after.items() if k not in new} == outside_before
    replays = command not in ("init_from", "same_command")  # those two compose from the command line alone
    inert_here = case.startswith("config_") or not replays or case == "callbacks_node" and command != "resume"
    if case in SHARD_CASES or not inert_here:
        refused(proc)
        assert world.files(world.run_dir) == run_before and not new
    elif case.startswith("config_") and command in ("evaluate", "export"):  # a record: the tool works
        assert proc.returncode == 0, proc.stderr[-2000:]
    elif proc.returncode != 0:  # what the command refuses anyway (sample: not a language model)
        refused(proc)
    return proc


@pytest.mark.parametrize("case, phrase", [
    ("target_override", "sets an instantiation key, which chooses code"),
    ("attribute_walk", "sets an instantiation key"),
    ("added_node", "adds a key to the config"),
    ("interpolation", "holds an interpolation ${...}"),
    ("remote_code", "sets trust_remote_code, which turns on code loading"),
    ("hydra_setting", "is not a setting of the job"),
    ("choice_path", "is not a choice of one of ringtrain's config groups"),
    ("choice_user_option", "was trained with model=my_net, which neither ringtrain's configs nor yours here have; "
                           "pass --config-dir"),
    ("shards_absolute", "not a step-<N>.shards directory beside it"),
    ("dcp_metadata", "cannot be read as data"),
])
def test_each_kind_of_refusal_says_what_the_file_holds_and_why(world, case, phrase):
    line = refused(run_crafted(world, "evaluate", case), phrase)
    assert "trust_checkpoint=true" in line if case == "dcp_metadata" else True
    assert not world.marker.exists()


def test_the_planted_code_really_runs_where_a_file_is_trusted(world):
    """The controls: the package leaves its marker when imported, and DCP's own reader (what
    trust_checkpoint=true asks for) unpickles the crafted index, running it."""
    world.craft("dcp_metadata")
    proc = world.run("evaluate", "trust_checkpoint=true")
    assert world.marker.exists(), proc.stderr[-2000:]


def test_a_stored_choice_of_the_users_own_option_composes_with_their_config_dir(world, tmp_path):
    """The recipe names options, so a user's own model rebuilds from their own --config-dir."""
    conf = tmp_path / "my_conf" / "model"
    conf.mkdir(parents=True)
    (conf / "my_net.yaml").write_text("_target_: ringtrain.models.linear.LinearRegression\n")
    world.craft("choice_user_option")
    proc = run_module("ringtrain", ["evaluate", "--config-dir", str(tmp_path / "my_conf"),
                                    f"checkpoint={world.checkpoint}", f"output={tmp_path / 'm.json'}"], cwd=world.cwd)
    assert proc.returncode == 0, proc.stderr[-2000:]
    logged = json.loads((world.run_dir / "metrics.json").read_text())["final"]["val/loss"]
    assert json.loads((tmp_path / "m.json").read_text())["metrics"]["val/loss"] == pytest.approx(logged, rel=1e-5)


def test_a_checkpoint_of_the_previous_format_is_refused_then_rewritten_by_the_command_it_names(tmp_path):
    """A format-2 file (its config kept as nodes) is refused by every tool in one line naming
    `ringtrain upgrade`; upgrade asks for trust_checkpoint=true, reads the run's own record
    (.hydra/hydra.yaml) and rewrites the file in place, the old bytes kept beside it."""
    run_dir = tmp_path / "run"
    assert run_module("ringtrain", ["trainer.max_steps=4", f"hydra.run.dir={run_dir}", *QUIET], cwd=tmp_path).returncode == 0
    checkpoint = run_dir / "checkpoints" / "last.pt"
    state = torch.load(checkpoint, weights_only=True)
    old = {k: v for k, v in state.items() if k != "job"} | {"format": 2}
    checkpoint.unlink()
    torch.save(old, checkpoint)
    evaluate = ["evaluate", f"checkpoint={checkpoint}", f"output={tmp_path / 'm.json'}"]
    refused(run_module("ringtrain", evaluate, cwd=tmp_path), "was written by an older ringtrain", "ringtrain upgrade",
            "trust_checkpoint=true")
    refused(run_module("ringtrain", ["upgrade", f"checkpoint={checkpoint}"], cwd=tmp_path), "trust_checkpoint=true")
    assert run_module("ringtrain", ["upgrade", f"checkpoint={checkpoint}", "trust_checkpoint=true"],
                      cwd=tmp_path).returncode == 0
    upgraded = torch.load(checkpoint, weights_only=True)
    assert upgraded["format"] == 3 and upgraded["job"] == state["job"]
    assert torch.load(checkpoint.with_name("last.pt.format2"), weights_only=True)["format"] == 2
    assert run_module("ringtrain", evaluate, cwd=tmp_path).returncode == 0


@pytest.mark.parametrize("held, said", [([1, 2], "a list"), ({"format": 3}, "format 3")])
def test_upgrade_refuses_a_file_that_is_not_of_the_previous_format_in_one_line(tmp_path, held, said):
    from ringtrain.tools.upgrade import upgrade

    (tmp_path / "run" / ".hydra").mkdir(parents=True)
    (tmp_path / "run" / ".hydra" / "hydra.yaml").write_text("hydra: {}\n")
    (tmp_path / "run" / "checkpoints").mkdir()
    torch.save(held, tmp_path / "run" / "checkpoints" / "last.pt")
    with pytest.raises(ConfigError, match=f"is not of format 2 \\(it holds {said}\\): nothing to upgrade"):
        upgrade(str(tmp_path / "run" / "checkpoints" / "last.pt"), trust_checkpoint=True)
