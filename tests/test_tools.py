"""One command grammar for every tool: evaluate, sample, consolidate and prepare_tokens are
Hydra apps, each with its own conf/<tool>.yaml, run as a user runs them (real subprocesses).
`--help` lists the tool's settings, `--cfg job` prints its config, a mistake is one line and
exit 2, and nothing of Hydra's (outputs/, .hydra/, a log file) lands in the current directory."""
from __future__ import annotations

import re

import pytest
import yaml
from omegaconf import OmegaConf

from conftest import CONF_DIR, run_module
from helpers import refused

TOOLS = ("evaluate", "sample", "consolidate", "export", "prepare_tokens")


def _settings(tool: str) -> list[str]:
    return [key for key in OmegaConf.load(CONF_DIR / f"{tool}.yaml") if key not in ("defaults", "hydra")]


@pytest.mark.parametrize("tool", [tool if tool == "evaluate" else pytest.param(tool, marks=pytest.mark.slow) for tool in TOOLS])
def test_help_lists_every_setting_and_cfg_job_prints_the_config(tool, tmp_path):
    shown = run_module("ringtrain", [tool, "--help"], cwd=tmp_path)  # the dispatcher: python -m ringtrain <tool>
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.startswith(f"ringtrain {tool}: ")
    listed = shown.stdout.split("\nSettings", 1)[1]
    for name in _settings(tool):
        assert re.search(rf"^  .*\b{name}\b", listed, re.MULTILINE), name
    printed = run_module(tool, ["--cfg", "job"], cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr[-2000:]
    assert set(_settings(tool)) <= set(yaml.safe_load(printed.stdout))
    assert not list(tmp_path.iterdir())


def test_a_missing_required_setting_is_one_line_naming_the_command(tmp_path):
    proc = run_module("evaluate", ["split=train"], cwd=tmp_path)
    assert refused(proc) == "error: checkpoint is required: ringtrain evaluate checkpoint=<run>/checkpoints/last.pt"
    assert not list(tmp_path.iterdir())


def test_a_multirun_keeps_multirun_yaml_out_of_the_current_directory(tmp_path):
    """prepare_tokens -m: one job per value; Hydra's multirun.yaml goes to hydra.sweep.dir when
    given, else to a scratch directory that is gone at exit."""
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20, encoding="utf-8")
    (tmp_path / "cwd").mkdir()
    args = ["-m", f"input={tmp_path / 'text.txt'}", f"output={tmp_path / 'tokens'}", "vocab=char,byte"]
    proc = run_module("prepare_tokens", args, cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [line.split(":")[0] for line in proc.stdout.splitlines()] == [f"wrote {tmp_path / 'tokens'}"] * 2
    assert "vocab_size 256" in proc.stdout.splitlines()[1]  # the second job's byte vocabulary
    # The second job replaces the first's files, and says so.
    assert [line for line in proc.stderr.splitlines() if line.startswith("notice:")] == [
        f"notice: {tmp_path / 'tokens'} already holds train.bin, val.bin, meta.json: replacing them with the new tokens"]
    assert not list((tmp_path / "cwd").iterdir())
    proc = run_module("prepare_tokens", args + [f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path / "cwd")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir()) == ["multirun.yaml"]
    assert not list((tmp_path / "cwd").iterdir())


def test_ringtrain_help_is_ringtrains_and_names_every_other_command(tmp_path):
    shown = run_module("ringtrain", ["--help"], cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.startswith("ringtrain: train a model") and "powered by Hydra" not in shown.stdout
    commands = shown.stdout.split("== Other commands ==", 1)[1]
    for tool in TOOLS:
        assert re.search(rf"^  ringtrain {tool} \w+=", commands, re.MULTILINE), tool


@pytest.mark.parametrize("typed,meant", [("exprt", "export"), ("evalute", "evaluate"), ("prepare-token", "prepare_tokens")])
def test_a_mistyped_command_is_one_line_naming_the_command_meant(typed, meant, tmp_path):
    proc = run_module("ringtrain", [typed, "checkpoint=x"], cwd=tmp_path)
    assert refused(proc) == (f"error: {typed} is not a ringtrain command; did you mean {meant}? "
                             f"(commands: train, evaluate, sample, consolidate, export, prepare_tokens, upgrade)")
    assert not list(tmp_path.iterdir())


def test_a_config_groups_name_alone_is_left_to_hydras_override_message(tmp_path):
    """`ringtrain trainer` is close to train, but it is the trainer group missing its =option."""
    assert "cannot read the override 'trainer' (missing EQUAL" in refused(run_module("ringtrain", ["trainer"], cwd=tmp_path))


def test_prepare_tokens_names_an_earlier_tokenizer_it_leaves_stale(tmp_path, capsys):
    from ringtrain.tools.prepare_tokens import prepare_tokens

    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20, encoding="utf-8")
    common = {"input": str(tmp_path / "text.txt"), "output": str(tmp_path / "tokens")}
    prepare_tokens(vocab="bpe", vocab_size=270, **common)
    assert capsys.readouterr().err == ""  # a new folder: nothing replaced
    prepare_tokens(vocab="char", **common)
    assert capsys.readouterr().err == (f"notice: {tmp_path / 'tokens'} already holds train.bin, val.bin, meta.json: "
                                       f"replacing them with the new tokens (tokenizer.json there is the earlier "
                                       f"tokenizer's, not these tokens')\n")
