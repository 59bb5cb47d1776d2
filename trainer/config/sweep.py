"""What a multirun leaves behind (README, "Sweeps and TensorBoard"): once every job has finished,
whatever the launcher, Hydra calls `SweepSummary.on_multirun_end` (config/__init__.py,
conf/train.yaml's hydra.callbacks) in the launching process, which imports this module.
"""
from __future__ import annotations

import json
import logging
import math
from pathlib import Path

from omegaconf import OmegaConf

from ringtrain.storage import json_text, write_text_atomically
from ringtrain.storage.rundir import RECORD_SUBDIR

log = logging.getLogger("ringtrain")

SUMMARY_FILE = "sweep_summary.json"


def write_summary(sweep_dir: Path) -> None:
    if not sweep_dir.is_dir():
        return
    summary = summarize_sweep(sweep_dir)
    write_text_atomically(sweep_dir / SUMMARY_FILE, json_text(summary, indent=2))
    for line in format_summary(summary):
        log.info(line)


def summarize_sweep(sweep_dir: Path, record_subdir: str | None = RECORD_SUBDIR) -> dict:
    """Every job directory of the sweep (one with a record in `record_subdir`, or with
    metrics.json) with its overrides and final metric; the best per metric. A job without
    metrics.json failed: value None; a diverged one (metric null, or NaN in an older file) has
    value None and diverged true, never best."""
    jobs = []
    for job_dir in sorted(p for p in sweep_dir.iterdir()  # a file's children are neither: only directories
                          if (record_subdir is not None and (p / record_subdir).is_dir()) or (p / "metrics.json").is_file()):
        overrides_file = job_dir / str(record_subdir) / "overrides.yaml"
        overrides = list(OmegaConf.load(overrides_file)) if record_subdir and overrides_file.exists() else []
        job = {"dir": job_dir.name, "overrides": [str(o) for o in overrides],
               "monitor": None, "mode": None, "value": None, "diverged": False}
        metrics_file = job_dir / "metrics.json"
        if metrics_file.exists():
            metrics = json.loads(metrics_file.read_text())
            value = metrics["final"].get(metrics["monitor"])
            finite = value is not None and math.isfinite(value)
            job.update(
                monitor=metrics["monitor"], mode=metrics["mode"], value=value if finite else None,
                diverged=not finite, steps=metrics["steps"], train_seconds=metrics["train_seconds"],
            )
        jobs.append(job)

    best: dict[str, dict] = {}
    for job in (job for job in jobs if job["value"] is not None):  # on a tie, the first job stays best
        better = min if job["mode"] == "min" else max
        best[job["monitor"]] = better(best.get(job["monitor"], job), job, key=lambda entry: entry["value"])
    return {"sweep_dir": str(sweep_dir), "jobs": jobs, "best": best}


def format_summary(summary: dict) -> list[str]:
    """Log lines naming each job by its number and the overrides that vary across the sweep."""
    jobs = summary["jobs"]
    shared = set.intersection(*(set(job["overrides"]) for job in jobs)) if jobs else set()

    def label(job: dict) -> str:
        varying = " ".join(o for o in job["overrides"] if o not in shared)
        return f"job {job['dir'].split('_', 1)[0]} ({varying})" if varying else f"job {job['dir']}"

    lines = [f"sweep of {len(jobs)} jobs in {summary['sweep_dir']}, summary in {SUMMARY_FILE}"]
    for monitor, job in summary["best"].items():
        lines.append(f"best {monitor} {job['value']:.5g}: {label(job)}")
    for job in jobs:
        if job["value"] is not None:
            value = f"{job['monitor']}={job['value']:.5g}"
        else:
            value = f"{job['monitor']}=diverged" if job["diverged"] else "failed"
        lines.append(f"  {value}  {label(job)}")
    return lines
