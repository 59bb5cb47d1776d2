"""The whole default job as a process, start to exit: `python train.py` against the seed
tutorial's own script run the same way, interleaved, plus where ringtrain's start-up goes.

The tutorial (seed 000, single-process section): y = 2x + 3 + noise, 10 000 samples,
DataLoader(batch_size=32, shuffle=True), SGD lr 0.01, 10 epochs, `loss.item()` every step
(bench_tutorial_loop.py's copy of it, run as a script). ringtrain's default job trains the same, and also validates, checkpoints (durably) and
logs to TensorBoard every epoch. Both run as fresh processes with one CPU thread, after one
untimed run of each, reading the bytecode Python wrote (`child_env`).

    python benchmarks/bench_process.py [--repeats 5]

Prints each process's wall time (best and median of N, interleaved), the ratio, and where each
process's time goes in a marked run of each (ringtrain's: the one of N more with the least
start-up): importing torch, importing ringtrain's command, Hydra's composition (and run
directory), ringtrain's check of the job, claiming the run directory, building the components,
callbacks and loggers, the training loop, finishing the job, and the interpreter's own start
and exit. Last, ringtrain's start-up against the floor
under any `@hydra.main` program, an empty Hydra app's import and start-up, run in turn with
ringtrain's marked runs: best and median of N each.
"""
from __future__ import annotations

import argparse
import ast
import inspect
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

from bench_tutorial_loop import SimpleDataset, SimpleModel, tutorial_loop  # noqa: E402  (this folder)

# The tutorial as a script of its own: the same classes and loop bench_tutorial_loop.py times.
TUTORIAL = "\n\n".join([
    "import time\nimport torch\nimport torch.nn as nn\nimport torch.optim as optim\n"
    "from torch.utils.data import DataLoader, Dataset",
    inspect.getsource(SimpleDataset), inspect.getsource(SimpleModel), inspect.getsource(tutorial_loop),
    "print('w={1:.4f} b={2:.4f}'.format(*tutorial_loop()))\n",
])

# Where each process's time goes: the same job, run once more with marks at each phase. The
# marks wrap ringtrain's own functions from outside (nothing in ringtrain measures itself);
# what the interpreter spends before the first mark and after the last (its start, and its
# exit: module teardown and the garbage collections that walk what is left) is the process's
# wall time minus the last mark.
MARKS = """
import atexit, sys, time
T0 = time.perf_counter()
marks = []
def mark(name):
    marks.append((name, time.perf_counter() - T0))
atexit.register(lambda: print(repr(marks), file=sys.stderr))
import torch
mark("import torch")
import torch._dynamo  # both pay it where the first optimizer is built; named on its own here
mark("import torch._dynamo (the first optimizer's)")
"""

RINGTRAIN_MARKS = MARKS + """
import ringtrain.tools.train as command, ringtrain.run as run
mark("import ringtrain's command")
def marked(module, name, before, after):
    function = getattr(module, name)
    def wrapper(*args, **kwargs):
        mark(before)
        try:
            return function(*args, **kwargs)
        finally:
            mark(after)
    setattr(module, name, wrapper)
marked(command, "validate", "Hydra composed the job (and made its run directory)", "ringtrain checked the job (validate)")
marked(run, "_build", "run directory claimed, nothing to resume", "data, task and model built")
marked(run, "fit", "callbacks and loggers built", "training loop (fit) done")
sys.argv = ["train.py"] + sys.argv[1:]  # as `python train.py ...` sees it
from ringtrain.__main__ import main
try:
    main()
finally:
    mark("command returned")
"""

TUTORIAL_MARKS = MARKS + """
exec(compile(open(sys.argv[1]).read(), sys.argv[1], "exec"))
mark("the script's dataset, model, optimizer and 10 epochs")
"""


# The floor under any `@hydra.main` program: an app whose config is one key, as a process,
# marked at `import hydra` and at its task's first line (Hydra composes the config twice,
# once to read hydra.mode, and makes the run directory and its logging on the way).
HYDRA_FLOOR = """
import sys, time
T0 = time.perf_counter()
import hydra
T1 = time.perf_counter()
@hydra.main(version_base="1.3", config_path=sys.argv.pop(1), config_name="one_key")
def task(cfg):
    print(repr((T1 - T0, time.perf_counter() - T1)), file=sys.stderr)
task()
"""


def child_env(**extra: str) -> dict[str, str]:
    """Every child's environment: one CPU thread, and Python's bytecode written and reused, as on
    a user's machine. A machine that sets PYTHONDONTWRITEBYTECODE (this VM does) makes each
    process compile ringtrain's modules from source (~0.1 s here), while torch and Hydra read
    the bytecode pip wrote at install: that would be the setting's cost, not ringtrain's."""
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    return {**env, "OMP_NUM_THREADS": "1", **extra}


def hydra_floor(scratch: Path, run: int) -> tuple[float, float]:
    """One run's seconds of (import hydra, @hydra.main up to the task)."""
    (scratch / "one_key.yaml").write_text("key: 1\n")
    done = subprocess.run([sys.executable, "-c", HYDRA_FLOOR, str(scratch), f"hydra.run.dir={scratch}/floor{run}"],
                          cwd=scratch, env=child_env(), check=True, capture_output=True, text=True)
    return ast.literal_eval(done.stderr.strip().splitlines()[-1])


def timed(command: list[str], cwd: str) -> float:
    env = child_env(PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    subprocess.run(command, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - started


def timeline(command: list[str], cwd: str) -> list[tuple[str, float]]:
    """Each phase's seconds in one marked run of `command` (see MARKS)."""
    env = child_env(PYTHONUNBUFFERED="1")
    started = time.perf_counter()
    done = subprocess.run(command, cwd=cwd, env=env, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - started
    marks = ast.literal_eval(done.stderr.strip().splitlines()[-1])
    phases, previous = [], 0.0
    for name, at in marks:
        phases.append((name, at - previous))
        previous = at
    phases.append(("interpreter start and exit", wall - previous))
    return phases


def start_up(phases: list[tuple[str, float]]) -> float:
    """ringtrain's own start-up in a marked run: its import, Hydra's composition, up to the loop."""
    return sum(seconds for phase, seconds in phases
               if not phase.startswith(("import torch", "training loop", "command returned", "interpreter")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        tutorial = Path(scratch) / "tutorial.py"
        tutorial.write_text(TUTORIAL)
        run_dir = Path(scratch) / "run"
        ringtrain = [sys.executable, str(REPO / "train.py"), f"hydra.run.dir={run_dir}", "trainer.resume=null"]
        times: dict[str, list[float]] = {"tutorial": [], "ringtrain": []}
        timed([sys.executable, str(tutorial)], scratch)  # untimed warm-ups: bytecode written, files cached
        timed(ringtrain, scratch)
        for _ in range(args.repeats):
            times["tutorial"].append(timed([sys.executable, str(tutorial)], scratch))
            subprocess.run(["rm", "-rf", str(run_dir)], check=True)
            times["ringtrain"].append(timed(ringtrain, scratch))
        # ringtrain's marked runs and the floor's, interleaved (the VM's pace drifts over minutes).
        marked, floors = [], []
        for i in range(args.repeats):
            marked.append(timeline([sys.executable, "-c", RINGTRAIN_MARKS, f"hydra.run.dir={run_dir}{i}",
                                    "trainer.resume=null"], scratch))
            floors.append(hydra_floor(Path(scratch), i))
        phases = {"tutorial": timeline([sys.executable, "-c", TUTORIAL_MARKS, str(tutorial)], scratch),
                  "ringtrain": min(marked, key=start_up)}  # the run with the least start-up, shown
    print(f"python {sys.version.split()[0]}, {args.repeats} interleaved runs of each process")
    for name, values in times.items():
        print(f"{name:10s} best {min(values):.2f} s   median {statistics.median(values):.2f} s")
    print(f"ringtrain / tutorial: best {min(times['ringtrain']) / min(times['tutorial']):.2f}x, "
          f"median {statistics.median(times['ringtrain']) / statistics.median(times['tutorial']):.2f}x")
    for name, steps in phases.items():
        print(f"{name}, marked run ({sum(s for _, s in steps):.2f} s):")
        for phase, seconds in steps:
            print(f"  {seconds:6.3f} s  {phase}")
    ours, floor = [start_up(run) for run in marked], [sum(run) for run in floors]
    best_floor = min(floors, key=sum)
    print(f"ringtrain's start-up (its import to the loop) best {min(ours):.3f} s, median {statistics.median(ours):.3f} s. "
          f"Hydra's floor, an empty @hydra.main app (import hydra + up to its task), in turn with it: best "
          f"{best_floor[0]:.3f} + {best_floor[1]:.3f} = {min(floor):.3f} s, median {statistics.median(floor):.3f} s. "
          f"Above the floor: best {min(ours) - min(floor):+.3f} s, median {statistics.median(ours) - statistics.median(floor):+.3f} s")

if __name__ == "__main__":
    main()
