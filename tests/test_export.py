"""`ringtrain export`: a checkpoint's weights as a safetensors file (tied tensors stored once),
loadable by safetensors itself and by trainer.init_from, and the refusals (tools/export.py).
A Hugging Face model's export as a from_pretrained directory is in tests/test_hf_pretrained.py,
a sharded fsdp checkpoint's in tests/test_fsdp_training.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_module, train_in_process
from helpers import ok, refused

TINY = ["model=transformer", "model.block_size=8", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
        "data.num_train_tokens=2000", "data.num_val_tokens=200", "data.vocab_size=16", "trainer.batch_size=8"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A tiny Transformer (output layer tied to the token embedding) trained a few steps."""
    run = tmp_path_factory.mktemp("export") / "run"
    train_in_process(TINY + ["optimizer=adamw", "trainer.max_steps=4"], run)
    return run / "checkpoints" / "best.pt"


def test_safetensors_export_holds_the_checkpoints_weights_with_the_tied_one_once(checkpoint, tmp_path):
    from safetensors import safe_open

    proc = ok(run_module("ringtrain", ["export", f"checkpoint={checkpoint}"], cwd=tmp_path))
    written = Path(proc.stdout.strip())
    assert written == checkpoint.parent.parent / "export" / "step-00000004.safetensors"
    assert not list(tmp_path.iterdir())  # nothing in the current directory
    saved = torch.load(checkpoint, weights_only=True)["model"]
    with safe_open(str(written), "pt") as file:
        tensors = {name: file.get_tensor(name) for name in file.keys()}
        aliases = {name: kept for name, kept in file.metadata().items() if name not in ("format", ".ringtrain-export")}
    assert aliases == {"token_embedding.weight": "lm_head.weight"}  # one matrix, stored once
    assert set(tensors) | set(aliases) == set(saved) and not set(tensors) & set(aliases)
    for name, tensor in saved.items():
        assert torch.equal(tensors[aliases.get(name, name)], tensor), name


def test_an_exported_file_starts_a_new_run_with_the_same_weights(checkpoint, tmp_path):
    target = tmp_path / "weights.safetensors"
    ok(run_module("ringtrain", ["export", f"checkpoint={checkpoint}", f"output={target}"]))
    train_in_process(TINY + ["optimizer.lr=0.0", "trainer.max_steps=1", f"trainer.init_from={target}"], tmp_path / "run")
    started = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)["model"]
    for name, tensor in torch.load(checkpoint, weights_only=True)["model"].items():
        assert torch.equal(started[name], tensor), name


def test_format_hf_of_a_model_that_is_not_a_transformers_model_is_one_line(checkpoint, tmp_path):
    refused(run_module("ringtrain", ["export", f"checkpoint={checkpoint}", "format=hf", f"output={tmp_path / 'hf'}"]),
            "format=hf writes a Hugging Face directory, but this checkpoint's model "
            "(ringtrain.models.transformer.Transformer) is not a transformers model", "use format=safetensors")
    assert not list(tmp_path.iterdir())


def test_export_never_replaces_what_it_did_not_write(checkpoint, tmp_path):
    """A file; a folder of the user's, with an HF and a PEFT export that would otherwise go
    ahead, is in tests/test_chat_training.py (this checkpoint's format=hf is refused anyway)."""
    from ringtrain.errors import ConfigError
    from ringtrain.tools.export import export

    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep me")
    (tmp_path / "theirs.safetensors").write_bytes(b"someone else's weights")
    with pytest.raises(ConfigError, match=f"output={tmp_path / 'theirs.safetensors'} exists and was not written by "
                                          f"ringtrain export; choose another output, or pass overwrite=true to replace it"):
        export(str(checkpoint), "safetensors", str(tmp_path / "theirs.safetensors"))
    with pytest.raises(ConfigError, match="is a directory; name the .safetensors file to write"):
        export(str(checkpoint), "safetensors", str(tmp_path / "mine"))
    assert (tmp_path / "mine" / "notes.txt").read_text() == "keep me"
    assert (tmp_path / "theirs.safetensors").read_bytes() == b"someone else's weights"
    # An earlier export of its own is replaced, atomically: no temporary file is left.
    export(str(checkpoint), "safetensors", str(tmp_path / "model.safetensors"))
    export(str(checkpoint), "safetensors", str(tmp_path / "model.safetensors"))
    # overwrite=true: the user says the file may go.
    export(str(checkpoint), "safetensors", str(tmp_path / "theirs.safetensors"), overwrite=True)
    assert (tmp_path / "theirs.safetensors").read_bytes() != b"someone else's weights"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine", "model.safetensors", "theirs.safetensors"]


def test_an_output_through_a_file_is_one_line_from_the_command(checkpoint, tmp_path):
    (tmp_path / "a-file").write_text("")
    refused(run_module("ringtrain", ["export", f"checkpoint={checkpoint}", f"output={tmp_path / 'a-file' / 'x.safetensors'}"]),
            f"output={tmp_path / 'a-file' / 'x.safetensors'} goes through {tmp_path / 'a-file'}, which is a file; "
            f"choose an output in a directory")
    assert [p.name for p in tmp_path.iterdir()] == ["a-file"]


def test_a_bpe_vocabulary_goes_with_a_hf_export_as_a_tokenizer_from_pretrained_loads(tmp_path):
    transformers = pytest.importorskip("transformers")
    from ringtrain.data.bpe import train_bpe
    from ringtrain.tools.export import write_pretrained_directory

    text = "the king and the queen of the land, and the lord of the sea\n" * 50
    vocab = train_bpe([text], vocab_size=300)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=vocab.size, n_positions=16, n_embd=8, n_layer=1, n_head=2))
    write_pretrained_directory(model, vocab.to_state(), tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    sample = "the queen of the sea and the king"
    assert tokenizer(sample)["input_ids"] == vocab.encode(sample)
    assert tokenizer.decode(vocab.encode(sample)) == sample
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no partial directory left
