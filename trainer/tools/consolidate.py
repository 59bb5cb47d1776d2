"""One plain checkpoint file from a sharded one: `ringtrain consolidate checkpoint=... [output=FILE]`.

A sharded run's `step-<N>.shards/` are read whole into one process (CPU memory must hold the full
state) and written as the file `strategy.state_dict_type=full` would have: loadable into a bare
model, resumable under any strategy. Without `output` it is `consolidated-step-<N>.pt` beside
`checkpoints/`, where rotation and auto-resume never touch it.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from ringtrain.checkpoints.files import save_checkpoint
from ringtrain.checkpoints.sharded import load_sharded
from ringtrain.checkpoints.state_dicts import full_model_state_dict, full_optimizer_state_dict
from ringtrain.errors import ConfigError
from ringtrain.optim import build_optimizer
from ringtrain.tools import composed_job, prepare, tool_main  # noqa: F401  (prepare: the entry's, ringtrain/__main__.py)
from ringtrain.tools.checkpoint_model import build_checked_model, read_checkpoint


def consolidate(checkpoint: str, output: str | None = None, trust_checkpoint: bool = False,
                job: dict | None = None, command: Any = None) -> Path:
    state = read_checkpoint(checkpoint, command.checkpoint if command else None)
    job = job if job is not None else composed_job(state, checkpoint)
    if "shards" not in state:
        raise ConfigError(
            f"checkpoint {checkpoint!r} is already one plain file (strategy.state_dict_type=full); "
            f"use it as it is"
        )
    model = build_checked_model(state, checkpoint, job, trust_checkpoint)
    optimizer = build_optimizer(job["optimizer"], model, torch.device("cpu"))
    for group in optimizer.param_groups:
        # The run's lr schedule added this key to every group, and DCP fills only the keys the
        # template has: with it, the shards' value comes back as the run saved it.
        group.setdefault("initial_lr", group["lr"])
    load_sharded(state["shards"], model, optimizer, trusted=trust_checkpoint)

    target = Path(output) if output else Path(checkpoint).absolute().parent.parent / (
        f"consolidated-step-{state['progress']['step']:08d}.pt")
    plain = {key: value for key, value in state.items() if key not in ("shards", "shard_checksums")}
    plain.update(model=full_model_state_dict(model), optimizer=full_optimizer_state_dict(model, optimizer))
    save_checkpoint(target, plain)
    return target


main = tool_main("consolidate", "ringtrain consolidate checkpoint=<run>/checkpoints/last.pt", consolidate)


if __name__ == "__main__":
    from ringtrain.__main__ import main as entry

    entry("consolidate")
