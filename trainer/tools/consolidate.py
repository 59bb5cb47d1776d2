"""One plain checkpoint file from a sharded one: `ringtrain consolidate checkpoint=...`.

    ringtrain consolidate checkpoint=outputs/runs/<run>/checkpoints/last.pt [output=FILE]

A run with `strategy=fsdp strategy.state_dict_type=sharded` keeps its weights and optimizer
state in `step-<N>.shards/`, each rank's part in its own file. This reads them whole into
one process (CPU memory, not GPU memory, must hold the full model and optimizer state) and
writes the same checkpoint in ringtrain's plain format: the file `state_dict_type=full`
would have written, loadable with `torch.load(path, weights_only=True)` into a bare model,
resumable under any strategy with `trainer.resume=FILE`. The model and its optimizer are
rebuilt from the checkpoint's own config (tools/checkpoint_model.py). Without `output` the file
is `consolidated-step-<N>.pt` in the run directory, beside `checkpoints/`, where rotation and
auto-resume never touch it. The write is as durable as every checkpoint's. A Hydra app like
every ringtrain command; its settings are conf/consolidate.yaml (`ringtrain consolidate --help`).
"""
from __future__ import annotations

from pathlib import Path

import hydra
import torch
from omegaconf import DictConfig

from ringtrain.checkpoints.files import save_checkpoint
from ringtrain.tools.checkpoint_model import build_checked_model, model_node, read_checkpoint
from ringtrain.config.compose import PrimaryConfig
from ringtrain.errors import ConfigError, exit_on_user_error
from ringtrain.config.optim import build_optimizer
from ringtrain.checkpoints.sharded import load_sharded
from ringtrain.checkpoints.state_dicts import full_model_state_dict, full_optimizer_state_dict
from ringtrain.tools.app import call_with_settings, run_tool, settings_for

CONSOLIDATE = PrimaryConfig(
    "consolidate", "ringtrain consolidate", usage="ringtrain consolidate checkpoint=<run>/checkpoints/last.pt",
)


def consolidate(checkpoint: str, output: str | None = None) -> Path:
    """Write the sharded `checkpoint` as one plain checkpoint file; returns its path."""
    state = read_checkpoint(checkpoint)
    if "shards" not in state:
        raise ConfigError(
            f"checkpoint {checkpoint!r} is already one plain file (strategy.state_dict_type=full); "
            f"use it as it is"
        )
    node = model_node(state, checkpoint)
    data_dims = state.get("data_dims") or {}
    optimizer_node = (state["config"] or {}).get("optimizer")
    if not isinstance(optimizer_node, dict) or "_target_" not in optimizer_node:
        raise ConfigError(
            f"checkpoint {checkpoint!r} holds no optimizer config (built in Python?), so its optimizer "
            f"state cannot be rebuilt; load the shards in Python with ringtrain.checkpoints.sharded.load_sharded"
        )
    model = build_checked_model(node, data_dims)
    optimizer = build_optimizer(optimizer_node, model, torch.device("cpu"))
    for group in optimizer.param_groups:
        # The run's lr schedule added this key to every group, and DCP fills only the keys the
        # template has: with it, the shards' value comes back as the run saved it.
        group.setdefault("initial_lr", group["lr"])
    load_sharded(state["shards"], model, optimizer)

    target = Path(output) if output else Path(checkpoint).absolute().parent.parent / (
        f"consolidated-step-{state['progress']['step']:08d}.pt")
    plain = {key: value for key, value in state.items() if key not in ("shards", "shard_checksums")}
    plain.update(model=full_model_state_dict(model), optimizer=full_optimizer_state_dict(model, optimizer))
    save_checkpoint(target, plain)
    return target


@hydra.main(version_base="1.3", config_path="pkg://ringtrain.conf", config_name="consolidate")
def consolidate_app(cfg: DictConfig) -> None:
    with exit_on_user_error():
        target = call_with_settings(consolidate, cfg, CONSOLIDATE)
    print(target)


def main() -> None:
    run_tool(consolidate_app, CONSOLIDATE, validate=lambda cfg: settings_for(consolidate, cfg, CONSOLIDATE))


if __name__ == "__main__":
    main()
