"""What a run tells its user and its scripts: strict JSON for a diverged run, the sweep's
reading of it, a skipped update said once, a warmup longer than the run, where the profiler's
trace went. Each run is the default (linear) job trained in this process for a few steps."""
from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from conftest import train_in_process
from ringtrain.config.sweep import format_summary, summarize_sweep

DIVERGING = ["optimizer.lr=1e6", "trainer.max_steps=20"]  # the linear model's loss is inf, then NaN, in a few steps


def _strict_json(path: Path):
    """The file as a JSON parser that follows the standard reads it (no NaN, Infinity)."""
    def refuse(constant: str):
        raise AssertionError(f"{path} holds {constant}, which is not JSON")

    return json.loads(path.read_text(), parse_constant=refuse)


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def text(self, level: int = logging.INFO) -> str:
        return "\n".join(r.getMessage() for r in self.records if r.levelno >= level)


def _train_logged(overrides: list[str], run_dir: Path):
    """(FitResult, the ringtrain log lines of the run)."""
    lines, logger = _Lines(), logging.getLogger("ringtrain")
    logger.addHandler(lines)
    try:
        return train_in_process(overrides, run_dir), lines
    finally:
        logger.removeHandler(lines)


@pytest.fixture(scope="module")
def sweep_dir(tmp_path_factory) -> Path:
    """A sweep's directory as its jobs leave it: two diverged (on_nonfinite=stop, ignore), one fine."""
    sweep = tmp_path_factory.mktemp("sweep")
    train_in_process(DIVERGING + ["trainer.on_nonfinite=stop"], sweep / "0_stop")
    train_in_process(DIVERGING + ["trainer.on_nonfinite=ignore"], sweep / "1_ignore")
    train_in_process(["optimizer.lr=0.05", "trainer.max_steps=20"], sweep / "2_fine")
    return sweep


@pytest.mark.parametrize("job", ["0_stop", "1_ignore"])
def test_a_diverged_run_writes_strict_json_with_null_for_its_metric(sweep_dir, job):
    metrics = _strict_json(sweep_dir / job / "metrics.json")
    assert metrics["final"] == {"val/loss": None} and metrics["nonfinite"] == ["val/loss"]
    assert metrics["stopped"] == ("non-finite" if job == "0_stop" else None)
    fine = _strict_json(sweep_dir / "2_fine" / "metrics.json")
    assert fine["final"]["val/loss"] < 1.0 and fine["nonfinite"] == []


def test_the_sweep_lists_a_diverged_job_as_diverged_and_never_best(sweep_dir, tmp_path):
    # A job of a sweep written before metrics.json was strict JSON (NaN) reads the same way.
    old = tmp_path / "3_old"
    old.mkdir()
    record = json.loads((sweep_dir / "2_fine" / "metrics.json").read_text())
    (old / "metrics.json").write_text(json.dumps({**record, "final": {"val/loss": float("nan")}}))
    for job in ("0_stop", "1_ignore", "2_fine"):
        (tmp_path / job).symlink_to(sweep_dir / job)

    summary = summarize_sweep(tmp_path, record_subdir=None)
    jobs = {job["dir"]: job for job in summary["jobs"]}
    assert [(jobs[d]["value"], jobs[d]["diverged"]) for d in ("0_stop", "1_ignore", "3_old")] == [(None, True)] * 3
    assert summary["best"]["val/loss"]["dir"] == "2_fine" and jobs["2_fine"]["diverged"] is False
    lines = format_summary(summary)
    assert sum(line.startswith("  val/loss=diverged") for line in lines) == 3
    assert lines[1].startswith("best val/loss ") and lines[1].endswith("job 2_fine")


def test_skipped_updates_are_said_once_and_counted_on_the_done_line(tmp_path):
    result, lines = _train_logged(["optimizer.lr=1e6", "trainer.max_steps=10", "trainer.on_nonfinite=skip"], tmp_path)
    assert result.skipped_steps > 1
    warnings = lines.text(logging.WARNING).splitlines()
    assert len(warnings) == 1, warnings
    assert "update skipped, non-finite " in warnings[0] and "(trainer.on_nonfinite=skip)" in warnings[0]
    assert warnings[0].startswith(f"step {10 - result.skipped_steps + 1}: ")  # once it diverged, every step skips
    done = next(line for line in lines.text().splitlines() if line.startswith("done: "))
    assert f", {result.skipped_steps} updates skipped (non-finite)" in done


def test_a_run_without_skips_or_a_long_warmup_says_neither(tmp_path):
    result, lines = _train_logged(["trainer.max_steps=3"], tmp_path)
    assert result.skipped_steps == 0
    assert not lines.text(logging.WARNING) and "skipped" not in lines.text()


def test_a_warmup_longer_than_the_run_is_a_warning_at_the_start(tmp_path):
    result, lines = _train_logged(["scheduler=cosine", "trainer.max_steps=3"], tmp_path)
    assert result.steps == 3
    assert lines.text(logging.WARNING) == (
        "scheduler.warmup_steps=100 is not below the run's 3 steps: the learning rate is still warming up when "
        "training ends; lower scheduler.warmup_steps"
    )


def test_debug_profiler_says_where_its_trace_is(tmp_path):
    result, lines = _train_logged(["debug=profiler"], tmp_path)
    assert result.steps == 10
    (trace,) = (tmp_path / "profiler").glob("rank0.*.pt.trace.json")
    said = [line for line in lines.text().splitlines() if line.startswith("profiler trace")]
    assert said == [f"profiler trace of 5 steps: {trace}; open it with TensorBoard's PyTorch Profiler plugin "
                    f"(pip install torch-tb-profiler; tensorboard --logdir {tmp_path}) or on https://ui.perfetto.dev"]
    assert json.loads(trace.read_text())["traceEvents"]
