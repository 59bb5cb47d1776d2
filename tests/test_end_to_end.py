"""The product's headline runs at full size, as users type them. Minutes each: `pytest -m slow`."""
from __future__ import annotations

import json
import math

import pytest

from conftest import SHAKESPEARE, run_cli
from helpers import TORCHRUN, ok

pytestmark = pytest.mark.slow


def _metrics(run_dir):
    return json.loads((run_dir / "metrics.json").read_text())["final"]


def test_default_mlp_job_beats_90_percent(tmp_path):
    ok(run_cli(["model=mlp", f"hydra.run.dir={tmp_path}"], timeout=600))
    assert _metrics(tmp_path)["val/acc"] > 0.9


def test_default_transformer_job_ends_far_below_uniform_guessing(tmp_path):
    ok(run_cli(["model=transformer", f"hydra.run.dir={tmp_path}"], timeout=900))
    assert _metrics(tmp_path)["val/loss"] < math.log(64) - 2  # uniform: 4.16; the chain's floor: log 4 = 1.39


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason=f"{SHAKESPEARE} is not here")
def test_shakespeare_character_model_gets_below_2(tmp_path):
    ok(run_cli(["experiment=shakespeare_char", f"data.path={SHAKESPEARE}", f"data.cache_dir={tmp_path / 'cache'}",
                f"hydra.run.dir={tmp_path / 'run'}"], timeout=1800))
    assert _metrics(tmp_path / "run")["val/loss"] < 2.0


def test_ddp_transformer_under_torchrun_and_self_launched_agree(tmp_path):
    common = ["strategy=ddp", "model=transformer", "trainer.max_epochs=2"]
    ok(run_cli(common + [f"hydra.run.dir={tmp_path / 'torchrun'}"], launcher=TORCHRUN, timeout=900))
    ok(run_cli(common + ["strategy.nproc_per_node=2", f"hydra.run.dir={tmp_path / 'spawned'}"], timeout=900))
    torchrun, spawned = _metrics(tmp_path / "torchrun"), _metrics(tmp_path / "spawned")
    assert torchrun["val/loss"] == pytest.approx(spawned["val/loss"], rel=1e-6)
    assert torchrun["val/loss"] < math.log(64) - 1


def test_torchrun_default_job_learns_the_line(tmp_path):
    proc = ok(run_cli(["strategy=ddp", f"hydra.run.dir={tmp_path}"], launcher=TORCHRUN, timeout=600))
    line = next(line for line in (proc.stdout + proc.stderr).splitlines() if "learned w=" in line)
    w, b = (float(part.split("=")[1]) for part in line.split("learned ")[1].split())
    assert abs(w - 2) < 0.02 and abs(b - 3) < 0.02
