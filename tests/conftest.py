"""Fixtures, and the helpers that compose configs like train.py does and train in-process or as a
subprocess. Helpers for other subprocesses (torchrun, exit statuses, free ports, watched jobs) are
in tests/helpers.py."""
from __future__ import annotations

import atexit
import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# The suite is exact on CPUs by design: float32 equivalences to 1e-6 and 2-rank gloo jobs. A
# visible GPU would change what trainer.accelerator=auto picks (and TF32 the arithmetic; one
# GPU cannot hold two NCCL ranks), so it is hidden from every test, and from the processes
# they start, before torch looks for one. RINGTRAIN_TEST_CUDA=1 keeps it for the tests marked
# `cuda`: `RINGTRAIN_TEST_CUDA=1 pytest -m cuda` (benchmarks/gpu_checks.sh runs them).
if os.environ.get("RINGTRAIN_TEST_CUDA") != "1":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
# The processes the tests start (hundreds of `python train.py` runs and torchrun ranks) write and
# reuse Python's bytecode, as a user's would: where PYTHONDONTWRITEBYTECODE is set (this VM sets
# it) each would compile ringtrain's modules from source again, ~0.1 s of CPU a process.
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import pytest  # noqa: E402
import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"
SHAKESPEARE = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

# Small, fast settings every test run starts from (the progress bar only clutters test logs).
QUIET = ["trainer.progress_bar=false"]


def compose_config(overrides: list[str], hydra: bool = False):
    """conf/train.yaml composed with `overrides`; `hydra`: with Hydra's settings, from which
    validate() takes the job's recipe (config/recipe.py), as a command's job has it."""
    from ringtrain.config import register_resolvers

    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose(config_name="train", overrides=QUIET + list(overrides), return_hydra_config=hydra)


def train_in_process(overrides: list[str], run_dir: Path):
    """Validate and train on this process, as one rank; returns the FitResult."""
    from ringtrain.config.schema import validate
    from ringtrain.run import train_rank

    return train_rank(validate(compose_config(overrides, hydra=True)), str(run_dir))


def run_cli(args: list[str], cwd: Path | None = None, timeout: float = 300, launcher: list[str] | None = None):
    """`python train.py ARGS` (or under `launcher`, e.g. torchrun) as a process of its own."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    # QUIET after args: Hydra's argument parser wants -m before any override.
    args = [str(REPO / "train.py"), *args, *QUIET]
    if launcher is None:
        return COMMANDS.run(args, None, cwd or REPO, env, timeout)
    return subprocess.run(launcher + args, cwd=cwd or REPO, env=env, capture_output=True, text=True, timeout=timeout)


def run_module(module: str, args: list[str], cwd: Path | None = None, timeout: float = 120):
    """`python -m <module> ARGS` (ringtrain.tools.<module> for a bare tool name; `ringtrain`
    is the dispatcher, `python -m ringtrain <tool> ...`) as a user runs it, as a process of its
    own; this checkout's code comes first."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    module = module if "." in module or module == "ringtrain" else f"ringtrain.tools.{module}"
    return COMMANDS.run(list(args), module, cwd or REPO, env, timeout)


class ForkedCommands:
    """The commands of run_cli and run_module, each a child of tests/cli_server.py, which has
    imported torch and Hydra once for all of them (1-2 s a command otherwise). A plain subprocess
    where a fork would not be the same: the environment differs from the server's in what torch
    reads as it is imported, or another command of this process is running (a test's thread)."""

    IMPORT_TIME = ("OMP_", "MKL_", "KMP_", "GOMP_", "TORCH", "PYTORCH", "CUDA", "NCCL", "CUBLAS", "PYTHON")

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None
        self._env: dict[str, str] = {}
        self._lock = threading.Lock()

    def run(self, args: list[str], module: str | None, cwd: Path, env: dict[str, str], timeout: float):
        command = [sys.executable, *(["-m", module] if module else []), *args]
        if self._import_env(env) != self._import_env(self._env or env) or not self._lock.acquire(blocking=False):
            return subprocess.run(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                  timeout=timeout)
        try:
            server = self._started(env)
            with tempfile.TemporaryDirectory(prefix="ringtrain-cmd-") as streams:
                out, err = Path(streams, "stdout"), Path(streams, "stderr")
                for stream in (out, err):
                    stream.touch()
                request = {"args": args, "module": module, "cwd": str(cwd), "env": env, "stdout": str(out), "stderr": str(err)}
                server.stdin.write(json.dumps(request).encode() + b"\n")
                pid = int(server.stdout.readline())
                # The pipe is unbuffered (a raw file reads a line byte by byte): a status line
                # already written is never held in a buffer that select cannot see.
                ready, _, _ = select.select([server.stdout], [], [], timeout)
                if not ready:
                    with contextlib.suppress(ProcessLookupError):  # it may have ended just now
                        os.kill(pid, signal.SIGKILL)
                    server.stdout.readline()
                    raise subprocess.TimeoutExpired(command, timeout, out.read_text(), err.read_text())
                status = int(server.stdout.readline())
                return subprocess.CompletedProcess(command, status, out.read_text(), err.read_text())
        finally:
            self._lock.release()

    def _import_env(self, env: dict[str, str]) -> dict[str, str]:
        return {key: value for key, value in env.items() if key.startswith(self.IMPORT_TIME) and key != "PYTHONPATH"}

    def _started(self, env: dict[str, str]) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            self._env = env
            self._server = subprocess.Popen([sys.executable, str(Path(__file__).with_name("cli_server.py"))], env=env,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
            assert self._server.stdout.readline() == b"ready\n"
            atexit.register(self._server.kill)
        return self._server


COMMANDS = ForkedCommands()


def checkpoint_weights(run_dir: Path, name: str = "last.pt") -> dict[str, torch.Tensor]:
    """The model weights of a run's checkpoint; a sharded one is read into its rebuilt model."""
    path = run_dir / "checkpoints" / name
    state = torch.load(path, weights_only=True)
    if "shards" not in state:
        return state["model"]
    from ringtrain.tools.checkpoint_model import read_checkpoint, rebuild_model

    state = read_checkpoint(str(path))
    return rebuild_model(state, str(path)).state_dict()


def assert_same_weights(a: dict, b: dict, atol: float) -> None:
    assert a.keys() == b.keys()
    for key in a:
        diff = (a[key].double() - b[key].double()).abs().max().item()
        assert diff <= atol, f"{key} differs by {diff}"


@pytest.fixture(autouse=True)
def _few_threads():
    # Two cores here; a test that grabs more threads only slows the others down.
    previous = torch.get_num_threads()
    torch.set_num_threads(min(previous, 2))
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def hf_offline():
    """HF_HUB_OFFLINE=1 for a module's tests (subprocesses inherit it): nothing is fetched."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("HF_HUB_OFFLINE", "1")
        yield
