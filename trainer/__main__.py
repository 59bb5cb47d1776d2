"""The `ringtrain` command (also `python -m ringtrain`): train, or run one of the tools.

    ringtrain [overrides]                 train (ringtrain/tools/train.py)
    ringtrain evaluate checkpoint=...     a checkpoint's validation metrics
    ringtrain sample checkpoint=...       text from a language model's checkpoint
    ringtrain consolidate checkpoint=...  a sharded fsdp checkpoint as one plain file
    ringtrain export checkpoint=...       the trained weights as safetensors or a Hugging Face directory
    ringtrain prepare_tokens input=...    a text file as token files for data=token_file

Every one is a Hydra app: `--help`, `--cfg job`, `key=value`, `+key`, `~key`,
`--config-dir` and `-m` work the same in each.
"""
import gc
import importlib
import os
import signal
import sys

TOOLS = ("train", "evaluate", "sample", "consolidate", "export", "prepare_tokens")


def _interrupted_outside_training(signum, frame):
    """Ctrl-C while starting up (imports, composing, building) or while finishing: nothing is
    being trained, so there is nothing to save; one line instead of a KeyboardInterrupt
    traceback from whatever was being imported. Training itself handles SIGINT in
    ringtrain/loop/signals.py (finish the step, save last.pt, exit 143) and restores this after."""
    print("interrupted by SIGINT outside training (nothing to save); exiting with status 130", file=sys.stderr)
    sys.stderr.flush()
    os._exit(128 + signal.SIGINT)


def main() -> None:
    # Before the heavy imports (torch takes seconds); not where SIGINT is ignored (a shell's
    # background job): that stays so.
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _interrupted_outside_training)
    tool = "train"
    if len(sys.argv) > 1 and sys.argv[1].replace("-", "_") in TOOLS:
        tool = sys.argv.pop(1).replace("-", "_")
    try:
        importlib.import_module(f"ringtrain.tools.{tool}").main()
    finally:
        _skip_the_last_collections()


def _skip_the_last_collections() -> None:
    """Leave every object alive now out of the garbage collections Python runs while it exits.

    The job is over: its files are closed, its logs flushed, its checkpoints written, and exit
    handlers still run. What is left is the interpreter tearing down its modules, and torch,
    torch._dynamo (imported by every optimizer), Hydra and TensorBoard leave some 320 000
    objects, which each of those full collections walks again. That took 0.4 s of the default
    job's 2.6 s here (benchmarks/bench_process.py): longer than its 3130 training steps.
    Objects still go when their last reference does; only the reference cycles left at exit
    are left to the operating system, and Python never promised to finalise those.
    """
    gc.freeze()


if __name__ == "__main__":
    main()
