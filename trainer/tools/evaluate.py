"""A trained model's metrics on a split: `ringtrain evaluate checkpoint=...`; README.md "Using
what you trained" and conf/evaluate.yaml (`ringtrain evaluate --help`) hold examples and settings.

lightning-hydra-template's eval.py for ringtrain: no optimizer, no training. The job is composed
from the checkpoint's recorded choices and overrides (config/recipe.py: the run's command line is
not needed, and a file never chooses code) and the command line's, which change it as they would
training's; the data, model and task are then checked like training's (config/builders.py): a
mistake is one `error:` line, exit 2, before any data is built. The run's relative paths were
recorded absolute, so its own text is read wherever this runs; a data.path given now is read from
the current directory. The run's own strategy is not reused (strategy=auto).

The metrics are computed exactly as the loop's validation: the split sharded over the ranks
without padding, per-batch sums and counts all-reduced (data/tasks.py), autocast per
trainer.precision, trainer.limit_val_batches=K one process's first K batches shared among the
ranks; so the checkpoint gives the val/loss the run logged at that step, for any number of
ranks. Rank 0 prints one `name=value` line per metric and writes the output file: {"checkpoint",
"step", "split", "strategy", "overrides", "output", "world_size", "metrics"}.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ringtrain.storage.atomic import json_text, write_text_atomically
from ringtrain.checkpoints.files import load_checkpoint
from ringtrain.checkpoints.manager import Resumed
from ringtrain.components import build
from ringtrain.config.app import CommandLine, PrimaryConfig
from ringtrain.config.builders import build_data, check_data, check_model, check_task
from ringtrain.config.schema import SECTIONS, TrainerConfig, build_strategy, check_options, typed_section
from ringtrain.data.bundle import DataBundle
from ringtrain.data.vocab import same_ids
from ringtrain.distributed import exit_rank, teardown_distributed, under_torchrun
from ringtrain.errors import ConfigError
from ringtrain.loop.evaluation import evaluate_parts
from ringtrain.loop.loaders import build_val_loader, worker_options
from ringtrain.loop.precision import Precision
from ringtrain.strategies.base import Strategy
from ringtrain.tools.app import prepare, run_tool  # noqa: F401  (prepare: the entry's, ringtrain/__main__.py)
from ringtrain.tools.checkpoint_model import read_checkpoint, rebuild_model

_UNUSED = "evaluation trains nothing, so the {} is not used: drop the override"
EVALUATE = PrimaryConfig(
    "evaluate", "ringtrain evaluate", usage="ringtrain evaluate checkpoint=<run>/checkpoints/last.pt",
)


@dataclass
class EvalJob:
    """Everything a rank needs, plain and picklable (it travels to spawned ranks)."""

    checkpoint: Resumed  # the file, read once per process (a spawned rank reads its own)
    split: str
    job: dict  # the composed job's sections
    data_dims: dict
    vocab: dict | None
    trainer: TrainerConfig
    strategy: Strategy
    weights: str  # model, or a callback's (ema)
    trusted: bool


def evaluate(checkpoint: str, split: Literal["val", "train"], output: str | None, job: dict, command: CommandLine,
             weights: str = "model", trust_checkpoint: bool = False) -> tuple[dict, EvalResult | None]:
    """Evaluate `checkpoint` as conf/evaluate.yaml composed says (`job`: the job's sections, its
    recipe replayed); return what the metrics file records and rank 0's result (None on the
    other ranks)."""
    from hydra.core.hydra_config import HydraConfig

    for override in command.overrides:
        if (section := override.lstrip("+~").split("=", 1)[0].split(".")[0]) in ("optimizer", "scheduler"):
            raise ConfigError(_UNUSED.format(section))
    state = read_checkpoint(checkpoint, command.checkpoint)
    strategy_name = str(HydraConfig.get().runtime.choices.get("strategy"))
    if strategy_name == "auto":  # the option it stands for
        strategy_name = "ddp" if under_torchrun() else "single"
    eval_job, record = plan(checkpoint, state, split, output, job, strategy_name, weights, trust_checkpoint)
    record["overrides"] = section_overrides(command.overrides)
    result = launch(eval_job)
    if result is not None:
        write_metrics(Path(record["output"]), {**record, "world_size": result.world_size, "metrics": result.metrics})
    return record, result


def plan(checkpoint: str, state: dict, split: str, output: str | None, job: dict, strategy_name: str,
         weights: str = "model", trusted: bool = False) -> tuple[EvalJob, dict[str, Any]]:
    """Check the settings; return the job and what the metrics file records of it."""
    # The run's trainer settings (precision, val_batch_size, ...), but never its resume file
    # nor its starting weights: the checkpoint's own weights are evaluated.
    trainer_settings = typed_section({**job["trainer"], "resume": None, "init_from": None}, TrainerConfig, "trainer")
    strategy = evaluation_strategy(job["strategy"], strategy_name)
    check_options(trainer_settings, strategy)
    check_model(job["model"], check_data(job["data"]), "the data")
    check_task(build(job["task"], "task"))

    eval_job = EvalJob(
        checkpoint=Resumed(Path(checkpoint).absolute(), state), split=split, job=job,
        data_dims=dict(state.get("data_dims") or {}), vocab=state.get("vocab"),
        trainer=trainer_settings, strategy=strategy, weights=weights, trusted=trusted,
    )
    metrics_file = Path(output) if output else default_output(checkpoint, split, weights)
    record = {
        "checkpoint": str(eval_job.checkpoint.path), "step": (state.get("progress") or {}).get("step"), "weights": weights,
        "split": split, "strategy": strategy_name, "overrides": [], "output": str(metrics_file),
    }
    return eval_job, record


def default_output(checkpoint: str, split: str, weights: str = "model") -> Path:
    """<run dir>/eval/<checkpoint>-<split>.json, or <checkpoint>-<weights>-<split>.json for
    weights other than the model's own (ema): evaluating the train split, best.pt after last.pt,
    or the EMA average after the weights, writes a file of its own (one eval/metrics.json for
    all lost the earlier result)."""
    path = Path(checkpoint).absolute()
    which = "" if weights == "model" else f"-{weights}"
    return path.parent.parent / "eval" / f"{path.stem}{which}-{split}.json"


def evaluation_strategy(section: dict, name: str) -> Strategy:
    """The strategy of strategy=auto|single|dp|ddp|fsdp with its keys (strategy.nproc_per_node=2)."""
    strategy = build_strategy(section)
    if under_torchrun() and not strategy.spans_processes:
        raise ConfigError(f"strategy={name} under torchrun would evaluate on every rank alone; use strategy=ddp (or auto)")
    return strategy


def section_overrides(overrides: Sequence[str]) -> list[str]:
    """The command line's changes of the job (data.path=..., +data.x=1, ~data.x,
    strategy.nproc_per_node=2), for metrics.json."""
    keys = [override.split("=", 1)[0].lstrip("+~") for override in overrides]
    return [o for o, key in zip(overrides, keys) if "." in key and key.split(".")[0] in (*SECTIONS, "adapter")]


def register_auto_strategy() -> None:
    """strategy=auto, evaluate's default: the option ddp under torchrun, else single."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(group="strategy", name="auto",
                                 node={"defaults": ["ddp" if under_torchrun() else "single", "_self_"]})


@dataclass
class EvalResult:
    metrics: dict[str, float]  # e.g. {"val/loss": 1.47}
    world_size: int  # ranks that shared the split


def evaluate_worker(job: EvalJob) -> EvalResult:
    """One rank's part: build the data, task and model, evaluate, all-reduce."""
    dist = job.strategy.setup_process(job.trainer.accelerator)
    clean_exit = False
    try:
        data = build_data(job.job["data"], dist)
        check_data_fits(data, job)
        dataset = data.val if job.split == "val" else data.train
        named = data.val_sources if job.split == "val" and data.val_sources else {"": dataset}  # a mixture's sources
        for name, part in named.items():
            if len(part) < dist.world_size:
                raise ConfigError(
                    f"the {job.split} split{f' of {name}' if name else ''} has {len(part)} samples but "
                    f"{dist.world_size} processes need at least one each; use fewer processes"
                )
        task = check_task(build(job.job["task"], "task"))
        state = job.checkpoint.state if job.checkpoint.state is not None else load_checkpoint(job.checkpoint.path, mmap=True)
        model = rebuild_model(state, str(job.checkpoint.path), job.job, job.weights, job.trusted).to(dist.device)
        del state
        cfg = job.trainer
        loaders = {name: build_val_loader(
            part, cfg.val_batch_size or cfg.batch_size, dist.rank, dist.world_size, dist.device,
            limit_batches=cfg.limit_val_batches, workers=worker_options(cfg, dist.device),
        ) for name, part in named.items()}
        sums = evaluate_parts(model, loaders, task, Precision(cfg.precision, dist.device), dist, job.strategy)
        clean_exit = True
        return EvalResult({f"{job.split}/{name}": value for name, value in sums.items()}, dist.world_size)
    finally:
        teardown_distributed(clean_exit)


def check_data_fits(data: DataBundle, job: EvalJob) -> None:
    """The data must be what the model was trained on in kind: the same sizes and vocabulary."""
    for name, value in data.dims.items():
        trained = job.data_dims.get(name)
        if value is not None and trained is not None and value != trained:
            raise ConfigError(
                f"the data gives {name}={value} but the checkpoint's model was trained with {name}={trained}; "
                f"evaluate on data of the same kind"
            )
    if data.vocab is not None and job.vocab is not None and not same_ids(data.vocab, job.vocab):
        raise ConfigError(
            "the data's vocabulary differs from the one the model was trained with (same size, other "
            "characters or order), so its ids mean other things; evaluate on text with the same characters"
        )


def launch(job: EvalJob) -> EvalResult | None:
    """The result on rank 0 (None on the other ranks of a torchrun job)."""
    result = job.strategy.launch(evaluate_worker, job, accelerator=job.trainer.accelerator)
    return result if int(os.environ.get("RANK", "0")) == 0 else None


def write_metrics(path: Path, record: dict) -> None:
    """metrics.json, replaced atomically (a reader never sees half a file)."""
    try:
        write_text_atomically(path, json_text(record, indent=2) + "\n")  # a NaN metric as null
    except OSError as err:
        raise ConfigError(f"cannot write {path} ({err.strerror or err}); pass output=<a writable file>") from None


def show(evaluated: tuple[dict, EvalResult | None]) -> None:
    record, result = evaluated
    if result is not None:
        for name, value in result.metrics.items():
            print(f"{name}={value:.6g}")
        weights = "" if record["weights"] == "model" else f", weights={record['weights']}"
        print(f"evaluated {record['checkpoint']} (step {record['step']}{weights}); metrics in {record['output']}",
              file=sys.stderr)


def main(command: CommandLine) -> None:
    register_auto_strategy()
    run_tool(EVALUATE, evaluate, command, show)
    if under_torchrun():  # as training: leave without the interpreter's finalisation (gloo threads)
        exit_rank(0)


if __name__ == "__main__":
    from ringtrain.__main__ import main as entry

    entry("evaluate")
