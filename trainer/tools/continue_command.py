"""The command that continues a run a stop signal ended, printed as the run's last line
(tools/train.py `told_how_to_continue`, which imports this module only then).

Auto-resume (checkpoints/manager.py) continues last.pt only when the job lands in the same run
directory, and the same command does so only where the job names it (hydra.run.dir, SLURM's
job id, torchrun's --rdzv-id): a plain `python train.py` gets a new time-stamped directory
(storage/rundir.py) and would start from step 0. So the line is the exact command:

  program     as this process was started (`python train.py`, `python -m ringtrain`,
              `ringtrain`); under torchrun the torchrun command (the parent's command line,
              which ends with this worker's arguments)
  arguments   the user's, with `hydra.run.dir=<this run's directory>` (absolute) in place of
              any given; trainer.resume=<path> pointing at this run's last.pt (a step file would
              go back to that step), trainer.resume=null made auto (null refuses checkpoints)
"""
from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import Any

from ringtrain.distributed import under_torchrun


def continue_command(argv: list[str], run_dir: str, resume: Any) -> str:
    """The shell command that continues, from its last.pt, the run in `run_dir` that this
    process's command line `argv` started."""
    arguments = argv[1:]
    return shlex.join(_launcher(argv[0], arguments) + _continuing(arguments, Path(run_dir).resolve(), resume))


def _continuing(arguments: list[str], run_dir: Path, resume: Any) -> list[str]:
    replaced = {"hydra.run.dir"} | ({"trainer.resume"} if resume != "auto" else set())
    kept = [a for a in arguments if _key(a) not in replaced]
    if resume is None:
        kept.append("trainer.resume=auto")
    elif resume != "auto":
        kept.append(f"trainer.resume={run_dir / 'checkpoints' / 'last.pt'}")
    return kept + [f"hydra.run.dir={run_dir}"]


def _key(argument: str) -> str | None:
    if argument.startswith("-") or "=" not in argument:
        return None
    return argument.split("=", 1)[0].lstrip("+~")


def _launcher(program: str, arguments: list[str]) -> list[str]:
    """The words before the arguments: how this process, or its torchrun, was started."""
    if under_torchrun():
        parent = _parent_command_line()
        if parent and parent[len(parent) - len(arguments):] == arguments and len(parent) > len(arguments):
            return _readable(parent[:len(parent) - len(arguments)])
        # No /proc, or a launcher that is not torchrun: the torchrun command that would do.
        script = _this_program(program)
        script = script[1:] if script[0] == _python() else ["--no-python", *script]
        return ["torchrun", f"--nproc_per_node={os.environ.get('LOCAL_WORLD_SIZE', '1')}", *script]
    return _this_program(program)


def _this_program(program: str) -> list[str]:
    spec = getattr(sys.modules.get("__main__"), "__spec__", None)
    if spec is not None and spec.name:  # python -m ringtrain, python -m ringtrain.tools.train
        return [_python(), "-m", spec.name.removesuffix(".__main__")]
    if program.endswith(".py"):
        return [_python(), program]
    return [_by_name(program)]  # the `ringtrain` console script


def _readable(words: list[str]) -> list[str]:
    """A command line as /proc has it (`/venv/bin/python /venv/bin/torchrun ...`) as it was
    typed (`torchrun ...`) where the short names find the same programs."""
    if len(words) > 1 and os.path.basename(words[0]).startswith("python"):
        if os.path.abspath(words[0]) == os.path.abspath(sys.executable):
            words = [_python(), *words[1:]]
        if not words[1].startswith("-") and not words[1].endswith(".py"):  # a console script
            return [_by_name(words[1]), *words[2:]]
        return words
    return [_by_name(words[0]), *words[1:]]


def _parent_command_line() -> list[str] | None:
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:
        return None
    return [os.fsdecode(word) for word in raw.split(b"\0")[:-1]] or None


def _python() -> str:
    """`python` (or `python3`) when that finds this interpreter, else its path."""
    for name in ("python", "python3"):
        found = shutil.which(name)
        if found and os.path.abspath(found) == os.path.abspath(sys.executable):
            return name
    return sys.executable


def _by_name(path: str) -> str:
    name = os.path.basename(path)
    found = shutil.which(name)
    return name if found and os.path.abspath(found) == os.path.abspath(path) else path
