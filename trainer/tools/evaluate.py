"""A trained model's metrics on a split: `python -m ringtrain.tools.evaluate checkpoint=...`.

    python -m ringtrain.tools.evaluate checkpoint=outputs/runs/<run>/checkpoints/best.pt
    python -m ringtrain.tools.evaluate checkpoint=... split=train                  # the training split
    python -m ringtrain.tools.evaluate checkpoint=... data.path=other.txt          # other data, same kind
    python -m ringtrain.tools.evaluate checkpoint=... strategy=ddp strategy.nproc_per_node=2
    torchrun --nproc_per_node=2 -m ringtrain.tools.evaluate checkpoint=...

lightning-hydra-template's eval.py for ringtrain: no optimizer, no training. The data, model
and task are rebuilt from the config the checkpoint keeps (the resolved `_target_` nodes
and the data's sizes, so the run's command line is not needed), with the weights loaded.

Settings (`key=value`): `checkpoint` (required), `split` (val | train), `output` (where the
metrics go; default `<checkpoint dir>/../eval/metrics.json`, i.e. `<run dir>/eval/`), and
`strategy` (auto | single | ddp; auto is ddp under torchrun, else single; the run's own
strategy is not reused, evaluation is cheap). Every other argument is an override of the
stored config, written as on train.py's command line: `data.path=x` changes a key the
config has, `+data.x=1` adds one, `~data.x` removes one, in the sections model, data,
task, trainer (e.g. trainer.val_batch_size, trainer.limit_val_batches, trainer.accelerator,
trainer.precision) and strategy (strategy.nproc_per_node=N starts N ranks, as train.py
does). The result is checked like train.py's config (trainer/builders.check_components):
a mistake is one `error:` line, exit 2, before any data is built. A relative path in the
stored config (data.path) is read from the current directory, as the run read it; from
elsewhere, pass data.path=<path>.

The metrics are computed exactly as the training loop's validation: the split sharded over
the ranks without padding, per-batch sums and counts all-reduced (data.tasks), autocast per
`trainer.precision`; so the same checkpoint gives the val/loss the run logged at that step,
for any number of ranks. Rank 0 prints one `name=value` line per metric on stdout and writes
`metrics.json`: {"checkpoint", "step", "split", "strategy", "overrides", "output", "world_size",
"metrics"}.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ringtrain.data.bundle import DataBundle
from ringtrain.config.builders import build_data, check_components, check_task
from ringtrain.config.components import build
from ringtrain.config.schema import CONF_DIR, TrainerConfig, build_strategy, check_options, typed_section
from ringtrain.distributed import (
    exit_rank,
    teardown_distributed,
    under_torchrun,
)
from ringtrain.errors import ConfigError, exit_on_user_error
from ringtrain.tools.keyvalue import REQUIRED, Key, parse_key_values, usage, wants_help
from ringtrain.loop.loaders import build_val_loader, worker_options
from ringtrain.loop.evaluation import evaluate_model
from ringtrain.strategies.base import Strategy
from ringtrain.loop.precision import Precision
from ringtrain.tools.checkpoint_model import model_node, read_checkpoint, rebuild_model

PROGRAM = "ringtrain.tools.evaluate"
KEYS = (
    Key("checkpoint", str, REQUIRED, "a checkpoint of a run, e.g. outputs/runs/<run>/checkpoints/best.pt"),
    Key("split", str, "val", "the split to evaluate", choices=("val", "train")),
    Key("output", str, "", "the metrics file (default: <checkpoint dir>/../eval/metrics.json)"),
    Key("strategy", str, "auto", "auto (ddp under torchrun), single or ddp", choices=("auto", "single", "ddp")),
)
OVERRIDE_HINT = "overrides of the stored config such as data.path=other.txt, +data.x=1, trainer.val_batch_size=64"
# The stored config's sections an override may change; the optimizer and schedule are unused.
SECTIONS = ("model", "data", "task", "trainer", "strategy")
_ABSENT = object()


@dataclass
class EvalJob:
    """Everything a rank needs, plain and picklable (it travels to spawned ranks)."""

    checkpoint: str
    split: str
    model: dict
    data: dict
    task: dict
    data_dims: dict
    vocab: dict | None
    trainer: TrainerConfig
    strategy: Strategy


def is_override(key: str) -> bool:
    return "." in key or key.startswith(("+", "~"))


def prepare(argv: Sequence[str]) -> tuple[EvalJob, dict[str, Any]]:
    """Parse and check the command line; return the job and what metrics.json records of it."""
    options, overrides = parse_key_values(argv, KEYS, PROGRAM, passthrough=is_override, passthrough_hint=OVERRIDE_HINT)
    path = options["checkpoint"]
    state = read_checkpoint(path, mmap=True)  # the config and sizes; each rank reads the weights
    stored = state["config"]
    model_node(state, path)  # refuses a model built in Python: its config cannot rebuild it
    for section in ("data", "task"):
        if not isinstance(stored.get(section), Mapping):
            raise ConfigError(
                f"checkpoint {path!r} holds no {section} config (trained through the Python API?); "
                f"evaluate it in Python"
            )
    strategy = options["strategy"]
    if strategy == "auto":
        strategy = "ddp" if under_torchrun() else "single"
    config = {
        "model": stored["model"], "data": stored["data"], "task": stored["task"],
        # The run's trainer settings (precision, val_batch_size, ...), but never its resume file.
        "trainer": {**stored.get("trainer", {}), "resume": None},
        "strategy": OmegaConf.to_container(OmegaConf.load(CONF_DIR / "strategy" / f"{strategy}.yaml")),
    }
    config = apply_overrides(config, overrides)
    trainer = typed_section(config["trainer"], TrainerConfig, "trainer")
    strategy_config = build_strategy(config["strategy"])
    check_options(trainer, strategy_config)
    if under_torchrun() and not strategy_config.spans_processes:
        raise ConfigError(f"strategy={strategy} under torchrun would evaluate on every rank alone; use strategy=ddp (or auto)")
    check_components(config["model"], config["data"], config["task"], None, None, 0)

    job = EvalJob(
        checkpoint=str(Path(path).absolute()), split=options["split"],
        model=config["model"], data=config["data"], task=config["task"],
        data_dims=dict(state.get("data_dims") or {}), vocab=state.get("vocab"),
        trainer=trainer, strategy=strategy_config,
    )
    output = Path(options["output"]) if options["output"] else Path(path).absolute().parent.parent / "eval" / "metrics.json"
    record = {
        "checkpoint": job.checkpoint, "step": (state.get("progress") or {}).get("step"),
        "split": job.split, "strategy": strategy, "overrides": list(overrides), "output": str(output),
    }
    return job, record


def apply_overrides(config: dict, overrides: Sequence[str]) -> dict:
    """`key=value`, `+key=value` and `~key` on the stored config, with Hydra's rules: `key=`
    only changes what exists, `+key=` only adds what does not."""
    cfg = OmegaConf.create(config)
    for text in overrides:
        try:
            _apply_override(cfg, text)
        except OmegaConfBaseException as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"cannot apply {text!r} ({first}); write section.key=value, e.g. data.path=other.txt") from None
    return OmegaConf.to_container(cfg)


def _apply_override(cfg: DictConfig, text: str) -> None:
    key, _, raw = text.partition("=")
    path = key.lstrip("+~")
    section = path.split(".", 1)[0]
    if section in ("optimizer", "scheduler"):
        raise ConfigError(f"{path}: evaluation trains nothing, so the {section} is not used; drop the override")
    if section not in SECTIONS:
        raise ConfigError(f"{path}: {section} is not a section of the stored config; the sections are {', '.join(SECTIONS)}")
    if "." not in path:
        raise ConfigError(f"{key} would replace the whole {section} section; change its keys instead, e.g. {section}.<key>=<value>")
    present = OmegaConf.select(cfg, path, default=_ABSENT) is not _ABSENT
    parent_path, _, leaf = path.rpartition(".")
    if key.startswith("~"):
        if not present:
            raise ConfigError(f"~{path}: the checkpoint's config has no {path} to remove")
        del OmegaConf.select(cfg, parent_path)[leaf]
        return
    if key.startswith("+") and present:
        raise ConfigError(f"{path} already exists, so +{path}=... cannot add it; change it with {path}=<value>")
    if not key.startswith("+") and not present:
        parent = OmegaConf.select(cfg, parent_path, default=None)
        known = ", ".join(k for k in parent if k != "_target_") if isinstance(parent, DictConfig) else ""
        raise ConfigError(
            f"{path} is not in the checkpoint's config; to pass a new argument write +{path}=<value>, "
            f"or check the spelling (set now: {known or 'nothing'})"
        )
    # Values are read as on train.py's command line: 3 is an int, 1e-3 a float, [1,2] a list.
    value = OmegaConf.to_container(OmegaConf.from_dotlist([f"value={raw}"]))["value"] if raw else ""
    OmegaConf.update(cfg, path, value, merge=False, force_add=True)


# --- on each rank -----------------------------------------------------------------------------


@dataclass
class EvalResult:
    metrics: dict[str, float]  # e.g. {"val/loss": 1.47}
    world_size: int  # ranks that shared the split


def evaluate_worker(job: EvalJob) -> EvalResult:
    """One rank's part: build the data, task and model, evaluate, all-reduce. The process group
    is torn down on every exit path."""
    dist = job.strategy.setup_process(job.trainer.accelerator)
    clean_exit = False
    try:
        data = build_data(job.data, dist)
        check_data_fits(data, job)
        dataset = data.val if job.split == "val" else data.train
        if len(dataset) < dist.world_size:
            raise ConfigError(
                f"the {job.split} split has {len(dataset)} samples but {dist.world_size} processes need at "
                f"least one each; use fewer processes"
            )
        task = check_task(build(job.task, "task"))
        state = read_checkpoint(job.checkpoint)
        model = rebuild_model(job.model, job.data_dims, state, job.checkpoint).to(dist.device)
        del state
        cfg = job.trainer
        loader = build_val_loader(
            dataset, cfg.val_batch_size or cfg.batch_size, dist.rank, dist.world_size, dist.device,
            limit_batches=cfg.limit_val_batches, workers=worker_options(cfg, dist.device),
        )
        sums = evaluate_model(model, loader, task, Precision(cfg.precision, dist.device), dist, job.strategy)
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
    if data.vocab is not None and job.vocab is not None and data.vocab != job.vocab:
        raise ConfigError(
            "the data's vocabulary differs from the one the model was trained with (same size, other "
            "characters or order), so its ids mean other things; evaluate on text with the same characters"
        )


def launch(job: EvalJob) -> EvalResult | None:
    """The result on rank 0 (None on the other ranks of a torchrun job)."""
    result = job.strategy.launch(evaluate_worker, job)
    return result if int(os.environ.get("RANK", "0")) == 0 else None


def write_metrics(path: Path, record: dict) -> None:
    """metrics.json, replaced atomically (a reader never sees half a file)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(record, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError as err:
        raise ConfigError(f"cannot write {path} ({err.strerror or err}); pass output=<a writable file>") from None


def main(argv: Sequence[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(usage(PROGRAM, KEYS, extra="[section.key=value ...]") + "\n\n" + __doc__)
        return
    with exit_on_user_error():
        job, record = prepare(argv)
        result = launch(job)
        if result is not None:
            write_metrics(Path(record["output"]), {**record, "world_size": result.world_size, "metrics": result.metrics})
    if result is not None:
        for name, value in result.metrics.items():
            print(f"{name}={value:.6g}")
        print(f"evaluated {record['checkpoint']} (step {record['step']}); metrics in {record['output']}", file=sys.stderr)
    if under_torchrun():  # as train.py: leave without the interpreter's finalisation (gloo threads)
        exit_rank(0)


if __name__ == "__main__":
    main()
