"""A checkpoint's trained weights in the formats the rest of the field loads: `ringtrain export`
(README.md "Exporting"; settings: conf/export.yaml).

format=safetensors is one file, a tied tensor stored once (safetensors requires it); format=hf
what a `transformers` model's `save_pretrained` writes, with the tokenizer; format=peft a LoRA
run's adapters alone. An export replaces only what an earlier export wrote (ringtrain's mark in
a file's metadata, or the files a directory's .ringtrain-export lists), and appears complete or
not at all. Without `output` it goes beside checkpoints/, where rotation never touches it.
"""
from __future__ import annotations

import inspect
import os
import shutil
import sys
import tempfile
from pathlib import Path
from collections.abc import Callable
from typing import Any, Literal

from torch import nn

from ringtrain.components import build
from ringtrain.data.tasks import ClassificationTask, LanguageModelTask
from ringtrain.errors import ConfigError
from ringtrain.models.lora import merge_lora, save_peft_adapter
from ringtrain.storage import fsync_directory, replace_atomically, replace_directory
from ringtrain.tools import composed_job, prepare, tool_main  # noqa: F401  (prepare: the entry's, ringtrain/__main__.py)
from ringtrain.tools.checkpoint_model import read_checkpoint, rebuild_model, task_kind

MARK = ".ringtrain-export"  # in an exported directory, and a key of an exported file's metadata
MANIFEST_HEADER = "written by ringtrain export; a later export replaces these files and keeps any other:\n"


def export(checkpoint: str, format: Literal["safetensors", "hf", "peft"] = "safetensors", output: str | None = None,  # noqa: A002
           overwrite: bool = False, weights: str = "model", trust_checkpoint: bool = False,
           job: dict | None = None, command: Any = None) -> Path:
    """The file or directory written (`job`: the composed job's sections)."""
    state = read_checkpoint(checkpoint, command.checkpoint if command else None)
    job = job if job is not None else composed_job(state, checkpoint)
    node = job.get("model") or {}
    step = (state.get("progress") or {}).get("step", 0)
    default = Path(checkpoint).absolute().parent.parent / "export" / f"step-{step:08d}"
    target = Path(output) if output else default.with_suffix(".safetensors") if format == "safetensors" else default
    _refuse_to_replace(target, format, overwrite)
    adapter = job.get("adapter")
    if format == "peft" and not adapter:
        raise ConfigError(f"format=peft writes a run's adapters, but {checkpoint} was trained without any "
                          f"(adapter=lora); use format=safetensors or format=hf")
    model = rebuild_model(state, checkpoint, job, weights, trust_checkpoint)
    if format == "peft":
        # PEFT's name for the task (CAUSAL_LM loads as PeftModelForCausalLM, with generate); None: its plain PeftModel.
        lora, kind = build(adapter, "adapter"), task_kind(job.get("task"))  # the composed job's, never the file's
        kinds = ((LanguageModelTask, "CAUSAL_LM"), (ClassificationTask, "SEQ_CLS"))
        task_type = next((name for base, name in kinds if inspect.isclass(kind) and issubclass(kind, base)), None)
        write_directory(target, lambda d: save_peft_adapter(model, lora, d, node.get("pretrained_model_name_or_path"),
                                                            task_type), overwrite)
        return target
    if adapter:
        merge_lora(model)
    if format == "safetensors":
        try:
            from safetensors.torch import save_model
        except ImportError:
            raise ConfigError("format=safetensors needs safetensors: pip install 'ringtrain[hf]' (or safetensors)") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        replace_atomically(target, lambda temp: (  # "pt": the format transformers expects
            save_model(model, str(temp), metadata={"format": "pt", MARK: "1"}), _finish_file(temp)))
    else:
        if not callable(getattr(model, "save_pretrained", None)):
            raise ConfigError(
                f"format=hf writes a Hugging Face directory, but this checkpoint's model ({node['_target_']}) is not "
                f"a transformers model (it has no save_pretrained); use format=safetensors"
            )
        write_pretrained_directory(model, state.get("vocab"), target, overwrite)
    return target


def write_pretrained_directory(model: nn.Module, vocab: dict[str, Any] | None, target: Path,
                               overwrite: bool = False) -> None:
    """`model.save_pretrained` (config and weights) and the vocabulary's tokenizer, if it has one, at `target`."""
    write_directory(target, lambda directory: (model.save_pretrained(str(directory)), _save_tokenizer(vocab, directory)),
                    overwrite)


def write_directory(target: Path, fill: Callable[[Path], Any], overwrite: bool = False) -> None:
    """What `fill` writes into a new directory, its mark listing those files, replacing `target`
    once complete; what `target` holds besides the files its own mark lists is kept."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)  # left by a killed export
    try:
        fill(partial)
        written = sorted(str(p.relative_to(partial)) for p in partial.rglob("*") if p.is_file())
        (partial / MARK).write_text(MANIFEST_HEADER + "".join(f"{name}\n" for name in written))
        for name in [*written, MARK]:
            _finish_file(partial / name)
        if target.is_dir():
            _keep_what_no_export_wrote(target, partial, set(written), overwrite)
        fsync_directory(partial)
        replace_directory(partial, target)
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _keep_what_no_export_wrote(target: Path, partial: Path, written: set[str], overwrite: bool) -> None:
    """Hard-link into `partial` every file under `target` that its mark does not list (the same
    file, not a copy: nothing is moved, so a failure before the swap leaves `target` whole)."""
    listed = (target / MARK).read_text().splitlines() if (target / MARK).is_file() else []
    # The files its mark lists (none in a mark older than the list).
    exported = set(listed[1:] if listed[:1] == [MANIFEST_HEADER.strip()] else []) | {MARK}
    for path in sorted(target.rglob("*")):
        name = str(path.relative_to(target))
        if path.is_dir() and not path.is_symlink():
            (partial / name).mkdir(parents=True, exist_ok=True)
            continue
        if name in exported or (name in written and overwrite):
            continue
        if name in written:
            raise ConfigError(f"output={target} holds {name}, which ringtrain export did not write and would "
                              f"replace; move it away, or pass overwrite=true to replace it")
        if path.is_symlink():
            os.symlink(os.readlink(path), partial / name)
            continue
        try:
            os.link(path, partial / name)
        except OSError:  # a file system without hard links
            shutil.copy2(path, partial / name)


def _save_tokenizer(vocab: dict[str, Any] | None, directory: Path) -> None:
    """A `bpe` vocabulary as transformers' fast tokenizer, with a chat fine-tune's template and
    end-of-text token. The template goes into tokenizer_config.json, where every version of
    transformers looks (transformers 5 would write chat_template.jinja, which older readers skip)."""
    kind = (vocab or {}).get("kind")
    if kind == "bpe":
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(vocab["tokenizer_json"]),
                                            chat_template=vocab.get("chat_template"), eos_token=vocab.get("eos_token"))
        tokenizer.save_pretrained(str(directory), save_jinja_files=False)
    elif kind is not None:
        print(f"note: no tokenizer written: the data's {kind} vocabulary has no Hugging Face tokenizer "
              f"(ringtrain sample decodes with the checkpoint's vocabulary)", file=sys.stderr)


def _refuse_to_replace(target: Path, format: str, overwrite: bool) -> None:  # noqa: A002
    """One line before anything is built: a path through a file, a directory where a file goes,
    or something at `target` that no export wrote (unless `overwrite`)."""
    existing = next(parent for parent in target.absolute().parents if parent.exists())  # nothing exists under a file
    if not existing.is_dir():
        raise ConfigError(f"output={target} goes through {existing}, which is a file; choose an output in a directory")
    # Whether the folders to it can be made there: a folder made and removed in the nearest one that
    # exists (permissions alone do not say: /proc, a read-only mount, a full disk).
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ringtrain-export-", dir=existing))
    except OSError as err:
        raise ConfigError(f"output={target} cannot be written: nothing can be created in {existing} "
                          f"({err.strerror}); choose an output in a folder you can write to") from None
    if format == "safetensors" and target.is_dir():
        raise ConfigError(f"output={target} is a directory; name the .safetensors file to write")
    if target.exists() and not overwrite and not _exported(target):
        raise ConfigError(f"output={target} exists and was not written by ringtrain export; choose another output, "
                          f"or pass overwrite=true to replace it")


def _exported(target: Path) -> bool:
    if target.is_dir():
        return (target / MARK).is_file()
    try:
        from safetensors import safe_open

        with safe_open(str(target), "pt") as file:
            return MARK in (file.metadata() or {})
    except Exception:  # not a safetensors file at all
        return False


def _finish_file(path: Path) -> None:
    """Durable, and readable as any file this process writes: safetensors creates its files
    for the owner alone (0600), whatever the umask allows."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)
    with open(path, "rb") as file:
        os.fsync(file.fileno())


main = tool_main("export", "ringtrain export checkpoint=<run>/checkpoints/best.pt format=safetensors", export)


if __name__ == "__main__":
    from ringtrain.__main__ import main as entry

    entry("export")
