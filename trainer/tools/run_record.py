"""The job's record (<run dir>/.hydra/: config.yaml, hydra.yaml, overrides.yaml), written by
the run once it owns its directory instead of by Hydra as the job starts.

Hydra writes hydra.output_subdir before the task function runs, so before the job knows
whether the directory is its own: a job then refused (another job holds the directory's
lock, its checkpoints are of another model) had already replaced the record of the run that
owns it, which then described a model next to another model's checkpoints. So `main()` of
`ringtrain` turns Hydra's writing off (`take_over`), and the files Hydra would have written
(`record_of_this_job`) travel with the run to rank 0, which writes them after the lock and
the resume decision (ringtrain/run.py, checkpoints/rundir.py RunRecord).

A sweep's jobs may run in processes of their own (the joblib and SLURM launchers), where
nothing set here reaches: Hydra writes their records itself, as before.
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ringtrain.checkpoints.rundir import RunRecord
from ringtrain.config.compose import Outputs

# The override that stops Hydra writing hydra.output_subdir (appended after the user's by take_over).
NO_RECORD_BY_HYDRA = "hydra.output_subdir=null"


def take_over(outputs: Outputs | None, for_this_rank: list[str]) -> tuple[str | None, list[str]]:
    """(the record's subdirectory, the overrides that stop Hydra writing it) for a command line
    that runs one job with a record, on the process that writes it (`for_this_rank`: the
    overrides config/command_line.py adds here; a rank other than 0, a continued run write
    none); (None, []) otherwise."""
    if outputs is None or outputs.multirun or outputs.record_subdir is None or NO_RECORD_BY_HYDRA in for_this_rank:
        return None, []
    return outputs.record_subdir, [NO_RECORD_BY_HYDRA]


def record_of_this_job(cfg: DictConfig, subdir: str | None) -> RunRecord | None:
    """What Hydra would have written into <run dir>/`subdir` for this job (in its Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    if subdir is None:
        return None
    node = OmegaConf.to_container(HydraConfig.instance().cfg, enum_to_str=True)  # as Hydra saves it
    node["hydra"]["output_subdir"] = subdir
    hydra_overrides = node["hydra"]["overrides"]["hydra"]
    if NO_RECORD_BY_HYDRA in hydra_overrides:  # take_over's (the last; Hydra adds hydra.mode after it)
        del hydra_overrides[len(hydra_overrides) - 1 - hydra_overrides[::-1].index(NO_RECORD_BY_HYDRA)]
    files = {"config.yaml": cfg, "hydra.yaml": node, "overrides.yaml": node["hydra"]["overrides"]["task"]}
    return RunRecord(subdir, {name: OmegaConf.to_yaml(value) for name, value in files.items()})
