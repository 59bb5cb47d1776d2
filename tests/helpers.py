"""Helpers the tests share for real subprocesses: torchrun commands, exit-status checks, free
ports and watched jobs. Import them as `from helpers import ...` (pytest puts tests/ on sys.path);
tests/conftest.py holds the fixtures and the config and training helpers.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path


# --- checkpoints -----------------------------------------------------------------------------


class CheckpointStore:
    """The checkpoint manager's writing, as unit tests drive it: save a given state at a step,
    in one process (trainer.async_checkpoint off: the file is on disk when save returns)."""

    def __init__(self, directory: Path, keep_last_k: int):
        from types import SimpleNamespace

        import torch

        from ringtrain.checkpoints import CheckpointManager
        from ringtrain.distributed import DistInfo

        trainer = SimpleNamespace(keep_last_k=keep_last_k, checkpoint=True, checkpoint_every_n_steps=0,
                                  async_checkpoint=False)
        self.manager = CheckpointManager(directory, trainer, DistInfo(0, 0, 1, torch.device("cpu"), None))
        self.directory, self.last, self.best = Path(directory), Path(directory) / "last.pt", Path(directory) / "best.pt"

    def save(self, state: dict, step: int, best: bool) -> None:
        from ringtrain.checkpoints import Part

        self.manager.register(given=Part(lambda: state, spread=True))  # its keys are the file's
        self.manager.save(step, best)

    def shards_path(self, step: int) -> Path:
        from ringtrain.checkpoints.files import shards_name

        return self.directory / shards_name(step)

    def step_files(self) -> list:
        from ringtrain.checkpoints.files import step_checkpoints

        return step_checkpoints(self.directory)


def assert_same_state(a, b, where: str) -> None:
    """Bit for bit: tensors by torch.equal (and dtype), containers item by item."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), f"{where}: keys {sorted(a)} != {sorted(b)}"
        for key in a:
            assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), f"{where} differs in length"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def remove_stale_temp_files(directory: Path) -> list[Path]:
    """What a run removes from its checkpoints directory as it starts: debris of killed saves."""
    return CheckpointStore(directory, keep_last_k=1).manager.remove_stale_files()


# --- ports ------------------------------------------------------------------------------------


def free_port() -> int:
    """A TCP port on this machine that nothing listens on now (for a process group's master)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --- torchrun ----------------------------------------------------------------------------------

# Two ranks on this machine. --standalone: a rendezvous of its own on a free port, so jobs that
# run side by side (two test sessions on one machine) never meet on torchrun's default port.
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def torchrun_static_rendezvous(*options: str) -> list[str]:
    """torchrun, two ranks, without --standalone or --rdzv-id: a static rendezvous on a free
    master port, whose run id is "none" (so a run directory is named by the clock)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master-port={free_port()}",
            *options]


# --- exit statuses -----------------------------------------------------------------------------


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """A finished command that exited 0 (else the tail of its stderr shows why); returns it."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def refused(proc: subprocess.CompletedProcess, *phrases: str) -> str:
    """A finished command that exited 2 with exactly one line on stderr, `error: ...`, holding
    every phrase; returns that line."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-2000:]
    for phrase in phrases:
        assert phrase in lines[0], lines[0]
    return lines[0]


def job_ok(result: tuple[int, str]) -> str:
    """A Job's `finish()` (status, output) for a job that exited 0; returns its output."""
    status, output = result
    assert status == 0, output[-6000:]
    return output


def job_refused(result: tuple[int, str], *phrases: str) -> str:
    """A Job's `finish()` (status, output) for a job that exited 2 with one `error:` line among
    its output (stdout and stderr together, logging included) and no traceback, the line
    holding every phrase; returns that line."""
    status, output = result
    assert status == 2, output[-4000:]
    errors = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in output, output[-4000:]
    for phrase in phrases:
        assert phrase in errors[0], errors[0]
    return errors[0]


# --- damaged checkpoints ------------------------------------------------------------------------


def corrupt_tensor_bytes(path: Path, seed: int = 0, size: int = 4096) -> str:
    """Overwrite `size` bytes (at most the record's) in the middle of the largest tensor record
    (`<archive>/data/<N>`) of the torch.save file `path` with random ones, in place, its length
    and zip structure unchanged: what a bad disk or copy does, which torch.load does not notice.
    Returns the record's name (`data/<N>`). Hard links to `path` see the change too."""
    import random
    import zipfile

    with zipfile.ZipFile(path) as archive:
        tensors = [info for info in archive.infolist() if "/data/" in info.filename and "/.data/" not in info.filename]
        record = max(tensors, key=lambda info: info.file_size)
    with open(path, "r+b") as file:
        file.seek(record.header_offset + 26)  # the local header's name and extra-field lengths
        name_length, extra_length = int.from_bytes(file.read(2), "little"), int.from_bytes(file.read(2), "little")
        start = record.header_offset + 30 + name_length + extra_length
        size = min(size, record.file_size)
        file.seek(start + (record.file_size - size) // 2)
        file.write(_different_bytes(file, size, random.Random(seed)))
    return record.filename.split("/", 1)[1]


def corrupt_file_bytes(path: Path, seed: int = 0, size: int = 4096) -> None:
    """Overwrite `size` bytes in the middle of any file (a DCP shard file) with random ones."""
    import random

    length = path.stat().st_size
    size = min(size, length)
    with open(path, "r+b") as file:
        file.seek((length - size) // 2)
        file.write(_different_bytes(file, size, random.Random(seed)))


def _different_bytes(file, size: int, rng) -> bytes:
    """`size` random bytes that differ from the ones at the file's position (left there)."""
    position = file.tell()
    old = file.read(size)
    file.seek(position)
    new = bytes(rng.randrange(256) for _ in range(size))
    return new if new != old else bytes(b ^ 0xFF for b in old)


# --- watched subprocesses ----------------------------------------------------------------------

# What tests/interruptible_train.py prints after each optimizer step, on every rank.
STEP_ANNOUNCEMENT = re.compile(r"^interruptible: rank=(\d+) pid=(\d+) step=(\d+)$")


class Job:
    """A command in a subprocess (a session of its own), whose output (stdout and stderr
    together) is read as it runs: a test waits for a line, or for a rank's step announcement
    (tests/interruptible_train.py's), then signals the process it wants.

    Leaving the `with` block SIGCONTs and SIGKILLs whatever is left of it: the command's
    process group and every worker that announced itself (torchrun puts each worker in a
    session of its own).
    """

    def __init__(self, command: list[str], cwd: Path | None = None, env: dict[str, str] | None = None):
        """`env`: the command's whole environment (None: this process's)."""
        self.command = command
        self.started = time.monotonic()
        self.proc = subprocess.Popen(
            self.command, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, start_new_session=True,
        )
        self.lines: list[str] = []
        self.steps: dict[int, int] = {}  # rank -> last step announced
        self.pids: dict[int, int] = {}  # rank -> pid of the worker that announced it
        self.all_pids: set[int] = set()
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            line = line.rstrip("\n")
            with self._changed:
                self.lines.append(line)
                if match := STEP_ANNOUNCEMENT.match(line):
                    rank, pid, step = map(int, match.groups())
                    self.steps[rank], self.pids[rank] = step, pid
                    self.all_pids.add(pid)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_until(self, condition, what: str, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        with self._changed:
            while not condition():
                left = deadline - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._reader.is_alive()):
                    raise AssertionError(f"{what} did not happen; output:\n{self.output[-6000:]}")
                self._changed.wait(min(left, 0.5))

    def wait_for_step(self, step: int, rank: int = 0, timeout: float = 120) -> int:
        """Wait until `rank` announced `step` (or a later one); returns that rank's pid."""
        self.wait_until(lambda: self.steps.get(rank, 0) >= step, f"rank {rank} reaching step {step}", timeout)
        return self.pids[rank]

    def wait_for_line(self, pattern: str, timeout: float = 120) -> str:
        """Wait until a line matches `pattern` (re.search); returns the first that does."""
        found: list[str] = []

        def seen() -> bool:
            found[:] = [line for line in self.lines if re.search(pattern, line)]
            return bool(found)

        self.wait_until(seen, f"a line matching {pattern!r}", timeout)
        return found[0]

    def finish(self, timeout: float = 240) -> tuple[int, str]:
        """The command's exit status and the whole output."""
        try:
            status = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the job did not end within {timeout} s; output:\n{self.output[-6000:]}") from None
        self._reader.join(timeout=30)
        return status, self.output

    def send_signal(self, signum: int) -> None:
        """`signum` to the process the command started (a launcher: not its workers)."""
        os.kill(self.proc.pid, signum)

    def newest_step(self) -> int:
        """The newest step any rank announced so far (the job may be a step or two further)."""
        with self._changed:
            return max(self.steps.values(), default=0)

    def kill_leftovers(self) -> list[int]:
        """SIGCONT + SIGKILL every process of the job still alive; returns their pids."""
        left = [pid for pid in sorted(self.all_pids | {self.proc.pid}) if alive(pid)]
        for pid in left:
            for signum in (signal.SIGCONT, signal.SIGKILL):
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        return left

    def __enter__(self) -> "Job":
        return self

    def __exit__(self, *exc_info) -> None:
        self.kill_leftovers()


def alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie or a reaped one is not)."""
    try:
        with open(f"/proc/{pid}/stat") as file:
            return file.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


# --- a user's own package ----------------------------------------------------------------------


@contextlib.contextmanager
def user_package(root: Path, files: dict[str, str], package: str) -> Iterator[Path]:
    """`files` (relative path -> text, dedented) written under `root`, a folder outside the
    repository, which this process can import `package` from until the block ends."""
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text).lstrip())
    assert Path(__file__).resolve().parents[1] not in root.parents
    sys.path.insert(0, str(root))
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for name in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
            del sys.modules[name]
