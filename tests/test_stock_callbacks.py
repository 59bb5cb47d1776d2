"""The callback API and the stock callbacks as a user meets them, on CPU: a user's own callback
from a package of theirs, early stopping, the best-k checkpoints, validation at fractions of an
epoch, and the one-line refusals of a wrong monitor or a misspelt hook.

Every expectation is computed here, by hand, from what the run itself logged (metrics.csv of
logger=csv: every validation at full precision) or from the data's size, never taken from the
code under test. Jobs that are interrupted run tests/interruptible_train.py (train.py with each
optimizer step announced per rank); the test waits for an announcement and the run's own
"received SIGTERM" notice, never for a time.
"""
from __future__ import annotations

import csv
import json
import math
import os
import re
import signal
import sys
from pathlib import Path

import pytest
import torch

from conftest import QUIET, REPO, run_cli, run_module, train_in_process
from helpers import STEP_ANNOUNCEMENT, TORCHRUN, Job, assert_same_state, job_ok, ok, refused, user_package
from ringtrain.callbacks import Callback

WRAPPER = REPO / "tests" / "interruptible_train.py"

# --- the user's package and config folder -----------------------------------------------------

COUNTER = '''
"""A user's own callback: how often each hook ran on this rank, kept in every checkpoint."""
import json

from ringtrain.callbacks import Callback

COUNTED = ("on_step_start", "on_step_end", "on_validation_start", "on_validation_end")


class Counter(Callback):
    def __init__(self, record: str = "counter"):
        self.counts = dict.fromkeys(COUNTED, 0)
        self.record = record

    def on_step_start(self, run, step):
        self.counts["on_step_start"] += 1

    def on_step_end(self, run, step):
        self.counts["on_step_end"] += 1

    def on_validation_start(self, run):
        self.counts["on_validation_start"] += 1

    def on_validation_end(self, run, metrics):
        self.counts["on_validation_end"] += 1

    # Each session of the run appends what this rank's counter holds as it starts (after a
    # resume: what the checkpoint gave back) and as it ends, to <run dir>/<record>-rank<R>.jsonl.
    def on_fit_start(self, run):
        self._record(run, "start")

    def on_fit_end(self, run, result):
        self._record(run, "end")

    def _record(self, run, event):
        line = json.dumps({"event": event, "step": run.step, "counts": self.counts})
        with open(run.run_dir / f"{self.record}-rank{run.dist.rank}.jsonl", "a") as file:
            file.write(line + "\\n")

    def state_dict(self):
        return {"counts": dict(self.counts)}

    def load_state_dict(self, state):
        self.counts = dict(state["counts"])
'''

LATE = '''
"""A callback whose hook is misspelt: on_validation_ended is not a hook ringtrain calls."""
from ringtrain.callbacks import Callback


class Late(Callback):
    def on_validation_ended(self, run, metrics):
        raise AssertionError("never called")
'''

PROBE = '''
"""A user's callback with state of its own and an entry it adds to every checkpoint; a resumed
run's on_load_checkpoint writes down what it saw to <run dir>/probe-loaded.json."""
import json

from ringtrain.callbacks import Callback


class Probe(Callback):
    def __init__(self):
        self.validations = []  # [step, val/loss] of each validation

    def on_validation_end(self, run, metrics):
        self.validations.append([run.step, metrics["val/loss"]])

    def state_dict(self):
        return {"validations": [list(item) for item in self.validations]}

    def load_state_dict(self, state):
        self.validations = [list(item) for item in state["validations"]]

    def on_save_checkpoint(self, run, checkpoint):
        checkpoint["probe"] = {"step": run.step}

    def on_load_checkpoint(self, run, checkpoint):
        seen = {"added": checkpoint["probe"], "saved": checkpoint["callbacks"]["probe"], "mine": self.state_dict(),
                "step": run.step}
        (run.run_dir / "probe-loaded.json").write_text(json.dumps(seen))
'''

COUNTER_YAML = '''
# The user's callback: callbacks=[default,counter]
counter:
  _target_: my_callbacks.counter.Counter
'''

LATE_YAML = '''
late:
  _target_: my_callbacks.late.Late
'''

PROBE_YAML = '''
probe:
  _target_: my_callbacks.probe.Probe
'''


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """A directory outside the repository with the user's package (my_callbacks/) and config
    folder (my_conf/callbacks/); the test process imports my_callbacks too (in-process runs)."""
    root = tmp_path_factory.mktemp("user")
    files = {"my_callbacks/__init__.py": "", "my_callbacks/counter.py": COUNTER, "my_callbacks/late.py": LATE,
             "my_callbacks/probe.py": PROBE, "my_conf/callbacks/counter.yaml": COUNTER_YAML,
             "my_conf/callbacks/late.yaml": LATE_YAML, "my_conf/callbacks/probe.yaml": PROBE_YAML}
    with user_package(root, files, "my_callbacks"):
        yield root


# --- jobs ---------------------------------------------------------------------------------------


def training_job(args: list[str], launcher: list[str] | None = None, cwd: Path | None = None,
                 step_seconds: float = 0.0, hold_at_step: int = 0, release: Path | None = None) -> Job:
    """tests/interruptible_train.py ARGS as a watched Job: every rank announces each step;
    `hold_at_step`: every rank waits there until the file `release` exists."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "RINGTRAIN_TEST_STEP_SECONDS": str(step_seconds), "RINGTRAIN_TEST_HOLD_AT_STEP": str(hold_at_step)}
    if release is not None:
        env["RINGTRAIN_TEST_HOLD_UNTIL_FILE"] = str(release)
    env.pop("PYTHONPATH", None)  # the worktree comes first through the wrapper itself
    return Job((launcher or [sys.executable]) + [str(WRAPPER), *args, *QUIET], cwd=cwd or REPO, env=env)


def run_job(args: list[str], launcher: list[str] | None = None, cwd: Path | None = None) -> tuple[int, str]:
    """A job run to its end, uninterrupted, steps not slowed down."""
    with training_job(args, launcher, cwd) as job:
        return job.finish(240)


def sigterm_at(args: list[str], step: int, ranks: int, tmp_path: Path, cwd: Path | None = None) -> tuple[int, str]:
    """Start the job, SIGTERM it (the launching process) once rank 0 announced `step`, where
    every rank holds until each has said it received the signal; the job's status and output."""
    release = tmp_path / f"release-{step}"
    with training_job(args, cwd=cwd, step_seconds=0.02, hold_at_step=step, release=release) as job:
        job.wait_for_step(step)
        job.send_signal(signal.SIGTERM)  # as `kill <pid>` or a scheduler's preemption
        job.wait_until(lambda: sum("received SIGTERM: finishing" in line for line in job.lines) >= ranks,
                       f"{ranks} rank(s) saying they received SIGTERM")
        release.touch()
        result = job.finish(240)
        assert not job.kill_leftovers(), "processes were left behind"
    return result


def last_steps(output: str) -> dict[int, int]:
    """The last step each rank announced."""
    steps: dict[int, int] = {}
    for line in output.splitlines():
        if match := STEP_ANNOUNCEMENT.match(line):
            rank, _, step = map(int, match.groups())
            steps[rank] = max(steps.get(rank, 0), step)
    return steps


def resumed_from(output: str) -> int:
    match = re.search(r"resuming from \S+ \(step (\d+)\)", output)
    assert match, "the job did not resume:\n" + output[-4000:]
    return int(match.group(1))


# --- what a run logged ----------------------------------------------------------------------------


def validations(run_dir: Path, metric: str = "val/loss") -> list[tuple[int, float]]:
    """(step, value) of every validation the run logged, in order (metrics.csv, full precision)."""
    with (run_dir / "metrics.csv").open(newline="") as file:
        return [(int(row["step"]), float(row[metric])) for row in csv.DictReader(file) if row.get(metric)]


def validations_in_train_log(run_dir: Path) -> list[tuple[int, str]]:
    """(step, value as the log writes it, 5 significant digits) of every validation in train.log."""
    lines = (run_dir / "train.log").read_text().splitlines()
    return [(int(m.group(1)), m.group(2)) for line in lines
            if (m := re.search(r"\] - step (\d+) epoch [\d.]+: val/loss=(\S+)$", line))]


def summary(run_dir: Path) -> dict:
    return json.loads((run_dir / "metrics.json").read_text())


def checkpoint(path: Path) -> dict:
    return torch.load(path, weights_only=True)


# --- 1. a user's callback: its counts go on exactly across SIGTERM and the same command ------

# The default linear regression job, 160 samples: 10 steps of 16 an epoch (on one process, or of
# 8 on each of 2 ranks), 3 epochs; validation 4 times an epoch.
COUNTED_JOB = ["--config-dir", "my_conf", "callbacks=[default,counter]", "data.num_samples=160",
               "data.num_val_samples=32", "trainer.max_epochs=3", "trainer.eval_every_fraction=0.25", "logger=csv"]
COUNTED_STEPS, COUNTED_VALIDATIONS = 30, 12


@pytest.fixture(scope="module")
def uninterrupted_counts(user_dir, tmp_path_factory) -> dict[str, int]:
    """The counter's final counts in a run that nobody interrupts (one process, in this one;
    the counter given on the command line, as +callbacks.counter._target_=...)."""
    run_dir = tmp_path_factory.mktemp("counted")
    train_in_process(["+callbacks.counter._target_=my_callbacks.counter.Counter", "trainer.batch_size=16",
                      *COUNTED_JOB[3:]], run_dir)
    [start, end] = [json.loads(line) for line in (run_dir / "counter-rank0.jsonl").read_text().splitlines()]
    assert start["counts"] == dict.fromkeys(start["counts"], 0) and end["step"] == COUNTED_STEPS
    counts = end["counts"]
    assert counts == {"on_step_start": COUNTED_STEPS, "on_step_end": COUNTED_STEPS,
                      "on_validation_start": COUNTED_VALIDATIONS, "on_validation_end": COUNTED_VALIDATIONS}
    return counts


class CountedJobs:
    """The counted job of one process (1) or two ranks (2, self-launched gloo DDP, batch 8 a
    rank), each made when first needed: SIGTERM once rank 0 announced step 12 (mid-epoch 2,
    between validations), then the same command again. Kept: the run directory, the step
    last.pt held after the stop, the checkpoint's counter state then, and both outputs."""

    def __init__(self, user_dir: Path, tmp_path_factory):
        self.user_dir, self._factory, self._jobs = user_dir, tmp_path_factory, {}

    def __call__(self, ranks: int) -> dict:
        if ranks not in self._jobs:
            tmp_path = self._factory.mktemp(f"counted-{ranks}")
            run_dir = tmp_path / "run"
            args = COUNTED_JOB + [f"hydra.run.dir={run_dir}"] + (
                ["trainer.batch_size=16"] if ranks == 1 else
                ["trainer.batch_size=8", "strategy=ddp", "strategy.nproc_per_node=2"])
            status, stopped_output = sigterm_at(args, 12, ranks, tmp_path, cwd=self.user_dir)
            assert status == 143, stopped_output[-4000:]
            stopped = checkpoint(run_dir / "checkpoints" / "last.pt")
            output = job_ok(run_job(args, cwd=self.user_dir))  # the same command: trainer.resume=auto
            self._jobs[ranks] = {"run_dir": run_dir, "saved_step": stopped["progress"]["step"],
                                 "saved_state": stopped["callbacks"]["counter"], "stopped_output": stopped_output,
                                 "output": output}
        return self._jobs[ranks]


@pytest.fixture(scope="module")
def counted_jobs(user_dir, tmp_path_factory) -> CountedJobs:
    return CountedJobs(user_dir, tmp_path_factory)


@pytest.mark.parametrize("ranks", [1, pytest.param(2, marks=pytest.mark.slow)])  # 2 ranks: ~25 s
def test_a_users_callback_keeps_counting_exactly_across_sigterm_and_the_same_command(
        counted_jobs, uninterrupted_counts, ranks):
    """The user's my_callbacks.counter.Counter, chosen by their --config-dir's callbacks/counter.yaml
    (no change to ringtrain): SIGTERM mid-run saves its counts in last.pt (exit 143); the same
    command again gives every rank the saved counts back, and the run ends with the counts of an
    uninterrupted run on every rank."""
    job = counted_jobs(ranks)
    run_dir, saved_step = job["run_dir"], job["saved_step"]
    assert 12 <= saved_step < COUNTED_STEPS, job["stopped_output"][-4000:]
    saved_counts = job["saved_state"]["counts"]
    assert saved_counts["on_step_end"] == saved_counts["on_step_start"] == saved_step
    assert resumed_from(job["output"]) == saved_step
    for rank in range(ranks):
        records = [json.loads(line) for line in (run_dir / f"counter-rank{rank}.jsonl").read_text().splitlines()]
        assert [r["event"] for r in records] == ["start", "end", "start", "end"], records
        first_end, second_start, second_end = records[1:]
        assert first_end["step"] == saved_step and first_end["counts"] == saved_counts  # what each rank had
        assert second_start["step"] == saved_step and second_start["counts"] == saved_counts  # given back
        assert second_end["step"] == COUNTED_STEPS and second_end["counts"] == uninterrupted_counts, rank
    assert checkpoint(run_dir / "checkpoints" / "last.pt")["callbacks"]["counter"]["counts"] == uninterrupted_counts


# --- 2. early stopping -----------------------------------------------------------------------------

# SGD at lr 0.1 fits y = 2x + 3 within ~25 steps; from there the validation loss only wanders
# about the noise floor (its value at each validation fixed by the seed): it stops improving.
PATIENCE = 3
EARLY = ["data.num_samples=512", "data.num_val_samples=64", "optimizer.lr=0.1", "trainer.max_epochs=4",
         "trainer.eval_every_n_steps=4", "callbacks=[default,early_stopping]",
         f"callbacks.early_stopping.patience={PATIENCE}", "logger=csv"]
EARLY_STEPS = 4 * 512 // 16  # the run's length were it not stopped


def expected_stop(logged: list[tuple[int, float]], patience: int, min_delta: float = 0.0) -> tuple[int, float, list]:
    """By hand: the step of the first validation that is the `patience`-th in a row not below
    the best so far by more than `min_delta`; that best; and the waits after each validation."""
    best, waited, waits = None, 0, []
    for step, value in logged:
        if best is None or value < best - min_delta:
            best, waited = value, 0
        else:
            waited += 1
        waits.append((step, waited))
        if waited == patience:
            return step, best, waits
    raise AssertionError(f"the validation loss kept improving: {logged}")


def assert_stopped_early(run_dir: Path) -> int:
    """The run ended at the validation its patience implies, said why; returns that step."""
    logged = validations(run_dir)
    assert validations_in_train_log(run_dir) == [(step, f"{value:.5g}") for step, value in logged]
    stop, best, _ = expected_stop(logged, PATIENCE)
    result = summary(run_dir)
    assert logged[-1][0] == stop, f"stopped after step {logged[-1][0]}, the patience implies {stop}: {logged}"
    assert result["steps"] == stop < EARLY_STEPS
    assert result["stopped"] == (f"early stopping: val/loss did not improve on {best:.6g} (by more than 0) "
                                 f"in {PATIENCE} validations")
    assert checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == stop
    return stop


@pytest.fixture(scope="module")
def early_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("early") / "run"
    ok(run_cli(EARLY + ["trainer.batch_size=16", f"hydra.run.dir={run_dir}"]))  # exit 0
    return run_dir


def test_early_stopping_ends_at_the_step_its_patience_implies_exit_0_reason_in_metrics_json(early_run):
    stop = assert_stopped_early(early_run)
    # Not the first validations: the loss improved for a while before it stopped doing so.
    assert stop > 4 * (PATIENCE + 2)


@pytest.mark.slow
def test_early_stopping_under_two_ranks_stops_every_rank_at_the_same_step(tmp_path):
    run_dir = tmp_path / "run"
    output = job_ok(run_job(EARLY + ["trainer.batch_size=8", "strategy=ddp", f"hydra.run.dir={run_dir}"],
                            launcher=TORCHRUN))  # exit 0
    stop = assert_stopped_early(run_dir)
    assert last_steps(output) == {0: stop, 1: stop}, output[-4000:]


def test_early_stopping_interrupted_mid_patience_and_resumed_stops_at_the_same_step(early_run, tmp_path):
    """SIGTERM after the first validation that did not improve on the best (the run then waits
    for PATIENCE - 1 more), before the next validation; the same command stops where the
    uninterrupted run stopped, for the same reason."""
    stop, _, waits = expected_stop(validations(early_run), PATIENCE)
    first_wait = [step for step, waited in waits if waited == 1][-1]  # the last run of waits begins
    interrupt = first_wait + 2  # between that validation and the next (every 4 steps)
    run_dir = tmp_path / "run"
    args = EARLY + ["trainer.batch_size=16", f"hydra.run.dir={run_dir}"]
    status, output = sigterm_at(args, interrupt, 1, tmp_path)
    assert status == 143, output[-4000:]
    stopped = checkpoint(run_dir / "checkpoints" / "last.pt")
    assert stopped["progress"]["step"] == interrupt
    assert stopped["callbacks"]["early_stopping"]["waited"] == 1  # in the middle of its patience

    output = job_ok(run_job(args))
    assert resumed_from(output) == interrupt
    assert assert_stopped_early(run_dir) == stop
    assert summary(run_dir)["stopped"] == summary(early_run)["stopped"]


def test_the_same_command_on_a_run_early_stopping_ended_resumes_at_its_stop_step_and_ends_there(early_run, tmp_path):
    """Run again, as a restart loop or a requeued job does: it resumes from the checkpoint of the
    validation that ended it and ends at once, for the same reason, training and validating nothing."""
    import shutil

    stop = assert_stopped_early(early_run)
    run_dir = tmp_path / "run"
    shutil.copytree(early_run, run_dir)
    proc = ok(run_cli(EARLY + ["trainer.batch_size=16", f"hydra.run.dir={run_dir}"]))
    assert resumed_from(proc.stdout + proc.stderr) == stop
    assert summary(run_dir)["steps"] == stop and summary(run_dir)["stopped"] == summary(early_run)["stopped"]
    assert validations(run_dir) == validations(early_run)
    assert checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == stop


@pytest.mark.slow
def test_early_stopping_interrupted_at_its_stop_step_and_resumed_ends_there(early_run, tmp_path):
    """The stop signal arrives during the step early stopping ends the run at (the fast case,
    the same command on the ended run, is the test above)."""
    stop, _, _ = expected_stop(validations(early_run), PATIENCE)
    run_dir = tmp_path / "run"
    args = EARLY + ["trainer.batch_size=16", f"hydra.run.dir={run_dir}"]
    status, output = sigterm_at(args, stop, 1, tmp_path)  # the signal arrives during the stop step
    assert status in (0, 143), output[-4000:]
    assert checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == stop
    job_ok(run_job(args))  # the same command: nothing left to train
    assert summary(run_dir)["steps"] == stop
    assert checkpoint(run_dir / "checkpoints" / "last.pt")["progress"]["step"] == stop


# --- 3. the k best checkpoints ------------------------------------------------------------------


def test_best_k_keeps_the_three_best_validations_each_loads_and_evaluates_to_its_logged_metric(tmp_path):
    run_dir = tmp_path / "run"
    # The loss wanders about its floor after ~25 steps: the best three are not the last three.
    result = train_in_process(["data.num_samples=512", "data.num_val_samples=64", "optimizer.lr=0.1",
                               "trainer.batch_size=16", "trainer.max_epochs=2", "trainer.eval_every_n_steps=4",
                               "callbacks=[default,best_checkpoints]", "callbacks.best_checkpoints.k=3",
                               "logger=csv"], run_dir)
    logged = dict(validations(run_dir))
    assert result.steps == 64 and len(logged) == 16
    best_three = sorted(logged, key=logged.get)[:3]
    assert set(best_three) != set(sorted(logged)[-3:])
    files = sorted((run_dir / "checkpoints").glob("best-*.pt"))
    assert [f.name for f in files] == [f"best-val_loss-{step:08d}.pt" for step in sorted(best_three)]
    for path, step in zip(files, sorted(best_three)):
        assert checkpoint(path)["progress"]["step"] == step  # weights_only=True loads it

    # `ringtrain evaluate` on each, one multirun job per checkpoint: <run dir>/eval/<name>-val.json
    ok(run_module("ringtrain", ["evaluate", "-m", "checkpoint=" + ",".join(str(f) for f in files)], cwd=tmp_path))
    for path, step in zip(files, sorted(best_three)):
        record = json.loads((run_dir / "eval" / f"{path.stem}-val.json").read_text())
        assert record["step"] == step
        assert record["metrics"]["val/loss"] == pytest.approx(logged[step], rel=1e-6, abs=1e-9), path.name


BEST_TWO = ["data.num_samples=256", "data.num_val_samples=32", "optimizer.lr=0.1", "trainer.batch_size=16",
            "trainer.eval_every_n_steps=4", "callbacks=[default,best_checkpoints]", "callbacks.best_checkpoints.k=2",
            "logger=csv"]


def _best_files(run_dir: Path) -> list[str]:
    return sorted(f.name for f in (run_dir / "checkpoints").glob("best-*.pt"))


def test_best_k_leaves_the_k_best_when_a_finished_run_is_continued_by_the_same_command(tmp_path):
    """The checkpoint of a validation is written before its own best link: the same command
    on the finished run ranks that validation again, one entry per step, and k files stay."""
    run_dir = tmp_path / "run"
    train_in_process(BEST_TWO + ["trainer.max_steps=16"], run_dir)
    train_in_process(BEST_TWO + ["trainer.max_steps=16"], run_dir)  # nothing to train: validates again
    logged = dict(validations(run_dir))
    best_two = sorted(sorted(logged, key=logged.get)[:2])
    assert _best_files(run_dir) == [f"best-val_loss-{step:08d}.pt" for step in best_two]


def test_best_k_removes_what_a_stop_between_saves_left_when_the_run_resumes(tmp_path):
    """Best links of a line of training the resumed checkpoint never recorded (a kill -9 after
    a link, before the next save: here planted) go; the disk holds the best k of the record."""
    run_dir = tmp_path / "run"
    train_in_process(BEST_TWO + ["trainer.max_steps=8"], run_dir)
    directory = run_dir / "checkpoints"
    for step in (90, 91, 92):  # better-looking names than any real one, none in the record
        os.link(directory / "last.pt", directory / f"best-val_loss-{step:08d}.pt")
    train_in_process(BEST_TWO + ["trainer.max_steps=16"], run_dir)
    logged = dict(validations(run_dir))
    best_two = sorted(sorted(logged, key=logged.get)[:2])
    assert _best_files(run_dir) == [f"best-val_loss-{step:08d}.pt" for step in best_two]


def _best_two(run_dir: Path) -> list[str]:
    """The names of the two best validations the run logged."""
    logged = dict(validations(run_dir))  # a step validated again after a resume: its last value
    return [f"best-val_loss-{step:08d}.pt" for step in sorted(sorted(logged, key=logged.get)[:2])]


def test_best_k_leaves_the_k_best_after_sigterm_and_after_the_run_is_continued(tmp_path):
    run_dir = tmp_path / "run"
    args = BEST_TWO + ["trainer.max_steps=24", f"hydra.run.dir={run_dir}"]
    status, output = sigterm_at(args, 14, 1, tmp_path)  # after the validations of steps 4, 8 and 12
    assert status == 143, output[-4000:]
    assert _best_files(run_dir) == _best_two(run_dir) and len(dict(validations(run_dir))) == 3
    job_ok(run_job(args))
    assert _best_files(run_dir) == _best_two(run_dir) and len(dict(validations(run_dir))) == 6


def test_best_k_leaves_at_most_k_after_a_kill_9_during_a_save_and_the_k_best_once_continued(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    args = BEST_TWO + ["trainer.max_steps=24", f"hydra.run.dir={run_dir}"]
    # The save of step 16's validation holds after its bytes, before its rename: killed there.
    monkeypatch.setenv("RINGTRAIN_TEST_SLOW_WRITE_FROM_STEP", "16")
    with training_job(args) as job:
        job.wait_for_line(r"interruptible: writing step=16")
        os.kill(job.proc.pid, signal.SIGKILL)
        status, output = job.finish(120)
    assert status == -signal.SIGKILL, output[-4000:]
    assert len(_best_files(run_dir)) <= 2
    monkeypatch.delenv("RINGTRAIN_TEST_SLOW_WRITE_FROM_STEP")
    assert resumed_from(job_ok(run_job(args))) == 12
    assert _best_files(run_dir) == _best_two(run_dir) and len(dict(validations(run_dir))) == 6


def test_a_callback_whose_state_is_not_data_is_refused_at_the_first_save_and_nothing_unreadable_is_written(tmp_path):
    module = """
        from ringtrain.callbacks import Callback


        class Opaque:
            pass


        class KeepsAnObject(Callback):
            def state_dict(self):
                return {"thing": Opaque()}
    """
    with user_package(tmp_path / "pkg", {"opaque_cb/__init__.py": module}, "opaque_cb"):
        proc = run_cli(["+callbacks.opaque._target_=opaque_cb.KeepsAnObject", "trainer.max_steps=4",
                        f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path / "pkg")
    refused(proc, "callbacks.opaque.thing is a opaque_cb.Opaque", "make callbacks.opaque's state_dict() return tensors")
    for path in (tmp_path / "run").rglob("*.pt"):
        torch.load(path, weights_only=True)  # every file on disk reads as data


def test_every_registered_part_round_trips_through_a_checkpoint_a_users_callback_from_config_dir_too(
        user_dir, tmp_path, monkeypatch):
    """Saved at step 6, started again by the same command: right after the restore, what every part
    registered with the CheckpointManager holds, collected as a save collects it, equals that
    checkpoint entry by entry: the model, optimizer, scheduler, scaler ({}: a CPU run has none),
    layout, progress (the data position), every rank's RNG and the callbacks (EMA, best-k, early
    stopping and the user's `probe` from --config-dir); the user's on_load_checkpoint saw the
    entry its on_save_checkpoint added, and its state back."""
    run_dir = tmp_path / "run"
    args = ["--config-dir", "my_conf", "callbacks=[default,ema,best_checkpoints,early_stopping,probe]",
            "trainer.eval_every_n_steps=3", "trainer.max_steps=6", f"hydra.run.dir={run_dir}"]
    job_ok(run_job(args, cwd=user_dir))
    saved = checkpoint(run_dir / "checkpoints" / "last.pt")
    monkeypatch.setenv("RINGTRAIN_TEST_RECORD_RESTORED", str(tmp_path / "restored.pt"))
    job_ok(run_job(args, cwd=user_dir))
    restored = checkpoint(tmp_path / "restored.pt")
    assert set(saved) - set(restored) == {"probe"}  # what on_save_checkpoint added: no part of the run
    assert set(saved["callbacks"]) == {"ema", "best_checkpoints", "early_stopping", "probe"}
    assert saved["callbacks"]["probe"]["validations"] and saved["callbacks"]["ema"]["weights"]
    for key, value in restored.items():
        assert_same_state(value, saved[key], key)
    seen = json.loads((run_dir / "probe-loaded.json").read_text())
    assert seen == {"added": {"step": 6}, "saved": saved["callbacks"]["probe"], "mine": saved["callbacks"]["probe"],
                    "step": 6}


# --- 4. validation at every quarter of an epoch ----------------------------------------------------


def quarter_steps(samples: int, global_batch: int, epochs: int) -> list[int]:
    """By hand: an epoch of `samples` takes ceil(samples / global_batch) optimizer steps; a
    quarter is reached at the first step whose samples reach it (the epoch's last at its end)."""
    per_epoch = math.ceil(samples / global_batch)
    within = [min(math.ceil(q * samples / 4 / global_batch), per_epoch) for q in (1, 2, 3, 4)]
    return [epoch * per_epoch + step for epoch in range(epochs) for step in within]


QUARTERS = ["data.num_samples=160", "data.num_val_samples=32", "trainer.max_epochs=2",
            "trainer.eval_every_fraction=0.25", "logger=csv"]


@pytest.mark.parametrize("samples,global_batch,layout", [
    # 10 steps an epoch: the quarters fall after steps 2.5 -> 3, 5, 7.5 -> 8 and 10.
    (160, 16, ["trainer.batch_size=16"]),
    (160, 16, ["trainer.batch_size=8", "trainer.accumulate_grad_batches=2"]),
    # 11 steps an epoch, the last of 10 samples (250 = 10 * 24 + 10): the quarters, at samples
    # 62.5, 125, 187.5 and 250 of the epoch (the documented rule), fall after steps 3, 6, 8, 11.
    (250, 24, ["trainer.batch_size=24"]),
    (250, 24, ["trainer.batch_size=12", "trainer.accumulate_grad_batches=2"]),
])
def test_validation_at_every_quarter_of_an_epoch(tmp_path, samples, global_batch, layout):
    result = train_in_process(QUARTERS + [f"data.num_samples={samples}"] + layout, tmp_path)
    expected = quarter_steps(samples, global_batch, 2)
    assert result.steps == expected[-1] == 2 * math.ceil(samples / global_batch)
    steps = [step for step, _ in validations(tmp_path)]
    assert steps == expected, f"validated after steps {steps}, the quarters are {expected}"
    assert expected[:4] == ([3, 5, 8, 10] if samples == 160 else [3, 6, 8, 11])


@pytest.mark.slow  # with the 2-rank SIGTERM case of section 1, whose job it reads; one process above
def test_validation_at_every_quarter_of_an_epoch_on_two_ranks(counted_jobs):
    """The counted job of two ranks (batch 8 each: 10 steps an epoch, 3 epochs), stopped by
    SIGTERM mid-epoch and continued by the same command: its validations over both sessions."""
    steps = [step for step, _ in validations(counted_jobs(2)["run_dir"])]
    assert steps == quarter_steps(160, 16, 3) == [3, 5, 8, 10, 13, 15, 18, 20, 23, 25, 28, 30]


# --- 5. one-line refusals --------------------------------------------------------------------------


# best-k's monitor goes through the same check as early stopping's (callbacks/__init__.py check_monitors): -m slow.
@pytest.mark.parametrize("setting", ["callbacks.early_stopping.monitor",
                                     pytest.param("callbacks.best_checkpoints.monitor", marks=pytest.mark.slow),
                                     "task.monitor"])
def test_a_monitor_the_task_does_not_report_is_one_line_exit_2_before_the_first_step(tmp_path, setting):
    proc = run_cli(["model=mlp", "data.num_features=8", "data.num_samples=256", "data.num_val_samples=64",
                    "trainer.max_steps=2", "callbacks=[default,early_stopping,best_checkpoints]",
                    f"{setting}=val/nope", f"hydra.run.dir={tmp_path / 'run'}"])
    refused(proc, f"{setting}=val/nope is not a metric of this task", "it reports val/acc, val/loss")
    # The task says its metrics before training: no step taken, no run directory left.
    assert not (tmp_path / "run").exists()


def test_a_callback_with_a_misspelt_hook_is_refused_in_one_line_before_any_work(user_dir, tmp_path):
    proc = run_cli(["--config-dir", "my_conf", "callbacks=[default,late]", f"hydra.run.dir={tmp_path / 'run'}"],
                   cwd=user_dir)
    refused(proc, "callbacks.late: my_callbacks.late.Late defines on_validation_ended, which ringtrain never calls",
            "on_validation_end")
    assert not (tmp_path / "run").exists() and not (user_dir / "outputs").exists()


def test_the_readmes_user_callback_runs_as_the_readme_says(tmp_path):
    """README.md "Callbacks and loggers": its StopAtTarget, saved as my_callbacks/target.py, and
    its command line stop the default job at the first validation at or below the target, exit
    0, the reason in metrics.json and the callback's count in the checkpoint."""
    readme = (REPO / "README.md").read_text()
    block = next(b for b in re.findall(r"```python\n(.*?)```", readme, re.S) if "class StopAtTarget" in b)
    (tmp_path / "my_callbacks").mkdir()
    (tmp_path / "my_callbacks" / "__init__.py").write_text("")
    (tmp_path / "my_callbacks" / "target.py").write_text(block)
    command = next(line for line in readme.splitlines() if line.startswith("ringtrain +callbacks.target."))
    ok(run_cli(command.split()[1:] + [f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path))
    summary = json.loads((tmp_path / "run" / "metrics.json").read_text())
    log = (tmp_path / "run" / "train.log").read_text()
    validations = [float(v) for v in re.findall(r"step \d+ epoch [\d.]+: val/loss=([\d.]+)", log)]
    first = next(i for i, loss in enumerate(validations) if loss <= 0.05)
    assert len(validations) == first + 1 < 10  # stopped at it, before the 10 epochs were done
    assert summary["stopped"] == f"val/loss reached 0.05 at validation {first + 1}"
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["callbacks"]["target"] == {"validations": first + 1}


class Asks(Callback):
    """A user's callback making the requests a callback may make (Run.request_*): at step 3 a
    validation and a checkpoint, at step 5 the end of the run. It notes when validations and
    saves happen, in <run dir>/asked.json."""

    def __init__(self) -> None:
        self.validated, self.saved = [], []

    def on_step_end(self, run, step) -> None:
        if step.step == 3:
            run.request_validation()
            run.request_checkpoint()
        elif step.step == 5:
            run.request_stop("the callback had enough")

    def on_validation_end(self, run, metrics) -> None:
        self.validated.append(run.step)

    def on_checkpoint_saved(self, run, step, path) -> None:
        self.saved.append(step)

    def on_fit_end(self, run, result) -> None:
        (run.run_dir / "asked.json").write_text(json.dumps({"validated": self.validated, "saved": self.saved}))


def test_a_callbacks_requests_validate_save_and_stop_at_the_step_it_asks(tmp_path):
    result = train_in_process(["+callbacks.asks._target_=test_stock_callbacks.Asks", "trainer.batch_size=64", *QUIET],
                              tmp_path)
    # Mid-epoch (about 140 steps of 64 samples), where nothing else validates or saves.
    assert json.loads((tmp_path / "asked.json").read_text()) == {"validated": [3], "saved": [3, 5]}
    assert (result.steps, result.stopped, result.stop_kind) == (5, "the callback had enough", "requested")
    assert torch.load(tmp_path / "checkpoints" / "step-00000003.pt", weights_only=True)["progress"]["step"] == 3
