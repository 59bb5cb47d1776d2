"""TensorBoard: one event file directly in the run directory, so `tensorboard --logdir <sweep dir>`
shows every job of a sweep as its own run. The resolved config is a text summary ("config");
at the end, the run's hyperparameters and final metrics are its HPARAMS record."""
from __future__ import annotations

import json
import math
from pathlib import Path

from ringtrain.loggers import Logger, flatten


class TensorBoardLogger(Logger):
    def start(self, run_dir: Path, run_name: str, group: str | None, config: dict) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.config = config
        self.writer = SummaryWriter(log_dir=str(run_dir))
        self.writer.add_text("config", "```\n" + json.dumps(config, indent=2, default=str) + "\n```", 0)

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        """All `metrics` as one event: SummaryWriter.add_scalar writes an event per tag at about
        0.1 ms each, which small models feel at every logging step."""
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=float(value)) for tag, value in metrics.items()]
        self.writer.file_writer.add_summary(Summary(value=values), step)

    def finish(self, summary: dict, status: str) -> None:
        """The HPARAMS record: only the session records, no experiment record, so TensorBoard
        builds the experiment from all runs it finds, marks the hyperparameters whose values
        differ between them and shows those first, which is what a sweep varies. The final
        metrics are scalars under `final/`, in this run's own event file (SummaryWriter.add_hparams
        would start a second event file in a sub-directory)."""
        from torch.utils.tensorboard.summary import hparams

        final = {f"final/{k}": (v if math.isfinite(v) else float("nan")) for k, v in summary["final"].items()}
        for session_record in hparams(flatten(self.config), final)[1:]:  # its start and its end
            self.writer.file_writer.add_summary(session_record)
        self.log_metrics(final, summary["steps"])
        self.writer.close()
