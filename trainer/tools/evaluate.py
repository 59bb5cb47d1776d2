"""A trained model's metrics on a split: `ringtrain evaluate checkpoint=...` (README.md "Using
what you trained"; settings: conf/evaluate.yaml). No optimizer, no training: the composed job's
data, model and task are checked as training's before any data is built, on the tool's own
strategy (strategy=auto), and the metrics are computed exactly as the loop's validation (the
split sharded without padding, sums all-reduced, data/tasks.py), so the checkpoint gives the
val/loss the run logged at that step, on any number of ranks.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from hydra.core.config_store import ConfigStore
from hydra.core.hydra_config import HydraConfig

from ringtrain.checkpoints import Resumed
from ringtrain.checkpoints.files import load_checkpoint
from ringtrain.components import build
from ringtrain.config import CommandLine
from ringtrain.config.builders import build_data, check_data, check_model, check_task
from ringtrain.config.schema import SECTIONS, TrainerConfig, build_strategy, check_options, typed_trainer
from ringtrain.data.vocab import same_ids
from ringtrain.distributed import env_rank, exit_rank, teardown_distributed, under_torchrun
from ringtrain.errors import ConfigError
from ringtrain.loop.evaluation import evaluate_parts
from ringtrain.loop.loaders import build_val_loader, worker_options
from ringtrain.storage import json_text, write_text_atomically
from ringtrain.strategies import Precision, Strategy
from ringtrain.tools import prepare, tool_main  # noqa: F401  (prepare: the entry's, ringtrain/__main__.py)
from ringtrain.tools.checkpoint_model import read_checkpoint, rebuild_model


@dataclass
class EvalJob:
    """Everything a rank needs, picklable (it travels to spawned ranks)."""

    checkpoint: Resumed  # the file, read once per process (a spawned rank reads its own)
    split: str
    job: dict  # the composed job's sections
    trainer: TrainerConfig
    strategy: Strategy
    weights: str  # model, or a callback's (ema)
    trusted: bool


def evaluate(checkpoint: str, split: Literal["val", "train"], output: str | None, job: dict, command: CommandLine,
             weights: str = "model", trust_checkpoint: bool = False) -> tuple[dict, EvalResult | None]:
    """What the metrics file records, and rank 0's result (None on the other ranks)."""
    keys = [override.lstrip("+~").split("=", 1)[0] for override in command.overrides]
    for section in (key.split(".")[0] for key in keys):
        if section in ("optimizer", "scheduler"):
            raise ConfigError(f"evaluation trains nothing, so the {section} is not used: drop the override")
    state = read_checkpoint(checkpoint, command.checkpoint)
    strategy_name = str(HydraConfig.get().runtime.choices.get("strategy"))
    if strategy_name == "auto":  # the option it stands for
        strategy_name = "ddp" if under_torchrun() else "single"
    eval_job, record = plan(checkpoint, state, split, output, job, strategy_name, weights, trust_checkpoint)
    # The command line's changes of the job (data.path=..., +data.x=1, ~data.x, strategy.nproc_per_node=2).
    record["overrides"] = [o for o, key in zip(command.overrides, keys)
                           if "." in key and key.split(".")[0] in (*SECTIONS, "adapter")]
    result = eval_job.strategy.launch(evaluate_worker, eval_job, accelerator=eval_job.trainer.accelerator)
    result = result if env_rank() == 0 else None  # rank 0's alone
    if result is not None:
        path = Path(record["output"])
        try:  # replaced atomically (a reader never sees half a file); a NaN metric as null
            write_text_atomically(path, json_text({**record, "world_size": result.world_size,
                                                   "metrics": result.metrics}, indent=2) + "\n")
        except OSError as err:
            raise ConfigError(f"cannot write {path} ({err.strerror or err}); pass output=<a writable file>") from None
    return record, result


def plan(checkpoint: str, state: dict, split: str, output: str | None, job: dict, strategy_name: str,
         weights: str = "model", trusted: bool = False) -> tuple[EvalJob, dict[str, Any]]:
    """Check the settings; return the job and what the metrics file records of it."""
    # The run's trainer settings (precision, val_batch_size, ...), but never its resume file
    # nor its starting weights: the checkpoint's own weights are evaluated.
    trainer_settings = typed_trainer({**job["trainer"], "resume": None, "init_from": None})
    strategy = build_strategy(job["strategy"])
    check_options(trainer_settings, strategy)
    check_model(job["model"], check_data(job["data"]), "the data")
    check_task(build(job["task"], "task"))

    path = Path(checkpoint).absolute()
    eval_job = EvalJob(Resumed(path, state), split, job, trainer_settings, strategy, weights, trusted)
    # One file per checkpoint, weights and split: <run dir>/eval/<checkpoint>[-<weights>]-<split>.json.
    which = "" if weights == "model" else f"-{weights}"
    metrics_file = Path(output) if output else path.parent.parent / "eval" / f"{path.stem}{which}-{split}.json"
    record = {
        "checkpoint": str(eval_job.checkpoint.path), "step": (state.get("progress") or {}).get("step"), "weights": weights,
        "split": split, "strategy": strategy_name, "overrides": [], "output": str(metrics_file),
    }
    return eval_job, record


@dataclass
class EvalResult:
    metrics: dict[str, float]  # e.g. {"val/loss": 1.47}
    world_size: int  # ranks that shared the split


def evaluate_worker(job: EvalJob) -> EvalResult:
    dist = job.strategy.setup_process(job.trainer.accelerator)
    clean_exit = False
    try:
        data = build_data(job.job["data"], dist)
        state = job.checkpoint.state if job.checkpoint.state is not None else load_checkpoint(job.checkpoint.path, mmap=True)
        # The data must give the sizes and vocabulary the checkpoint's model was trained with.
        for name, value in data.dims.items():
            trained = (state.get("data_dims") or {}).get(name)
            if value is not None and trained is not None and value != trained:
                raise ConfigError(
                    f"the data gives {name}={value} but the checkpoint's model was trained with {name}={trained}; "
                    f"evaluate on data of the same kind"
                )
        if data.vocab is not None and state.get("vocab") is not None and not same_ids(data.vocab, state["vocab"]):
            raise ConfigError(
                "the data's vocabulary differs from the one the model was trained with (same size, other "
                "characters or order), so its ids mean other things; evaluate on text with the same characters"
            )
        dataset = data.val if job.split == "val" else data.train
        named = data.val_sources if job.split == "val" and data.val_sources else {"": dataset}  # a mixture's sources
        for name, part in named.items():
            if len(part) < dist.world_size:
                raise ConfigError(
                    f"the {job.split} split{f' of {name}' if name else ''} has {len(part)} samples but "
                    f"{dist.world_size} processes need at least one each; use fewer processes"
                )
        task = check_task(build(job.job["task"], "task"))
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


def show(evaluated: tuple[dict, EvalResult | None]) -> None:
    record, result = evaluated
    if result is not None:
        for name, value in result.metrics.items():
            print(f"{name}={value:.6g}")
        weights = "" if record["weights"] == "model" else f", weights={record['weights']}"
        print(f"evaluated {record['checkpoint']} (step {record['step']}{weights}); metrics in {record['output']}",
              file=sys.stderr)


def main(command: CommandLine) -> None:
    # strategy=auto, evaluate's default: the option ddp under torchrun, else single.
    ConfigStore.instance().store(group="strategy", name="auto",
                                 node={"defaults": ["ddp" if under_torchrun() else "single", "_self_"]})
    tool_main("evaluate", "ringtrain evaluate checkpoint=<run>/checkpoints/last.pt", evaluate, show)(command)
    if under_torchrun():  # as training: leave without the interpreter's finalisation (gloo threads)
        exit_rank(0)


if __name__ == "__main__":
    from ringtrain.__main__ import main as entry

    entry("evaluate")
