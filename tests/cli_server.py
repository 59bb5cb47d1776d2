"""The process the tests' commands are forked from (conftest.run_cli and run_module).

It imports what every command imports first (torch, Hydra, OmegaConf, and torch._dynamo, which
torch.optim imports as the first optimizer is built: 3-4 s of each of the suite's hundreds of
commands) once, and then forks a child per command. The child is a process
of its own: it takes the command's working directory, environment, arguments and standard
streams, runs the command from its entry as `python train.py ...` or `python -m <module> ...`
would (ringtrain and everything else it imports, imported there), and ends with the command's
exit status through the interpreter's own exit (atexit, finalizers, an uncaught error's
traceback and status 1). conftest falls back to a plain subprocess where that is not the same:
under a launcher (torchrun), or where the environment differs in what torch reads as it is
imported.

One request at a time, a JSON line on stdin; the reply is two lines on stdout: the child's pid,
then its exit status (-N: ended by signal N, as subprocess reports it).
"""
from __future__ import annotations

import json
import os
import runpy
import sys

import hydra.main  # noqa: F401
import omegaconf  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401

# The path every interpreter starts with, without what Python put first for this server alone:
# its script's folder and its own PYTHONPATH (a command's own go in their place, run_command).
# Kept, the first command's PYTHONPATH (run_module's: the checkout) would shadow a later
# command's imports: a user project's `data` package found as the checkout's data/ folder.
_SERVERS_OWN = {os.path.abspath(path) for path in os.environ.get("PYTHONPATH", "").split(os.pathsep) if path}
BASE_PATH = [path for path in sys.path[1:] if os.path.abspath(path) not in _SERVERS_OWN]


def run_command(request: dict) -> None:
    """In the child: the command, as the interpreter would have started it."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                            (2, request["stderr"], os.O_WRONLY)):
        opened = os.open(path, flags)
        os.dup2(opened, fd)
        os.close(opened)
    extra_paths = [path for path in request["env"].get("PYTHONPATH", "").split(os.pathsep) if path]
    args = request["args"]
    if request["module"]:  # python -m: the working directory first on sys.path
        sys.argv = [request["module"], *args]
        sys.path[:] = [os.getcwd(), *extra_paths, *BASE_PATH]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
    else:  # python script.py: the script's directory first
        sys.argv = list(args)
        sys.path[:] = [os.path.dirname(os.path.abspath(args[0])), *extra_paths, *BASE_PATH]
        runpy.run_path(args[0], run_name="__main__")


def main() -> None:
    print("ready", flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            run_command(request)
            sys.exit(0)
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    main()
