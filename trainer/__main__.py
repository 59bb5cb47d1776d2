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
    importlib.import_module(f"ringtrain.tools.{tool}").main()


if __name__ == "__main__":
    main()
