"""The `ringtrain` command (also `python -m ringtrain`): train, or run one of the tools.

    ringtrain [overrides]                 train (ringtrain/tools/train.py)
    ringtrain evaluate checkpoint=...     a checkpoint's validation metrics
    ringtrain sample checkpoint=...       text from a language model's checkpoint
    ringtrain consolidate checkpoint=...  a sharded fsdp checkpoint as one plain file
    ringtrain export checkpoint=...       the trained weights as safetensors or a Hugging Face directory
    ringtrain prepare_tokens input=...    a text file as token files for data=token_file
    ringtrain upgrade checkpoint=...      a checkpoint of an older ringtrain rewritten as data

Every one is a Hydra app: `--help`, `--cfg job`, `key=value`, `+key`, `~key`,
`--config-dir` and `-m` work the same in each. This module alone reads the command line
(sys.argv); docs/ARCHITECTURE.md says how a checkpoint's recipe goes before the user's.
"""
import difflib
import gc
import importlib
import os
import re
import signal
import sys

from ringtrain.conf import CONF_DIR  # imports neither torch nor Hydra

TOOLS = ("train", "evaluate", "sample", "consolidate", "export", "prepare_tokens", "upgrade")


def _interrupted_outside_training(signum, frame):
    """Ctrl-C while starting up or finishing: nothing to save, so one line instead of a
    KeyboardInterrupt traceback from whatever was being imported. Training handles SIGINT
    itself (loop/stopping.py: finish the step, save last.pt, exit 143) and restores this after."""
    print("interrupted by SIGINT outside training (nothing to save); exiting with status 130", file=sys.stderr)
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


def main(tool: str | None = None) -> None:
    """Run `tool` (None: the command's first word names it, else train) on this command line;
    `python -m ringtrain.tools.<tool>` names its tool."""
    # Before the heavy imports (torch takes seconds); not where SIGINT is ignored (a shell's
    # background job): that stays so.
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_outside_training)
    program, args = sys.argv[0], sys.argv[1:]
    if tool is None and args and args[0].replace("-", "_") in TOOLS:
        tool = args.pop(0).replace("-", "_")
    elif tool is None and args:
        _refuse_a_mistyped_command(args[0])
    try:
        from ringtrain.config import CommandLine
        from ringtrain.errors import exit_on_user_error

        module = importlib.import_module(f"ringtrain.tools.{tool or 'train'}")
        with exit_on_user_error():
            # A tool with no checkpoint to read first (prepare_tokens, upgrade) has no `prepare`.
            commands = getattr(module, "prepare", lambda command: [command])(CommandLine(program, args))
        # `_target_: my_pkg.MyNet` imports from where you run, as `python -m` would (a console
        # script or `python train.py` puts only its own folder on the path).
        sys.path.insert(1, os.getcwd())
        for command in commands:  # one, or a multirun's per checkpoint recipe (tools/__init__.py)
            sys.argv[:] = [program, *command.hydra_args()]  # what Hydra's own parser reads
            module.main(command)
    finally:
        # Leave every object alive now out of the garbage collections Python runs while it exits:
        # torch, dynamo, Hydra and TensorBoard leave some 320 000 objects that each exit collection
        # walks again: 0.4 s of the default job's 2.6 s (benchmarks/bench_process.py). Objects
        # still go with their last reference; only cycles left at exit go to the operating system,
        # and Python never promised to finalise those.
        gc.freeze()


def _refuse_a_mistyped_command(first: str) -> None:
    """`ringtrain exprt checkpoint=x`: a bare word close to a command's name is its typo, not an
    override (Hydra would say only "missing EQUAL"): one line, exit 2. A config group's name
    (`ringtrain trainer`) is left to Hydra's message, which says group=option."""
    if not re.fullmatch(r"[A-Za-z][\w-]*", first):
        return
    close = difflib.get_close_matches(first.replace("-", "_").lower(), TOOLS, n=1, cutoff=0.6)
    groups = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}  # model, trainer, ...
    if not close or first in groups:
        return
    print(f"error: {first} is not a ringtrain command; did you mean {close[0]}? (commands: {', '.join(TOOLS)})",
          file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
    main()
