"""Weights & Biases, offline by default, so no account or network is needed until `wandb sync`
(conf/logger/wandb.yaml: where the run goes, a sweep's group)."""
from __future__ import annotations

from pathlib import Path

from ringtrain.errors import ConfigError
from ringtrain.loggers import Logger, final_and_best, import_extra

MODES = ("offline", "online", "disabled")


class WandbLogger(Logger):
    """The config goes in nested, as W&B shows it flattened itself (model.d_model) and keeps
    lists as lists; the summary gets final/<metric>, best/<metric>, steps and status."""

    def __init__(self, project: str = "ringtrain", mode: str = "offline", tags: list[str] | None = None):
        if mode not in MODES:
            raise ConfigError(f"logger.wandb.mode={mode} is not one of {', '.join(MODES)}")
        self.wandb = import_extra("wandb")
        self.project, self.mode, self.tags = project, mode, list(tags or [])
        if mode == "online":  # the key, found now (or asked for at a terminal), not at the first write
            try:
                self.wandb.login(verify=False)
            except self.wandb.errors.UsageError as err:
                raise ConfigError(f"logger.wandb.mode=online needs a W&B API key ({err}); set WANDB_API_KEY or run "
                                  f"`wandb login`, or log offline (logger.wandb.mode=offline) and `wandb sync` later") from None

    def start(self, run_dir: Path, run_name: str, group: str | None, config: dict) -> None:
        # A resumed run continues its W&B run: the same id (offline, `wandb sync` adds each part to it).
        run_id = self.continued.get("run_id")
        self.run = self.wandb.init(project=self.project, mode=self.mode, dir=run_dir, name=run_name,
                                   group=group, tags=self.tags, config=config, id=run_id,
                                   resume="allow" if run_id else None)

    def state_dict(self) -> dict:
        return {"run_id": self.run.id} if getattr(self, "run", None) is not None and self.mode != "disabled" else {}

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        self.run.log(metrics, step=step)

    def finish(self, summary: dict, status: str) -> None:
        self.run.summary.update({**final_and_best(summary), "steps": summary["steps"], "status": status})
        # W&B marks a run with a non-zero exit code as failed; a stopped run can be resumed, not failed.
        self.run.finish(exit_code=1 if status == "failed" else 0)
