"""A strategy must match how the ranks were started: torchrun's ranks with a one-process strategy
(single, dp) would each train alone as a job of its own (rank 1 writing into the current
folder), and a strategy.nproc_per_node other than torchrun's would be ignored. Both are refused
before any work, in one line for the job. And ringtrain warns when it starts more CPU ranks
itself than there are cores."""
from __future__ import annotations

import logging
import os
import re
import subprocess
import textwrap

import pytest
import torch

from conftest import REPO, compose_config, run_cli, train_in_process
from helpers import TORCHRUN
from ringtrain.config.schema import strategy_option, trainer_config
from ringtrain.errors import ConfigError


def error_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("error:")]


def rank_statuses(output: str) -> list[int]:
    """Each failed rank's exit status, from torchrun's failure report."""
    return sorted(int(s) for s in re.findall(r"^\s+exitcode\s+:\s*(-?\d+)", output, re.MULTILINE))


@pytest.fixture
def torchrun_env(monkeypatch):
    """What torchrun sets for rank 0 of a 2-rank job on one node (no process group is joined)."""
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():
        monkeypatch.setenv(key, value)


# --- under torchrun: real 2-rank jobs, refused before any work ------------------------------------


@pytest.mark.parametrize("args,expected", [
    (["strategy=single"],
     "error: torchrun started 2 ranks, but strategy=single trains in one process; "
     "add strategy=ddp (or strategy=fsdp), or run without torchrun"),
    # The Python API test below holds all three refusals on the same check; two run under -m slow.
    pytest.param(["strategy=dp"],
                 "error: torchrun started 2 ranks, but strategy=dp trains in one process; "
                 "add strategy=ddp (or strategy=fsdp), or run without torchrun", marks=pytest.mark.slow),
    pytest.param(["strategy=ddp", "strategy.nproc_per_node=4"],
                 "error: strategy.nproc_per_node=4 asks for 4 ranks on this machine, but torchrun started 2 here; "
                 "under torchrun its --nproc_per_node decides: drop strategy.nproc_per_node, or run torchrun "
                 "--nproc_per_node=4", marks=pytest.mark.slow),
], ids=["single", "dp", "ddp-nproc-4"])
def test_a_strategy_that_does_not_match_torchruns_ranks_is_refused_once_and_writes_nothing(tmp_path, args, expected):
    # Run where a user would: the default run directory (outputs/) and the current folder, where
    # rank 1 of a one-process strategy used to write checkpoints/, metrics.json and .lock.
    (tmp_path / "notes.txt").write_text("the user's own file\n")
    proc = run_cli([*args, "trainer.max_steps=2"], cwd=tmp_path, launcher=TORCHRUN, timeout=120)
    output = proc.stdout + proc.stderr
    assert error_lines(output) == [expected], output[-4000:]
    # Both ranks exit 2 (the second silently, or stopped first by torchrun's SIGTERM); torchrun 1.
    statuses = rank_statuses(output)
    assert proc.returncode == 1 and len(statuses) == 2 and 2 in statuses and set(statuses) <= {2, -15}, output[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


@pytest.mark.slow
def test_the_python_api_under_torchrun_refuses_a_strategy_that_does_not_match(tmp_path):
    script = tmp_path / "api_under_torchrun.py"
    script.write_text(textwrap.dedent("""
        import os
        from ringtrain import Trainer
        from ringtrain.errors import ConfigError

        def say(line):  # one write per line: the two ranks share the pipe, and print() may write twice
            os.write(1, (line + "\\n").encode())

        for strategy in ("single", "dp", {"name": "ddp", "nproc_per_node": 4}, {"name": "ddp", "nproc_per_node": 2}):
            try:
                Trainer("run", strategy=strategy)
            except ConfigError as err:
                say(f"rank {os.environ['RANK']} refused: {err}")
            else:
                say(f"rank {os.environ['RANK']} accepted {strategy}")
    """))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([*TORCHRUN, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        lines = [line for line in proc.stdout.splitlines() if line.startswith(f"rank {rank} ")]
        assert lines == [
            f"rank {rank} refused: torchrun started 2 ranks, but strategy=single trains in one process; "
            "add strategy=ddp (or strategy=fsdp), or run without torchrun",
            f"rank {rank} refused: torchrun started 2 ranks, but strategy=dp trains in one process; "
            "add strategy=ddp (or strategy=fsdp), or run without torchrun",
            f"rank {rank} refused: strategy.nproc_per_node=4 asks for 4 ranks on this machine, but torchrun started "
            "2 here; under torchrun its --nproc_per_node decides: drop strategy.nproc_per_node, or run torchrun "
            "--nproc_per_node=4",
            f"rank {rank} accepted {{'name': 'ddp', 'nproc_per_node': 2}}",
        ], proc.stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == [script.name]


# --- the same checks in process (the launcher's variables set by hand) -----------------------------


@pytest.mark.parametrize("nproc_per_node", [1, 2])
def test_nproc_per_node_of_one_or_torchruns_own_number_is_accepted(torchrun_env, nproc_per_node):
    strategy_option("ddp", nproc_per_node=nproc_per_node).check(trainer_config())
    strategy_option("fsdp", nproc_per_node=nproc_per_node).check(trainer_config())


def test_one_rank_of_torchrun_keeps_one_process_strategies(monkeypatch):
    # torchrun --nproc_per_node=1 (WORLD_SIZE=1): its one rank is the whole job.
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    strategy_option("single").check(trainer_config())
    strategy_option("dp").check(trainer_config())
    with pytest.raises(ConfigError, match="strategy.nproc_per_node=2 asks for 2 ranks on this machine, but torchrun started 1"):
        strategy_option("ddp", nproc_per_node=2).check(trainer_config())


def test_a_self_launched_run_continues_under_torchrun_on_torchruns_ranks(tmp_path, monkeypatch):
    """A checkpoint of `ringtrain strategy=ddp strategy.nproc_per_node=3` records that 3; continued
    under torchrun, torchrun's ranks decide, unless the command line types another number."""
    from ringtrain.config import CommandLine
    from ringtrain.config.schema import validate
    from ringtrain.tools.train import prepare

    train_in_process(["trainer.max_steps=1", "data.num_samples=16", "data.num_val_samples=8", "strategy=ddp",
                      "strategy.nproc_per_node=1"], tmp_path)
    path = tmp_path / "checkpoints" / "last.pt"
    state = torch.load(path, weights_only=True)
    state["job"]["overrides"] = [o.replace("strategy.nproc_per_node=1", "strategy.nproc_per_node=3")
                                 for o in state["job"]["overrides"]]
    torch.save(state, path)
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="2", LOCAL_WORLD_SIZE="2").items():  # torchrun's
        monkeypatch.setenv(key, value)

    def replayed(typed: list[str]) -> list[str]:  # as the entry hands them to Hydra
        return prepare(CommandLine("ringtrain", typed))[0].hydra_args()

    assert "strategy.nproc_per_node=3" not in replayed([f"trainer.resume={path}"])
    assert "strategy=ddp" in replayed([f"trainer.resume={path}"])
    typed = replayed([f"trainer.resume={path}", "strategy.nproc_per_node=3"])
    assert typed.count("strategy.nproc_per_node=3") == 1 and typed[-1] == "strategy.nproc_per_node=3"
    with pytest.raises(ConfigError, match="strategy.nproc_per_node=3 asks for 3 ranks on this machine, but torchrun started 2"):
        validate(compose_config(["strategy=ddp", "strategy.nproc_per_node=3"]))


# --- ringtrain's own ranks on CPU: a warning when they outnumber the cores --------------------------


class _Launched(Exception):
    """Raised by the stand-in for launch_ranks: the ranks would start here."""


@pytest.fixture
def two_cores(monkeypatch):
    """A machine whose affinity mask allows 2 cores; launching ranks raises _Launched instead."""
    from ringtrain.strategies import launch

    def launch_ranks(nprocs, *args, **kwargs):
        raise _Launched(nprocs)

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(launch, "launch_ranks", launch_ranks)


def _launch(caplog, nprocs: int, accelerator: str) -> list[str]:
    """The warnings of launching `nprocs` ddp ranks on `accelerator`."""
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ringtrain"), pytest.raises(_Launched):
        strategy_option("ddp", nproc_per_node=nprocs).launch(print, accelerator=accelerator)
    return [record.getMessage() for record in caplog.records if record.levelno == logging.WARNING]


def test_more_cpu_ranks_than_cores_is_one_warning(two_cores, caplog, monkeypatch):
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert _launch(caplog, 64, "cpu") == [
        "strategy.nproc_per_node=64 starts 64 CPU ranks on 2 cores: each rank gets a fraction of a core and the job "
        "runs slower than with fewer ranks; use strategy.nproc_per_node=2 or fewer"
    ]
    assert _launch(caplog, 2, "cpu") == []  # as many ranks as cores
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert len(_launch(caplog, 3, "auto")) == 1  # auto without a GPU is the CPU
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _launch(caplog, 3, "auto") == []  # one GPU per rank: the cores are not what is shared


def test_no_core_warning_under_torchrun(two_cores, torchrun_env, caplog):
    # Under torchrun ringtrain starts no ranks (torchrun's --nproc_per_node is torchrun's business).
    caplog.set_level(logging.WARNING, logger="ringtrain")
    assert strategy_option("ddp").launch(lambda: "ran here", accelerator="cpu") == "ran here"
    assert not caplog.records
