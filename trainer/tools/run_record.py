"""The job's record (<run dir>/.hydra/: config.yaml, hydra.yaml, overrides.yaml), written by
the run once it owns its directory instead of by Hydra as the job starts.

Hydra writes hydra.output_subdir before the task function runs, so before the job knows
whether the directory is its own: a job then refused (another job holds the directory's
lock, its checkpoints are of another model) had already replaced the record of the run that
owns it, which then described a model next to another model's checkpoints. So `main()` of
`ringtrain` turns Hydra's writing off (`take_over`), and the files Hydra would have written
(`record_of_this_job`) travel with the run to rank 0, which writes them after the lock and
the resume decision (ringtrain/run.py, checkpoints/rundir.py RunRecord).

The same holds for a sweep's jobs, which may run in processes of their own (the joblib and
SLURM launchers): the record's subdirectory travels in each job's Hydra config, as
hydra.job.env_set.RINGTRAIN_RECORD_SUBDIR (checkpoints/rundir.py).
"""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from ringtrain.checkpoints.rundir import RECORD_SUBDIR_VARIABLE, RunRecord
from ringtrain.config.compose import Outputs

# The override that stops Hydra writing hydra.output_subdir (appended after the user's by take_over).
NO_RECORD_BY_HYDRA = "hydra.output_subdir=null"


def take_over(outputs: Outputs | None, for_this_rank: list[str]) -> list[str]:
    """The overrides that stop Hydra writing the job's record and hand its subdirectory to the
    job (`record_subdir`), for a command line that runs jobs with a record, on the process
    that writes it (`for_this_rank`: the overrides config/command_line.py adds here; a rank
    other than 0, a continued run write none); [] otherwise."""
    if outputs is None or outputs.record_subdir is None or NO_RECORD_BY_HYDRA in for_this_rank:
        return []
    return [NO_RECORD_BY_HYDRA, _carried(outputs.record_subdir)]


def _carried(subdir: str) -> str:
    return f"+hydra.job.env_set.{RECORD_SUBDIR_VARIABLE}={subdir}"


def record_subdir(hydra_cfg: DictConfig) -> str | None:
    """The job's record subdirectory that take_over handed it (None: no record to write)."""
    return hydra_cfg.job.env_set.get(RECORD_SUBDIR_VARIABLE)


def record_of_this_job(cfg: DictConfig) -> RunRecord | None:
    """What Hydra would have written into the record subdirectory for this job (in its Hydra app)."""
    from hydra.core.hydra_config import HydraConfig

    subdir = record_subdir(HydraConfig.get())
    if subdir is None:
        return None
    node = OmegaConf.to_container(HydraConfig.instance().cfg, enum_to_str=True)  # as Hydra saves it
    node["hydra"]["output_subdir"] = subdir
    del node["hydra"]["job"]["env_set"][RECORD_SUBDIR_VARIABLE]
    hydra_overrides = node["hydra"]["overrides"]["hydra"]
    for added in (NO_RECORD_BY_HYDRA, _carried(subdir)):  # take_over's (after the user's)
        if added in hydra_overrides:
            del hydra_overrides[len(hydra_overrides) - 1 - hydra_overrides[::-1].index(added)]
    files = {"config.yaml": cfg, "hydra.yaml": node, "overrides.yaml": node["hydra"]["overrides"]["task"]}
    return RunRecord(subdir, {name: OmegaConf.to_yaml(value) for name, value in files.items()})
