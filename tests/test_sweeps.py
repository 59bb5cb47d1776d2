"""Multirun sweeps with the real tools: Hydra's sweepers and launchers, TensorBoard's reader and server."""
from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from conftest import run_cli
from helpers import free_port, ok, refused

LRS, BATCHES = (0.01, 0.05), (32, 64)
SCALAR_TAGS = {"train/loss", "val/loss", "lr", "grad_norm", "throughput/samples_per_sec"}


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # no hydra_plugins package at all: no plugin is installed
        return False


def _needs(module: str):
    return pytest.mark.skipif(
        not _installed(module), reason=f"{module} is not installed (pip install -e '.[sweep]' / '.[slurm]')",
    )


def _job_dirs(sweep_dir: Path) -> list[Path]:
    return sorted(p for p in sweep_dir.iterdir() if (p / ".hydra").is_dir())


@pytest.fixture(scope="module")
def sweep_2x2(tmp_path_factory) -> tuple[Path, subprocess.CompletedProcess]:
    """One 2x2 sweep of the default job, shared by the tests that read what it leaves behind."""
    sweep_dir = tmp_path_factory.mktemp("sweep")
    proc = run_cli(["-m", f"optimizer.lr={LRS[0]},{LRS[1]}", f"trainer.batch_size={BATCHES[0]},{BATCHES[1]}",
                    "trainer.max_epochs=2", f"hydra.sweep.dir={sweep_dir}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    return sweep_dir, proc


def test_a_2x2_multirun_gives_four_jobs_and_a_summary_naming_the_best(sweep_2x2):
    sweep_dir, proc = sweep_2x2
    jobs = _job_dirs(sweep_dir)
    assert len(jobs) == 4
    assert [len(list(job.glob("events.out.tfevents.*"))) for job in jobs] == [1, 1, 1, 1]
    values = {job.name: json.loads((job / "metrics.json").read_text())["final"]["val/loss"] for job in jobs}
    assert all(math.isfinite(v) for v in values.values())

    summary = json.loads((sweep_dir / "sweep_summary.json").read_text())
    assert {job["dir"]: job["value"] for job in summary["jobs"]} == values
    best_dir = min(values, key=values.get)
    assert summary["best"]["val/loss"]["dir"] == best_dir
    best = next(job for job in summary["jobs"] if job["dir"] == best_dir)
    swept = " ".join(o for o in best["overrides"] if o.startswith(("optimizer.lr", "trainer.batch_size")))
    assert f"best val/loss {values[best_dir]:.5g}: job {best_dir.split('_')[0]} ({swept})" in proc.stdout + proc.stderr
    swept = {tuple(o for o in job["overrides"] if o.split("=")[0] in ("optimizer.lr", "trainer.batch_size"))
             for job in summary["jobs"]}
    assert swept == {(f"optimizer.lr={lr}", f"trainer.batch_size={b}") for lr in LRS for b in BATCHES}
    # Each job's directory is named by what it changes.
    assert {job.name.split("_", 1)[1] for job in jobs} == {
        f"optimizer.lr={lr},trainer.batch_size={b},trainer.max_epochs=2" for lr in LRS for b in BATCHES
    }


def test_event_files_hold_every_runs_scalars_and_hparams(sweep_2x2):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    sweep_dir, _ = sweep_2x2
    for job in _job_dirs(sweep_dir):
        events = EventAccumulator(str(job)).Reload()
        assert SCALAR_TAGS <= set(events.Tags()["scalars"])
        steps = [e.step for e in events.Scalars("train/loss")]
        assert steps == sorted(steps) and steps[-1] == events.Scalars("val/loss")[-1].step

        hparams = events.PluginTagToContent("hparams")
        assert {"_hparams_/session_start_info", "_hparams_/session_end_info"} <= set(hparams)
        # No experiment record of its own: TensorBoard builds one from all runs and shows first
        # the hyperparameters whose values differ between them.
        assert "_hparams_/experiment" not in hparams
        start = plugin_data_pb2.HParamsPluginData.FromString(hparams["_hparams_/session_start_info"])
        chosen = {k: v.number_value for k, v in start.session_start_info.hparams.items() if v.HasField("number_value")}
        overrides = dict(o.split("=", 1) for o in OmegaConf.load(job / ".hydra" / "overrides.yaml"))
        assert chosen["optimizer.lr"] == float(overrides["optimizer.lr"])
        assert chosen["trainer.batch_size"] == float(overrides["trainer.batch_size"])
        assert "final/val/loss" in events.Tags()["scalars"]


def _get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def test_a_real_tensorboard_server_serves_every_runs_scalars(sweep_2x2):
    sweep_dir, _ = sweep_2x2
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "tensorboard.main", "--logdir", str(sweep_dir), "--host", "127.0.0.1",
         "--port", str(port), "--reload_interval", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        expected = {job.name for job in _job_dirs(sweep_dir)}
        deadline, runs = time.monotonic() + 90, []
        while time.monotonic() < deadline:
            try:
                runs = _get_json(f"{base}/data/runs")
                tags = _get_json(f"{base}/data/plugin/scalars/tags")
                if set(runs) >= expected and all(SCALAR_TAGS <= set(tags.get(r, {})) for r in expected):
                    break
            except OSError:  # not listening yet
                pass
            time.sleep(1)
        assert set(runs) >= expected, f"runs served: {runs}"
        for run in expected:
            query = urllib.parse.urlencode({"run": run, "tag": "val/loss"})
            points = _get_json(f"{base}/data/plugin/scalars/scalars?{query}")
            assert points and all(math.isfinite(value) for _, _, value in points)
        # The HPARAMS tab: the swept hyperparameters first, marked as differing between runs.
        request = urllib.request.Request(f"{base}/data/plugin/hparams/experiment", method="POST",
                                         data=b'{"experimentName": ""}', headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=10) as response:
            experiment = json.loads(response.read())
        first = [(h["name"], h.get("differs", False)) for h in experiment["hparamInfos"][:2]]
        assert first == [("optimizer.lr", True), ("trainer.batch_size", True)]
        assert "final/val/loss" in {m["name"]["tag"] for m in experiment["metricInfos"]}
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert server.returncode is not None


@pytest.mark.slow
def test_a_sweep_job_refused_in_a_directory_leaves_its_owners_record_as_it_was(tmp_path):
    """Each job writes its .hydra/ record once it owns its directory, as a single run does
    (storage/rundir.py): Hydra wrote it as the job started, so a second sweep into the same
    job directories replaced the record of the run whose checkpoints are there."""
    common = ["-m", "hydra.sweep.subdir=${hydra.job.num}", f"hydra.sweep.dir={tmp_path}", "trainer.max_steps=2"]
    ok(run_cli(common + ["optimizer.lr=0.01,0.02"]))
    records = {p: p.read_bytes() for p in sorted(tmp_path.glob("*/.hydra/*"))}
    assert len(records) == 6 and "lr: 0.02" in (tmp_path / "1" / ".hydra" / "config.yaml").read_text()
    assert "RINGTRAIN_RECORD_SUBDIR" not in (tmp_path / "1" / ".hydra" / "hydra.yaml").read_text()
    refused(run_cli(common + ["model=mlp", "optimizer.lr=0.01"]), "/0 holds a run whose model._target_",
            "hydra.sweep.dir in a sweep")
    assert {p: p.read_bytes() for p in sorted(tmp_path.glob("*/.hydra/*"))} == records


@pytest.mark.slow
def test_ddp_inside_a_sweep_runs_each_job_as_its_own_two_process_job(tmp_path):
    proc = run_cli(["-m", "strategy=ddp", "strategy.nproc_per_node=2", "optimizer.lr=0.01,0.05",
                    "trainer.max_epochs=1", f"hydra.sweep.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    jobs = _job_dirs(tmp_path)
    assert len(jobs) == 2 and all((job / "checkpoints" / "last.pt").exists() for job in jobs)
    summary = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert [job["steps"] for job in summary["jobs"]] == [157, 157]  # 10000 / (32 * 2 ranks)


def test_a_diverged_job_is_the_worst_value_never_nan():
    from ringtrain.loop import FitResult
    from ringtrain.run import sweep_value

    def result(value, mode):
        return FitResult({"val/x": value}, "val/x", mode, None, 1, 0.0)

    assert sweep_value(result(float("nan"), "min")) == math.inf
    assert sweep_value(result(float("inf"), "max")) == -math.inf
    assert sweep_value(result(0.25, "min")) == 0.25


# --- optional plugins: run for real where the extras are installed ---------------------------


@pytest.mark.slow
@_needs("hydra_plugins.hydra_optuna_sweeper")
def test_optuna_sweep_survives_a_diverging_trial_and_beats_its_worst_trial(tmp_path):
    # The preset as users run it (seeded TPE), with the learning rate drawn from four values
    # on the command line; lr=50 makes SGD diverge to NaN.
    proc = run_cli(["-m", "hparams_search=optuna", "hydra.sweeper.n_trials=4",
                    "optimizer.lr=choice(0.001,0.01,0.05,50.0)", "trainer.max_epochs=1",
                    f"hydra.sweep.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert len(summary["jobs"]) == 4
    lrs = [next(o for o in job["overrides"] if o.startswith("optimizer.lr=")) for job in summary["jobs"]]
    diverged = [job for job, lr in zip(summary["jobs"], lrs) if lr == "optimizer.lr=50.0"]
    assert diverged and all(job["value"] is None and job["diverged"] for job in diverged)  # and the sweep went on
    finite = [job["value"] for job in summary["jobs"] if job["value"] is not None]
    assert len(set(finite)) >= 2 and min(finite) < max(finite)
    results = OmegaConf.load(tmp_path / "optimization_results.yaml")
    assert results.best_value == pytest.approx(min(finite)) and results.best_params["optimizer.lr"] != 50.0


@_needs("hydra_plugins.hydra_optuna_sweeper")
@pytest.mark.slow
def test_optuna_direction_follows_the_task_metric():
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from conftest import CONF_DIR
    from ringtrain.config import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        for model, direction in (("linear", "minimize"), ("mlp", "maximize"), ("transformer", "minimize")):
            cfg = compose("train", overrides=["hparams_search=optuna", f"model={model}"], return_hydra_config=True)
            assert OmegaConf.select(cfg, "hydra.sweeper.direction") == direction


@pytest.mark.slow
@_needs("hydra_plugins.hydra_joblib_launcher")
def test_joblib_launcher_runs_jobs_in_parallel_processes(tmp_path):
    proc = run_cli(["-m", "hydra/launcher=joblib", "hydra.launcher.n_jobs=2", "optimizer.lr=0.01,0.05",
                    "trainer.max_epochs=1", f"hydra.sweep.dir={tmp_path}"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "sweep_summary.json").read_text())
    assert len(summary["jobs"]) == 2 and all(math.isfinite(job["value"]) for job in summary["jobs"])


@pytest.mark.slow
@_needs("hydra_plugins.hydra_submitit_launcher")
def test_submitit_launchers_compose_and_the_local_one_runs(tmp_path):
    from hydra import compose, initialize_config_dir

    from conftest import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        slurm = compose("train", overrides=["hydra/launcher=submitit_slurm"], return_hydra_config=True)
    assert slurm.hydra.launcher._target_.endswith("SlurmLauncher")
    command = ["-m", "hydra/launcher=submitit_local", "optimizer.lr=0.01", "trainer.max_epochs=1",
               f"hydra.sweep.dir={tmp_path}"]
    proc = run_cli(command, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    first = json.loads((tmp_path / "sweep_summary.json").read_text())["jobs"][0]
    assert first["value"] < 0.1
    # A requeued job is the same job run again in the same job directory: it resumes there
    # (trainer.resume=auto) instead of starting over, and reports the same metric.
    proc = run_cli(command, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / first["dir"] / "train.log").read_text()
    assert "resuming from" in log and "nothing to train" in log
    assert json.loads((tmp_path / "sweep_summary.json").read_text())["jobs"][0]["value"] == first["value"]


def test_a_plain_run_keeps_hydras_callbacks_and_a_config_that_sets_multirun_sweeps(tmp_path):
    """A command line of overrides only is run from one composition (config/__init__.py), not by
    @hydra.main: the hydra.callbacks a user adds still hear the run's hooks in Hydra's order, and
    a config whose hydra.mode is MULTIRUN is still swept without -m."""
    (tmp_path / "heard.py").write_text(
        "from hydra.experimental.callback import Callback\n"
        "class Heard(Callback):\n"
        "    def __getattribute__(self, hook):\n"
        "        if hook.startswith('on_'):\n"
        "            with open('hooks.txt', 'a') as out:\n"
        "                out.write(hook + '\\n')\n"
        "        return object.__getattribute__(self, hook)\n")
    ok(run_cli(["+hydra.callbacks.heard._target_=heard.Heard", "trainer.max_steps=2", f"hydra.run.dir={tmp_path / 'run'}"],
               cwd=tmp_path))
    assert (tmp_path / "hooks.txt").read_text().split() == ["on_run_start", "on_job_start", "on_job_end", "on_run_end"]
    assert OmegaConf.load(tmp_path / "run" / ".hydra" / "hydra.yaml").hydra.overrides.hydra[-1] == "hydra.mode=RUN"
    ok(run_cli(["hydra.mode=MULTIRUN", "optimizer.lr=0.01,0.02", "trainer.max_steps=2", f"hydra.sweep.dir={tmp_path / 'sweep'}"],
               cwd=tmp_path))
    assert len(_job_dirs(tmp_path / "sweep")) == 2
