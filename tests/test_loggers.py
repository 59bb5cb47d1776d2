"""The loggers of the `logger` group (ringtrain/loggers/), each driven through its interface by
one small fake run and read back with its own library's reader: TensorBoard's event reader,
Python's csv module, W&B's records in the offline run file, MLflow's client on the local store.
Each finds the same hyperparameters, every step and the same final metrics.

Then real runs through the loop's Loggers callback (trainer/callbacks/loggers.py): one run with
logger=[tensorboard,csv,wandb,mlflow] and a 2x2 multirun, every logger read back the same way;
a logger whose library is missing; runs that fail before, while or after the loggers start."""
from __future__ import annotations

import csv
import importlib.util
import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.utils import instantiate
from omegaconf import OmegaConf

from conftest import CONF_DIR, compose_config, run_cli, train_in_process
from helpers import ok
from ringtrain.callbacks import Callback
from ringtrain.errors import ConfigError, UserError
from ringtrain.loggers import Logger, import_extra
from ringtrain.loggers.csv import CSVLogger
from ringtrain.loggers.mlflow import MLflowLogger
from ringtrain.loggers.tensorboard import TensorBoardLogger
from ringtrain.loggers.wandb import WandbLogger

CONFIG = {
    "model": {"_target_": "ringtrain.models.mlp.MLP", "hidden": [32, 16], "dropout": 0.5},
    "optimizer": {"lr": 0.25},
    "trainer": {"max_steps": 3, "compile": False, "resume": None},
}
# CONFIG flattened: the hyperparameters as text, as CSV and MLflow keep them.
HPARAMS = {
    "model._target_": "ringtrain.models.mlp.MLP", "model.hidden": "[32, 16]", "model.dropout": "0.5",
    "optimizer.lr": "0.25", "trainer.max_steps": "3", "trainer.compile": "False", "trainer.resume": "None",
}
# One call per entry: a step's validation metrics come in a second call, and val/loss first
# appears at step 2, val/accuracy at step 3. Binary fractions: float32 (TensorBoard) keeps them exactly.
CALLS = [
    (1, {"train/loss": 2.0, "lr": 0.25}),
    (2, {"train/loss": 1.5, "lr": 0.25}), (2, {"val/loss": 0.5}),
    (3, {"train/loss": 1.0, "lr": 0.125}), (3, {"val/loss": 0.75, "val/accuracy": 0.5}),
]
HISTORY = {
    "train/loss": {1: 2.0, 2: 1.5, 3: 1.0}, "lr": {1: 0.25, 2: 0.25, 3: 0.125},
    "val/loss": {2: 0.5, 3: 0.75}, "val/accuracy": {3: 0.5},
}
SUMMARY = {"final": {"val/loss": 0.75, "val/accuracy": 0.5}, "best": {"val/loss": 0.5}, "steps": 3,
           "train_seconds": 1.5}
FINAL = {"final/val/loss": 0.75, "final/val/accuracy": 0.5, "best/val/loss": 0.5}

# sqlalchemy's, about MLflow's store (Python shows it under pytest, not in a run).
pytestmark = pytest.mark.filterwarnings("ignore:The ``noload`` loader strategy is deprecated")

needs_wandb = pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                                 reason="wandb is not installed (pip install -e '.[wandb]')")
needs_mlflow = pytest.mark.skipif(importlib.util.find_spec("mlflow") is None,
                                  reason="mlflow is not installed (pip install -e '.[mlflow]')")


def fake_run(logger, run_dir: Path, name: str = "job0", group: str | None = None, status: str = "completed") -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    logger.start(run_dir, name, group, CONFIG)
    for step, metrics in CALLS:
        logger.log_metrics(metrics, step)
    logger.finish(SUMMARY, status)


def sqlite_uri(directory: Path) -> str:
    return f"sqlite:///{directory / 'mlflow.db'}"


@pytest.fixture(scope="module")
def new_mlflow_store(tmp_path_factory) -> Path:
    """An MLflow store with its tables made: each test copies it, as making them takes seconds."""
    import mlflow

    directory = tmp_path_factory.mktemp("mlflow")
    mlflow.MlflowClient(sqlite_uri(directory)).search_experiments()
    return directory / "mlflow.db"


@pytest.fixture
def mlflow_uri(new_mlflow_store, tmp_path) -> str:
    """The tracking URI of this test's own store."""
    shutil.copy(new_mlflow_store, tmp_path / "mlflow.db")
    return sqlite_uri(tmp_path)


def mlflow_runs(tracking_uri: str, experiment: str) -> list:
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


@pytest.fixture(autouse=True)
def libraries_kept_to_the_test(tmp_path, monkeypatch):
    """W&B's settings and caches go to the test's directory, not the user's home; MLflow sends
    no usage telemetry."""
    for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(variable, str(tmp_path / "wandb_home"))
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")


# --- TensorBoard ---------------------------------------------------------------------------

def test_tensorboard_event_file_holds_every_step_the_config_and_the_hparams_session(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    fake_run(TensorBoardLogger(), tmp_path)
    assert len(list(tmp_path.glob("events.out.tfevents.*"))) == 1  # directly in the run directory

    events = EventAccumulator(str(tmp_path)).Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    assert {tag: values for tag, values in scalars.items() if not tag.startswith("final/")} == HISTORY
    # TensorBoard gets the final metrics only, as `final/<name>` at the last step (no best/).
    assert {tag: values for tag, values in scalars.items() if tag.startswith("final/")} == {
        tag: {3: value} for tag, value in FINAL.items() if tag.startswith("final/")}

    text = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert json.loads(text.strip("`\n")) == CONFIG

    hparams = events.PluginTagToContent("hparams")
    assert set(hparams) == {"_hparams_/session_start_info", "_hparams_/session_end_info"}
    start = plugin_data_pb2.HParamsPluginData.FromString(hparams["_hparams_/session_start_info"])
    chosen = {}
    for key, value in start.session_start_info.hparams.items():
        kind = value.WhichOneof("kind")
        chosen[key] = f"{value.number_value:g}" if kind == "number_value" else str(getattr(value, kind))
    assert chosen == {**HPARAMS, "trainer.compile": "0"}  # torch's hparams() writes a bool as a number


# --- CSV -----------------------------------------------------------------------------------

def _read_csv(path: Path) -> list[dict]:
    with path.open(newline="") as file:
        return list(csv.DictReader(file))


def _pairs(path: Path) -> dict[str, str]:
    return {row["name"]: row["value"] for row in _read_csv(path)}


def test_csv_files_hold_a_row_per_step_a_column_per_metric_the_hparams_and_the_summary(tmp_path):
    fake_run(CSVLogger(), tmp_path, status="stopped")

    rows = _read_csv(tmp_path / "metrics.csv")
    assert list(rows[0]) == ["step", "train/loss", "lr", "val/loss", "val/accuracy"]
    assert [row["step"] for row in rows] == ["1", "2", "3"]  # one row per step, from two calls
    assert rows[0]["val/loss"] == rows[1]["val/accuracy"] == ""  # the file was rewritten for each new column
    history = {name: {int(row["step"]): float(row[name]) for row in rows if row[name]} for name in HISTORY}
    assert history == HISTORY

    assert _pairs(tmp_path / "hparams.csv") == HPARAMS
    summary = _pairs(tmp_path / "summary.csv")
    assert {name: float(summary[name]) for name in FINAL} == FINAL
    assert (summary["status"], summary["steps"], summary["train_seconds"]) == ("stopped", "3", "1.5")


def test_csv_logger_of_a_resumed_run_appends_to_its_metrics_csv(tmp_path):
    fake_run(CSVLogger(), tmp_path)
    before = _read_csv(tmp_path / "metrics.csv")

    resumed = CSVLogger()
    resumed.start(tmp_path, "job0", None, CONFIG)
    resumed.log_metrics({"train/loss": 0.5}, 4)
    resumed.finish({**SUMMARY, "steps": 4}, "completed")

    rows = _read_csv(tmp_path / "metrics.csv")
    assert rows[:3] == before
    assert rows[3] == {"step": "4", "train/loss": "0.5", "lr": "", "val/loss": "", "val/accuracy": ""}


# --- Weights & Biases ------------------------------------------------------------------------

def wandb_records(run_dir: Path) -> list:
    """The records of the one offline run under `run_dir`, as `wandb sync` reads them: the .wandb
    file is W&B's protobuf Records in LevelDB's log format (a 7-byte file header, then 32 KiB
    blocks of chunks, each with a 7-byte header: checksum, length, type)."""
    import wandb
    from wandb.proto import wandb_internal_pb2

    # run.finish() can return before W&B's service has written the file (wandb 0.31); ending the
    # service writes it. Outside tests the process's exit does the same.
    wandb.teardown()
    [path] = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, records, pending, position = 32768, [], b"", 7
    while position + 7 <= len(data):
        left_in_block = block - position % block
        length, kind = struct.unpack("<HB", data[position + 4:position + 7])
        if left_in_block < 7 or (length, kind) == (0, 0):  # the block's zero padding
            position += left_in_block
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            records.append(wandb_internal_pb2.Record.FromString(pending))
            pending = b""
    return records


def _wandb_values(items) -> dict:
    """A history or summary record's items by name; a name with "/" is kept whole (nested_key)."""
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items}


def wandb_run(run_dir: Path) -> dict:
    """What the offline run holds: its run record, config, history by step, summary, exit code."""
    records = wandb_records(run_dir)
    run = next(r.run for r in records if r.HasField("run"))
    config = _wandb_values(run.config.update)
    history, summary = {}, {}
    for record in records:
        kind = record.WhichOneof("record_type")
        if kind == "config":
            config.update(_wandb_values(record.config.update))
        elif kind == "history":
            for name, value in _wandb_values(record.history.item).items():
                if not name.startswith("_"):
                    history.setdefault(name, {})[record.history.step.num] = value
        elif kind == "summary":
            summary.update(_wandb_values(record.summary.update))
    config.pop("_wandb")
    exit_code = next(r.exit.exit_code for r in records if r.HasField("exit"))
    return {"run": run, "config": config, "history": history, "summary": summary, "exit_code": exit_code}


@needs_wandb
@pytest.mark.parametrize("status, exit_code", [("stopped", 0), ("failed", 1)])  # W&B marks exit code != 0 failed
def test_wandb_offline_run_holds_the_nested_config_every_step_and_the_summary(tmp_path, status, exit_code):
    fake_run(WandbLogger(project="demo", tags=["smoke"]), tmp_path, name="job0", status=status)

    found = wandb_run(tmp_path)
    run = found["run"]
    assert (run.project, run.display_name, run.run_group, list(run.tags)) == ("demo", "job0", "", ["smoke"])
    assert found["config"] == CONFIG  # nested, lists as lists
    assert found["history"] == HISTORY
    assert {name: found["summary"][name] for name in FINAL} == FINAL
    assert (found["summary"]["steps"], found["summary"]["status"], found["exit_code"]) == (3, status, exit_code)


# --- MLflow --------------------------------------------------------------------------------

@needs_mlflow
def test_mlflow_store_holds_the_flat_params_every_step_the_final_metrics_and_the_status(tmp_path, mlflow_uri):
    import mlflow

    fake_run(MLflowLogger(tracking_uri=mlflow_uri), tmp_path / "run", name="job0")

    client = mlflow.MlflowClient(mlflow_uri)
    [run] = client.search_runs([client.get_experiment_by_name("ringtrain").experiment_id])
    assert (run.info.run_name, run.info.status) == ("job0", "FINISHED")
    assert run.data.params == HPARAMS
    assert {name: run.data.metrics[name] for name in FINAL} == FINAL
    history = {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)} for name in HISTORY}
    assert history == HISTORY
    assert client.get_metric_history(run.info.run_id, "final/val/loss")[0].step == 3


@needs_mlflow
def test_mlflow_run_status_follows_how_the_run_ended(tmp_path, mlflow_uri):
    for status in ("completed", "stopped", "failed"):
        fake_run(MLflowLogger(tracking_uri=mlflow_uri), tmp_path / status, name=status, status=status)
    runs = mlflow_runs(mlflow_uri, "ringtrain")
    assert {run.info.run_name: run.info.status for run in runs} == {
        "completed": "FINISHED", "stopped": "KILLED", "failed": "FAILED"}


@needs_mlflow
def test_mlflow_param_longer_than_mlflows_limit_is_cut_to_fit(tmp_path, mlflow_uri):
    from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

    logger = MLflowLogger(tracking_uri=mlflow_uri)
    logger.start(tmp_path, "job0", None, {"data": {"files": ["part.bin"] * 2000}})
    logger.finish({"final": {}, "best": None, "steps": 0}, "failed")
    [run] = mlflow_runs(mlflow_uri, "ringtrain")
    assert run.data.params["data.files"] == str(["part.bin"] * 2000)[:MAX_PARAM_VAL_LENGTH]


@needs_mlflow
def test_mlflow_jobs_starting_together_on_a_new_store_both_log_their_run(tmp_path):
    # Two processes, as a parallel sweep's jobs (joblib launcher): both make the new store's tables
    # and the experiment; without the lock one fails ("table runs already exists", "duplicate column name").
    job = ("import sys; from pathlib import Path; from ringtrain.loggers.mlflow import MLflowLogger; "
           "logger = MLflowLogger(tracking_uri=sys.argv[1]); "
           "logger.start(Path(sys.argv[2]), sys.argv[2], 'sweep-a', {}); "
           "logger.finish({'final': {'val/loss': 1.0}, 'steps': 1}, 'completed')")
    jobs = [subprocess.Popen([sys.executable, "-c", job, sqlite_uri(tmp_path), name], cwd=tmp_path,
                             stderr=subprocess.PIPE, text=True) for name in ("job0", "job1")]
    for process in jobs:
        _, errors = process.communicate(timeout=120)
        assert process.returncode == 0, errors[-3000:]
    assert sorted(run.info.run_name for run in mlflow_runs(sqlite_uri(tmp_path), "sweep-a")) == ["job0", "job1"]


# --- A sweep's jobs ------------------------------------------------------------------------

def _tensorboard_runs(sweep: Path) -> list[str]:
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer

    return sorted(EventMultiplexer().AddRunsFromDirectory(str(sweep)).Runs())  # as `tensorboard --logdir` finds them


def _csv_runs(sweep: Path) -> list[str]:
    """The jobs whose metrics.csv holds its own three steps, none of the other job's."""
    return sorted(path.parent.name for path in sweep.glob("*/metrics.csv") if len(_read_csv(path)) == 3)


def _wandb_runs(sweep: Path) -> list[str]:
    runs = [wandb_run(job)["run"] for job in sweep.iterdir()]
    assert {run.run_group for run in runs} == {"sweep-a"} and len({run.run_id for run in runs}) == 2
    return sorted(run.display_name for run in runs)


def _mlflow_runs(sweep: Path) -> list[str]:
    runs = mlflow_runs(sqlite_uri(sweep.parent), "sweep-a")  # the store of fixture mlflow_uri
    assert {run.data.tags["ringtrain.group"] for run in runs} == {"sweep-a"}
    return sorted(run.info.run_name for run in runs)


@pytest.mark.parametrize("build, runs_in", [
    (lambda request: TensorBoardLogger(), _tensorboard_runs),
    (lambda request: CSVLogger(), _csv_runs),
    pytest.param(lambda request: WandbLogger(), _wandb_runs, marks=needs_wandb),
    pytest.param(lambda request: MLflowLogger(tracking_uri=request.getfixturevalue("mlflow_uri")), _mlflow_runs,
                 marks=needs_mlflow),
], ids=["tensorboard", "csv", "wandb", "mlflow"])
def test_two_jobs_of_a_sweep_become_two_runs_of_its_group(request, tmp_path, build, runs_in):
    for job in ("job0", "job1"):
        fake_run(build(request), tmp_path / "sweep" / job, name=job, group="sweep-a")
    assert runs_in(tmp_path / "sweep") == ["job0", "job1"]


# --- Choosing a logger -----------------------------------------------------------------------

@pytest.mark.parametrize("logger_class, package", [(WandbLogger, "wandb"), (MLflowLogger, "mlflow")])
def test_a_logger_whose_library_is_missing_says_which_extra_installs_it(monkeypatch, logger_class, package):
    monkeypatch.setitem(sys.modules, package, None)  # `import <package>` fails as if not installed
    with pytest.raises(ConfigError) as raised:
        logger_class()
    assert str(raised.value) == f"logger.{package} needs the {package} package: pip install 'ringtrain[{package}]'"


def test_a_library_that_fails_on_a_missing_dependency_reports_that_dependency(tmp_path, monkeypatch):
    (tmp_path / "half_installed.py").write_text("import a_dependency_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="half_installed is installed but importing it failed "
                                          "\\(ModuleNotFoundError: No module named 'a_dependency_not_installed'\\)"):
        import_extra("half_installed")


@needs_wandb
def test_wandb_mode_other_than_offline_online_disabled_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^logger.wandb.mode=offlin is not one of offline, online, disabled$"):
        WandbLogger(mode="offlin")


@needs_wandb
@needs_mlflow
def test_each_logger_config_builds_its_logger_under_its_own_name():
    built = {}
    for path in sorted((CONF_DIR / "logger").glob("*.yaml")):
        [(name, node)] = OmegaConf.load(path).items()  # one named entry: logger=[a,b] merges them
        assert name == path.stem
        built[name] = type(instantiate(node)).__name__
    assert built == {"csv": "CSVLogger", "mlflow": "MLflowLogger", "tensorboard": "TensorBoardLogger",
                     "wandb": "WandbLogger"}


# --- Real runs: the loop's Loggers callback feeding all four at once ---------------------------
# The tests above drive each logger through its interface; these train (trainer/callbacks/loggers.py
# wiring the `logger` group into the loop) and read every logger back with its own reader.

ALL_FOUR = "logger=[tensorboard,csv,wandb,mlflow]"
# Two logging steps, each with a validation; the final metrics are those of step 20.
RUN = ["trainer.max_steps=20", "trainer.log_every_n_steps=10", "trainer.eval_every_n_steps=10"]


def _expected(run_dir: Path, config: dict) -> tuple[dict, dict]:
    """What every logger must hold: the config flattened, and final/<metric> and best/<monitor>
    as the run's metrics.json has them."""
    from ringtrain.loggers import flatten

    metrics = json.loads((run_dir / "metrics.json").read_text())
    final = {f"final/{name}": value for name, value in metrics["final"].items()}
    return flatten(config), {**final, f"best/{metrics['monitor']}": metrics["best"]}


def _tensorboard_logged(run_dir: Path) -> tuple[dict, dict, dict]:
    """(hparams, final metrics at the last step, history) from the run's event file."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    events = EventAccumulator(str(run_dir)).Reload()
    scalars = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    content = events.PluginTagToContent("hparams")["_hparams_/session_start_info"]
    hparams = {}
    for key, value in plugin_data_pb2.HParamsPluginData.FromString(content).session_start_info.hparams.items():
        hparams[key] = getattr(value, value.WhichOneof("kind"))
    final = {tag: values for tag, values in scalars.items() if tag.startswith("final/")}
    history = {tag: values for tag, values in scalars.items() if not tag.startswith("final/")}
    return hparams, final, history


def _csv_logged(run_dir: Path) -> tuple[dict, dict, dict]:
    rows = _read_csv(run_dir / "metrics.csv")
    history = {name: {int(row["step"]): float(row[name]) for row in rows if row[name]}
               for name in rows[0] if name != "step"}
    return _pairs(run_dir / "hparams.csv"), _pairs(run_dir / "summary.csv"), history


def _mlflow_logged(tracking_uri: str, run_dir: Path) -> tuple[dict, dict, dict, object]:
    """(params, metrics, history, the run) of the MLflow run whose ringtrain.run_dir is `run_dir`."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri)
    [run] = client.search_runs([e.experiment_id for e in client.search_experiments()],
                               filter_string=f"tags.`ringtrain.run_dir` = '{run_dir}'")
    history = {name: {m.step: m.value for m in client.get_metric_history(run.info.run_id, name)}
               for name in run.data.metrics if not name.startswith(("final/", "best/"))}
    return run.data.params, run.data.metrics, history, run


def _assert_each_logger_holds(run_dir: Path, config: dict, tracking_uri: str) -> None:
    """The same hyperparameters, final metrics and logged history in all four loggers."""
    from ringtrain.loggers import flatten

    hparams, final = _expected(run_dir, config)
    as_text = {key: str(value) for key, value in hparams.items()}

    csv_hparams, csv_summary, history = _csv_logged(run_dir)  # the history the others must equal
    assert set(history) >= {"train/loss", "lr", "val/loss"} and set(history["val/loss"]) == {10, 20}
    assert csv_hparams == as_text
    assert {name: float(csv_summary[name]) for name in final} == final

    tb_hparams, tb_final, tb_history = _tensorboard_logged(run_dir)
    # torch's hparams(): numbers (bools too) as numbers, the rest as text.
    assert tb_hparams == {key: float(v) if isinstance(v, (bool, int, float)) else v for key, v in hparams.items()}
    assert tb_final == {name: {20: pytest.approx(value, rel=1e-6)} for name, value in final.items()
                        if name.startswith("final/")}  # TensorBoard keeps no best/
    assert tb_history == {name: {step: pytest.approx(v, rel=1e-6) for step, v in values.items()}  # float32
                          for name, values in history.items()}

    found = wandb_run(run_dir)
    assert flatten(found["config"]) == hparams  # nested in W&B, the same values
    assert {name: found["summary"][name] for name in final} == final
    assert found["history"] == history
    assert (found["summary"]["status"], found["exit_code"]) == ("completed", 0)

    params, metrics, mlflow_history, run = _mlflow_logged(tracking_uri, run_dir)
    assert params == as_text
    assert {name: metrics[name] for name in final} == final
    assert mlflow_history == history
    assert run.info.status == "FINISHED"


@needs_wandb
@needs_mlflow
def test_a_run_with_all_four_loggers_finds_the_same_hparams_and_final_metrics_in_each(tmp_path, mlflow_uri):
    overrides = [ALL_FOUR, f"logger.mlflow.tracking_uri={mlflow_uri}", "model=mlp", "data.num_features=8",
                 "data.num_samples=256", "data.num_val_samples=64", "model.hidden_sizes=[8]", *RUN]
    run_dir = tmp_path / "run"
    train_in_process(overrides, run_dir)
    config = OmegaConf.to_container(compose_config(overrides), resolve=True)
    config.pop("hydra", None)
    _assert_each_logger_holds(run_dir, config, mlflow_uri)
    # A single run: no group; MLflow's experiment is "ringtrain", W&B's run has no group.
    _, _, _, run = _mlflow_logged(mlflow_uri, run_dir)
    assert run.info.run_name == "run" and "ringtrain.group" not in run.data.tags
    assert wandb_run(run_dir)["run"].run_group == ""


@needs_wandb
@needs_mlflow
def test_a_resumed_run_continues_its_wandb_and_mlflow_runs_and_an_early_stop_finishes(tmp_path, mlflow_uri):
    """The checkpoint keeps each logger's run id (plain data): the same command continued after
    its first 10 steps logs to the same MLflow run (one run, every validation, FINISHED) and the
    same W&B run id (each part an offline run that `wandb sync` adds to it). An early-stopped run
    is FINISHED, not KILLED."""
    import mlflow
    import wandb

    small = ["logger=[wandb,mlflow]", f"logger.mlflow.tracking_uri={mlflow_uri}", "model=mlp", "data.num_features=8",
             "data.num_samples=256", "data.num_val_samples=64", "model.hidden_sizes=[8]", "trainer.eval_every_n_steps=5"]
    train_in_process(small + ["trainer.max_steps=10"], tmp_path / "run")
    train_in_process(small + ["trainer.max_steps=20"], tmp_path / "run")
    wandb.teardown()
    [run] = mlflow_runs(mlflow_uri, "ringtrain")
    history = mlflow.MlflowClient(mlflow_uri).get_metric_history(run.info.run_id, "val/loss")
    assert sorted(m.step for m in history) == [5, 10, 15, 20] and run.info.status == "FINISHED"
    assert run.data.params["trainer.max_steps"] == "10"  # MLflow keeps a param's first value
    parts = sorted(path.name for path in (tmp_path / "run").glob("wandb/offline-run-*/run-*.wandb"))
    assert len(parts) == 2 and parts[0] == parts[1]  # run-<the same id>.wandb

    result = train_in_process(small + ["callbacks=[default,early_stopping]", "callbacks.early_stopping.patience=1",
                                       "callbacks.early_stopping.min_delta=1e9", "trainer.max_steps=20"],
                              tmp_path / "early")
    assert result.stop_kind == "requested" and result.steps == 10
    _, _, _, early = _mlflow_logged(mlflow_uri, tmp_path / "early")
    assert early.info.status == "FINISHED"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, new_mlflow_store) -> Path:
    """`-m optimizer.lr=0.01,0.02 trainer.seed=1,2` with all four loggers, as a user starts it:
    MLflow's store is the default sqlite:///outputs/mlflow.db under the directory it starts in."""
    root = tmp_path_factory.mktemp("multirun")
    (root / "outputs").mkdir()
    shutil.copy(new_mlflow_store, root / "outputs" / "mlflow.db")
    with pytest.MonkeyPatch.context() as patch:
        for variable in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            patch.setenv(variable, str(root / "wandb_home"))
        patch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
        ok(run_cli(["-m", "optimizer.lr=0.01,0.02", "trainer.seed=1,2", ALL_FOUR, *RUN,
                    f"hydra.sweep.dir={root / 'sweep'}"], cwd=root))
    return root / "sweep"


def _sweep_jobs(sweep: Path) -> dict[str, tuple[float, int]]:
    """Each job's directory name -> (optimizer.lr, trainer.seed), from its record (.hydra/)."""
    jobs = {}
    for job in sorted(p for p in sweep.iterdir() if p.is_dir()):
        config = OmegaConf.load(job / ".hydra" / "config.yaml")
        jobs[job.name] = (config.optimizer.lr, config.trainer.seed)
    return jobs


@pytest.mark.slow
@needs_wandb
@needs_mlflow
def test_a_2x2_multirun_gives_four_runs_in_each_logger(sweep):
    jobs = _sweep_jobs(sweep)
    assert sorted(jobs.values()) == [(0.01, 1), (0.01, 2), (0.02, 1), (0.02, 2)]
    names = sorted(jobs)
    uri = sqlite_uri(sweep.parent / "outputs")

    assert _tensorboard_runs(sweep) == names
    assert sorted(path.parent.name for path in sweep.glob("*/metrics.csv") if len(_read_csv(path)) == 2) == names
    runs = {job: wandb_run(sweep / job)["run"] for job in names}
    assert {run.run_group for run in runs.values()} == {"sweep"} and len({run.run_id for run in runs.values()}) == 4
    assert sorted(run.display_name for run in runs.values()) == names
    assert sorted(run.info.run_name for run in mlflow_runs(uri, "sweep")) == names  # the sweep's experiment

    # Each job's own lr and seed, and its own final metric, in every logger.
    for job, (lr, seed) in jobs.items():
        run_dir = sweep / job
        config = OmegaConf.to_container(OmegaConf.load(run_dir / ".hydra" / "config.yaml"), resolve=True)
        assert (config["optimizer"]["lr"], config["trainer"]["seed"]) == (lr, seed)
        _assert_each_logger_holds(run_dir, config, uri)
    finals = {json.loads((sweep / job / "metrics.json").read_text())["final"]["val/loss"] for job in names}
    assert len(finals) == 4  # four different runs, not one logged four times


@needs_mlflow
@pytest.mark.slow
def test_a_sweep_naming_the_mlflow_store_on_its_command_line_keeps_each_job_one_directory_under_it(
        tmp_path, new_mlflow_store):
    shutil.copy(new_mlflow_store, tmp_path / "mlflow.db")
    ok(run_cli(["-m", "trainer.seed=1,2", "logger=mlflow", f"logger.mlflow.tracking_uri={sqlite_uri(tmp_path)}",
                "trainer.max_steps=1", f"hydra.sweep.dir={tmp_path / 'sweep'}"], cwd=tmp_path))
    assert len(list((tmp_path / "sweep").glob("*/metrics.json"))) == 2
    assert len(json.loads((tmp_path / "sweep" / "sweep_summary.json").read_text())["jobs"]) == 2
    assert sorted(run.info.run_name[:2] for run in mlflow_runs(sqlite_uri(tmp_path), "sweep")) == ["0_", "1_"]


# --- Runs that fail: the error that stopped the run is the one reported ------------------------

class FailsAtStart(Callback):
    """A user's callback whose on_fit_start refuses the run (callbacks come before the loggers)."""

    def on_fit_start(self, run) -> None:
        raise ConfigError("callbacks.fails: this run's settings do not suit me")


class StoreCannotOpen(Logger):
    """A logger whose start fails, as a tracking store that cannot be opened does."""

    def start(self, run_dir, run_name, group, config) -> None:
        raise RuntimeError("the tracking store cannot be opened")

    def log_metrics(self, metrics, step) -> None:
        self.store.append(metrics)  # set by a start that never happened

    def finish(self, summary, status) -> None:
        self.store.close()


class FailsAtStep2(Callback):
    def on_step_end(self, run, step) -> None:
        if step.step == 2:
            raise RuntimeError("the run fails at step 2")


class CannotClose(Logger):
    """A logger that starts and logs but cannot write its end (a full disk, a lost server)."""

    def start(self, run_dir, run_name, group, config) -> None:
        pass

    def log_metrics(self, metrics, step) -> None:
        pass

    def finish(self, summary, status) -> None:
        raise OSError("no space left on device")


def test_a_run_refused_by_a_callback_before_the_loggers_start_reports_that_refusal(tmp_path):
    # The loggers were finished without having started: TensorBoard's AttributeError replaced this line.
    with pytest.raises(ConfigError, match="^callbacks.fails: this run's settings do not suit me$"):
        train_in_process(["logger=[tensorboard,csv]", "trainer.max_steps=2",
                          "+callbacks.fails._target_=test_loggers.FailsAtStart"], tmp_path / "run")


def test_a_logger_failing_to_start_fails_the_run_with_its_error_and_the_started_ones_record_it(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with pytest.raises(RuntimeError, match="^the tracking store cannot be opened$"):
        train_in_process(["logger=[csv,tensorboard]", "+logger.store._target_=test_loggers.StoreCannotOpen",
                          "trainer.max_steps=2"], tmp_path / "run")
    assert _pairs(tmp_path / "run" / "summary.csv")["status"] == "failed"
    hparams = EventAccumulator(str(tmp_path / "run")).Reload().PluginTagToContent("hparams")
    assert "_hparams_/session_end_info" in hparams  # TensorBoard's writer closed with the run's end


def test_a_logger_failing_to_record_a_failed_run_leaves_the_runs_own_error_and_the_others_closed(tmp_path, caplog):
    # The logger that cannot close comes first: the CSV logger after it still records the failure.
    with pytest.raises(RuntimeError, match="^the run fails at step 2$"):
        train_in_process(["logger=[]", "+logger.disk._target_=test_loggers.CannotClose",
                          "+logger.csv._target_=ringtrain.loggers.csv.CSVLogger", "trainer.max_steps=4",
                          "+callbacks.fails._target_=test_loggers.FailsAtStep2"], tmp_path / "run")
    assert _pairs(tmp_path / "run" / "summary.csv")["status"] == "failed"
    assert "logger.disk could not record the failed run" in caplog.text


@pytest.mark.parametrize("package", ["wandb", "mlflow"])
def test_a_run_choosing_a_logger_whose_library_is_missing_is_refused_in_one_line_naming_the_extra(
        tmp_path, monkeypatch, package):
    monkeypatch.setitem(sys.modules, package, None)  # `import <package>` fails as if not installed
    overrides = [f"logger=[tensorboard,{package}]", "trainer.max_steps=2"]
    if package == "mlflow":  # were it not refused, the store would be the test's own
        overrides.append(f"logger.mlflow.tracking_uri={sqlite_uri(tmp_path)}")
    with pytest.raises(UserError) as raised:
        train_in_process(overrides, tmp_path / "run")
    assert str(raised.value) == f"logger.{package} needs the {package} package: pip install 'ringtrain[{package}]'"
    assert not (tmp_path / "run").exists()  # refused before training: nothing left behind
    assert not (tmp_path / "mlflow.db").exists()
