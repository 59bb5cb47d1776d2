"""A checkpoint of an older ringtrain (format 2) rewritten as data: `ringtrain upgrade`.

Format 2 kept the run's config as nodes that the tools built again, so a file could choose the
code that ran; this ringtrain refuses such files. A file you trust gets the recipe format 3
records instead (config/recipe.py), read from the run's own `<run>/.hydra/hydra.yaml`; the rest
of the state is kept. Without `output` the file is replaced in place, its old bytes kept as
`<name>.format2` beside it.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from omegaconf import OmegaConf

from ringtrain.checkpoints.files import CHECKPOINT_FORMAT, Unusable, check_file_bytes, save_checkpoint
from ringtrain.config.recipe import record
from ringtrain.errors import ConfigError
from ringtrain.tools import tool_main


def upgrade(checkpoint: str, trust_checkpoint: bool = False, output: str | None = None) -> Path:
    path = Path(checkpoint)
    run_record = path.absolute().parent.parent / ".hydra" / "hydra.yaml"  # the run's own, as Hydra wrote it
    if not trust_checkpoint:
        raise ConfigError(f"upgrading {checkpoint} keeps what its run's record says it was trained with; add "
                          f"trust_checkpoint=true if you trust the file and its run directory")
    try:
        check_file_bytes(path)
        state = torch.load(path, map_location="cpu", weights_only=True)
        hydra = OmegaConf.load(run_record).hydra
    except (Unusable, OSError, RuntimeError) as err:
        raise ConfigError(f"{checkpoint} or its run's record {run_record} cannot be read ({str(err).splitlines()[0][:200]}); "
                          f"run upgrade on a checkpoint inside its run directory (<run>/checkpoints/)") from None
    held = f"format {state.get('format')!r}" if isinstance(state, dict) else f"a {type(state).__name__}"
    if held != "format 2":
        raise ConfigError(f"checkpoint {checkpoint} is not of format 2 (it holds {held}): nothing to upgrade")
    # The run's resolved config, kept by format 2, names its files relative to where the run started.
    resolved = state.get("config") if isinstance(state.get("config"), dict) else None
    state["job"], state["format"] = record(hydra, resolved), CHECKPOINT_FORMAT
    target = Path(output) if output else path
    if target.resolve() == path.resolve() and not (kept := path.with_name(path.name + ".format2")).exists():
        os.link(path, kept)  # the old bytes stay, under another name
    save_checkpoint(target, state)
    return target


# No `prepare`: the file is read by the tool itself (this ringtrain refuses it elsewhere).
main = tool_main("upgrade", "ringtrain upgrade checkpoint=<run>/checkpoints/last.pt trust_checkpoint=true", upgrade,
                 lambda target: print(f"wrote {target} (format {CHECKPOINT_FORMAT})"))


if __name__ == "__main__":
    from ringtrain.__main__ import main as entry

    entry("upgrade")
