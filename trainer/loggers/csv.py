"""CSV files in the run directory that a spreadsheet or Python's csv module reads, with nothing
beyond the standard library:
  metrics.csv  one row per logged step: `step`, then a column per metric in the order they first
               appeared; an empty cell where a metric has no value at that step
  hparams.csv  `name,value`: the config flattened (model.d_model), written at the start
  summary.csv  `name,value`: status, final/<metric>, best/<metric>, steps and the rest of the
               summary, written at the end (also of a stopped or failed run)
hparams.csv rather than hparams.yaml: the same reader as the other two, and no YAML writer of our
own (a string such as "1e-3", "yes" or "null" reads back as another type unless quoted just so);
the nested config as YAML is already in the run's record (<run dir>/.hydra/config.yaml).
"""
from __future__ import annotations

import contextlib
import csv
import io
from pathlib import Path

from ringtrain.loggers import Logger, final_and_best, flatten
from ringtrain.storage import write_text_atomically


class CSVLogger(Logger):
    """A step's row is written when the next step's metrics arrive, or at finish: the training
    and validation metrics of one step come in separate calls and share one row."""

    def start(self, run_dir: Path, run_name: str, group: str | None, config: dict) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / "metrics.csv"
        # A resumed run (same run directory) goes on appending under the columns it had.
        self.columns = ["step"]
        with contextlib.suppress(FileNotFoundError), self.metrics_path.open(newline="") as file:
            self.columns = next(csv.reader(file), self.columns)
        self.row: dict = {}
        _write_pairs(run_dir / "hparams.csv", flatten(config))

    def log_metrics(self, metrics: dict[str, float], step: int) -> None:
        if self.row and self.row["step"] != step:
            self._write_row()
        self.row = {**self.row, "step": step, **metrics}

    def finish(self, summary: dict, status: str) -> None:
        if self.row:
            self._write_row()
        # The csv module writes None as an empty cell and a list as its repr.
        rest = {k: v for k, v in summary.items() if k not in ("final", "best")}
        _write_pairs(self.run_dir / "summary.csv", {"status": status, **final_and_best(summary), **rest})

    def _write_row(self) -> None:
        new_columns = [name for name in self.row if name not in self.columns]
        if new_columns:
            # A new column changes the header: rewrite the file (as Lightning's CSVLogger does).
            rows = []
            with contextlib.suppress(FileNotFoundError), self.metrics_path.open(newline="") as file:
                rows = list(csv.DictReader(file))
            self.columns += new_columns
            write_text_atomically(self.metrics_path, _csv_text(self.columns, [*rows, self.row]))
        else:
            with self.metrics_path.open("a", newline="") as file:
                csv.DictWriter(file, self.columns).writerow(self.row)
        self.row = {}


def _csv_text(columns: list[str], rows: list[dict]) -> str:
    text = io.StringIO()
    writer = csv.DictWriter(text, columns)
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


def _write_pairs(path: Path, values: dict) -> None:
    rows = [{"name": name, "value": value} for name, value in values.items()]
    write_text_atomically(path, _csv_text(["name", "value"], rows))
