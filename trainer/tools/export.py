"""A checkpoint's trained weights in the formats the rest of the field loads: `ringtrain export`.

    ringtrain export checkpoint=<run>/checkpoints/best.pt                       # format=safetensors
    ringtrain export checkpoint=<run>/checkpoints/best.pt format=hf             # a from_pretrained directory
    ringtrain export checkpoint=... output=model.safetensors

format=safetensors writes the model's weights as one `.safetensors` file (safetensors.torch's
`save_model`): a tensor tied to another (a language model's output layer and its token
embedding) is stored once, under one name, with the other name in the file's metadata, as
safetensors requires; `safetensors.torch.load_model` and `trainer.init_from=` load it back.
format=hf is for a Hugging Face model (a `transformers` model, built from a config node or
`from_pretrained`): the model's own `save_pretrained` writes its config and weights, so
`AutoModelForCausalLM.from_pretrained(<output>)` loads it; a tokenizer goes with it when the
data's vocabulary has one (a character or byte vocabulary has none: a note says so).

The model is rebuilt from the checkpoint alone (tools/checkpoint_model.py), so a sharded fsdp
checkpoint exports too (its shards are read whole into this process's CPU memory). Without
`output` the result goes to `<run dir>/export/step-<N>.safetensors` or `<run dir>/export/step-<N>/`,
beside checkpoints/, where rotation never touches it. The file or directory appears complete
or not at all (written under a temporary name, fsynced, renamed). A Hydra app like every
ringtrain command; its settings are conf/export.yaml (`ringtrain export --help`).
"""
from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any, Literal

import hydra
from omegaconf import DictConfig
from torch import nn

from ringtrain.checkpoints.atomic import fsync_directory, replace_atomically, replace_directory
from ringtrain.config.compose import PrimaryConfig
from ringtrain.errors import ConfigError, exit_on_user_error
from ringtrain.tools.app import call_with_settings, run_tool, settings_for
from ringtrain.tools.checkpoint_model import model_node, read_checkpoint, rebuild_model

EXPORT = PrimaryConfig(
    "export", "ringtrain export", usage="ringtrain export checkpoint=<run>/checkpoints/best.pt format=safetensors",
)


def export(checkpoint: str, format: Literal["safetensors", "hf"] = "safetensors", output: str | None = None) -> Path:
    """Write the weights of `checkpoint` as `format`; returns the file or directory written."""
    state = read_checkpoint(checkpoint)
    node = model_node(state, checkpoint)
    step = (state.get("progress") or {}).get("step", 0)
    default = Path(checkpoint).absolute().parent.parent / "export" / f"step-{step:08d}"
    if format == "safetensors":
        target = Path(output) if output else default.with_suffix(".safetensors")
        _refuse_a_directory(target)
        model = rebuild_model(node, state.get("data_dims") or {}, state, checkpoint)
        write_safetensors(model, target)
    else:
        target = Path(output) if output else default
        _refuse_a_foreign_directory(target)
        model = rebuild_model(node, state.get("data_dims") or {}, state, checkpoint)
        if not callable(getattr(model, "save_pretrained", None)):
            raise ConfigError(
                f"format=hf writes a Hugging Face directory, but this checkpoint's model ({node['_target_']}) is not "
                f"a transformers model (it has no save_pretrained); use format=safetensors"
            )
        write_pretrained_directory(model, state.get("vocab"), target)
    return target


def write_safetensors(model: nn.Module, target: Path) -> None:
    """`model`'s weights as a safetensors file at `target`, tied tensors stored once."""
    save_model = _safetensors().save_model
    target.parent.mkdir(parents=True, exist_ok=True)

    def write(temp: Path) -> None:
        save_model(model, str(temp), metadata={"format": "pt"})  # "pt": what transformers expects
        _finish_file(temp)

    replace_atomically(target, write)


def write_pretrained_directory(model: nn.Module, vocab: dict[str, Any] | None, target: Path) -> None:
    """`model.save_pretrained` (config and weights) and the vocabulary's tokenizer, if it has
    one, into a directory that replaces `target` once complete."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a killed export
    try:
        model.save_pretrained(str(partial))
        _save_tokenizer(vocab, partial)
        for file in partial.rglob("*"):
            if file.is_file():
                _finish_file(file)
        fsync_directory(partial)
        replace_directory(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _save_tokenizer(vocab: dict[str, Any] | None, directory: Path) -> None:
    """A `bpe` vocabulary is a `tokenizers` tokenizer: saved as transformers' fast tokenizer,
    so AutoTokenizer.from_pretrained(directory) encodes as the run did. A character or byte
    vocabulary has no Hugging Face counterpart: a note says so."""
    kind = (vocab or {}).get("kind")
    if kind == "bpe":
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        tokenizer = Tokenizer.from_str(vocab["tokenizer_json"])
        PreTrainedTokenizerFast(tokenizer_object=tokenizer).save_pretrained(str(directory))
    elif kind is not None:
        print(f"note: no tokenizer written: the data's {kind} vocabulary has no Hugging Face tokenizer "
              f"(ringtrain sample decodes with the checkpoint's vocabulary)", file=sys.stderr)


def _refuse_a_directory(target: Path) -> None:
    if target.is_dir():
        raise ConfigError(f"output={target} is a directory; name the .safetensors file to write")


def _refuse_a_foreign_directory(target: Path) -> None:
    """An earlier export is replaced; anything else at `target` is never deleted."""
    if target.exists() and not (target.is_dir() and (target / "config.json").is_file()):
        raise ConfigError(
            f"output={target} exists and is not an exported model directory; choose a new output"
        )


def _finish_file(path: Path) -> None:
    """Durable, and readable as any file this process writes: safetensors creates its files
    for the owner alone (0600), whatever the umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _safetensors():
    try:
        import safetensors.torch
    except ImportError:
        raise ConfigError("format=safetensors needs safetensors: pip install 'ringtrain[hf]' (or safetensors)") from None
    return safetensors.torch


@hydra.main(version_base="1.3", config_path="pkg://ringtrain.conf", config_name="export")
def export_app(cfg: DictConfig) -> None:
    with exit_on_user_error():
        target = call_with_settings(export, cfg, EXPORT)
    print(target)


def main() -> None:
    # transformers' progress bars (loading, writing shards) would be all the output besides the
    # path written; HF_HUB_DISABLE_PROGRESS_BARS=0 brings them back.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    run_tool(export_app, EXPORT, validate=lambda cfg: settings_for(export, cfg, EXPORT))


if __name__ == "__main__":
    main()
