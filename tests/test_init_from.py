"""trainer.init_from: a new run starts from the weights of a checkpoint, a state_dict file or a
safetensors file (weights only, step 0), refuses weights of another shape in one line, and a
run that resumes ignores it (checkpoints/initial_weights.py)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from conftest import run_cli, train_in_process
from helpers import corrupt_tensor_bytes, ok, refused

TINY = ["model=transformer", "model.block_size=8", "model.d_model=16", "model.n_layers=1", "model.n_heads=2",
        "data.num_train_tokens=2000", "data.num_val_tokens=200", "data.vocab_size=16", "trainer.batch_size=8"]
# One step that changes nothing: the weights a run ends with are the weights it started from.
FROZEN = ["optimizer=sgd", "optimizer.lr=0.0", "trainer.max_steps=1"]


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    """A trained tiny Transformer's checkpoint (tied output layer): the weights to start from."""
    run = tmp_path_factory.mktemp("source") / "run"
    train_in_process(TINY + ["optimizer=adamw", "trainer.max_steps=6"], run)
    return run / "checkpoints" / "last.pt"


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.pt", weights_only=True)["model"]


def _same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_a_run_starts_at_step_0_from_a_checkpoints_weights(source, tmp_path):
    result = train_in_process(TINY + FROZEN + ["model.dropout=0.0", f"trainer.init_from={source}"], tmp_path / "run")
    assert result.steps == 1  # step 0 + 1: the source's progress (step 6) is not taken
    started = _weights(tmp_path / "run")
    _same(started, torch.load(source, weights_only=True)["model"])
    fresh = train_in_process(TINY + FROZEN, tmp_path / "fresh")  # without init_from: other weights
    assert not torch.equal(_weights(tmp_path / "fresh")["blocks.0.attn.qkv.weight"], started["blocks.0.attn.qkv.weight"])
    assert fresh.steps == 1


def test_a_run_starts_from_a_safetensors_file_with_the_tied_weight_stored_once(source, tmp_path):
    from safetensors.torch import load_file, save_model

    from ringtrain.tools.checkpoint_model import read_checkpoint, rebuild_model

    state = read_checkpoint(str(source))
    model = rebuild_model(state, str(source))
    save_model(model, str(tmp_path / "weights.safetensors"))
    assert len(load_file(tmp_path / "weights.safetensors")) == len(state["model"]) - 1  # lm_head = embedding
    train_in_process(TINY + FROZEN + [f"trainer.init_from={tmp_path / 'weights.safetensors'}"], tmp_path / "run")
    _same(_weights(tmp_path / "run"), state["model"])


def test_a_plain_state_dict_file_is_a_starting_point_too(source, tmp_path):
    torch.save(torch.load(source, weights_only=True)["model"], tmp_path / "state_dict.pt")
    train_in_process(TINY + FROZEN + [f"trainer.init_from={tmp_path / 'state_dict.pt'}"], tmp_path / "run")
    _same(_weights(tmp_path / "run"), torch.load(source, weights_only=True)["model"])


def test_weights_of_another_shape_are_one_line_naming_the_tensor_and_both_shapes(source, tmp_path):
    """Checked before any work: the model built on the meta device against the file's shapes."""
    proc = run_cli(TINY + FROZEN + ["model.d_model=24", f"trainer.init_from={source}",
                                    f"hydra.run.dir={tmp_path / 'run'}"])
    refused(proc, f"trainer.init_from={source}: token_embedding.weight has shape [16, 16] there but [16, 24] in "
                  f"this model; start from weights of the same model")
    assert not (tmp_path / "run").exists()


def test_a_model_with_more_tensors_than_the_file_is_refused_where_the_rank_builds_it(source, tmp_path):
    """The same check where the model is built (a model the meta device cannot build is checked only there)."""
    from ringtrain.checkpoints.initial_weights import load_initial_weights
    from ringtrain.errors import ConfigError
    from ringtrain.models.transformer import Transformer

    deeper = Transformer(vocab_size=16, block_size=8, n_layers=2, n_heads=2, d_model=16)
    with pytest.raises(ConfigError, match=rf"trainer.init_from={source} holds no 'blocks.1.ln1.weight' "
                                          rf"\(12 of this model's 29 tensors are missing\)"):
        load_initial_weights(deeper, source)


@pytest.mark.parametrize("kind", ["checkpoint", "state_dict"])
def test_changed_bytes_in_the_file_are_refused_not_trained_from(source, tmp_path, kind):
    from ringtrain.checkpoints.initial_weights import load_initial_weights
    from ringtrain.errors import ConfigError
    from ringtrain.tools.checkpoint_model import read_checkpoint, rebuild_model

    state = read_checkpoint(str(source))
    model = rebuild_model(state, str(source))
    path = tmp_path / "weights.pt"
    torch.save(state if kind == "checkpoint" else state["model"], path)
    record = corrupt_tensor_bytes(path)
    with pytest.raises(ConfigError) as refusal:
        load_initial_weights(model, path)
    assert str(refusal.value) == (f"trainer.init_from={path} is corrupt: its record {record} does not match its "
                                  f"checksum; pass an intact copy of it")


def test_a_missing_file_is_one_line_before_any_run_directory(tmp_path):
    proc = run_cli(TINY + FROZEN + [f"trainer.init_from={tmp_path / 'nowhere.pt'}"], cwd=tmp_path)
    refused(proc, f"trainer.init_from='{tmp_path / 'nowhere.pt'}' is not a file")
    assert not list(tmp_path.iterdir())


def test_a_folder_holding_model_safetensors_is_refused_with_that_file_as_the_fix(tmp_path):
    """A save_pretrained / `export format=hf` folder: the line names the file inside to pass."""
    from conftest import compose_config
    from ringtrain.config.schema import validate
    from ringtrain.errors import ConfigError

    (tmp_path / "empty").mkdir()
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").write_bytes(b"")
    for folder, fix in [("hf", f"pass {tmp_path / 'hf' / 'model.safetensors'}"),
                        ("empty", "pass a checkpoint (.pt) or a .safetensors file to start from, or null")]:
        with pytest.raises(ConfigError) as refusal:
            validate(compose_config(TINY + FROZEN + [f"trainer.init_from={tmp_path / folder}"]))
        assert str(refusal.value) == f"trainer.init_from='{tmp_path / folder}' is not a file; {fix}"


@pytest.mark.slow
def test_a_run_that_resumes_ignores_init_from(source, tmp_path, caplog):
    """The second half of an interrupted fine-tuning run continues from its own checkpoint:
    the same weights as the run straight through, not the pretrained ones again."""
    fine_tune = TINY + ["optimizer=adamw", f"trainer.init_from={source}"]
    train_in_process(fine_tune + ["trainer.max_steps=8"], tmp_path / "straight")
    train_in_process(fine_tune + ["trainer.max_steps=4"], tmp_path / "halves")
    with caplog.at_level("INFO", logger="ringtrain"):
        resumed = train_in_process(fine_tune + ["trainer.max_steps=8"], tmp_path / "halves")
    assert resumed.steps == 8
    assert f"trainer.init_from={source} ignored: this run resumes from" in caplog.text
    _same(_weights(tmp_path / "halves"), _weights(tmp_path / "straight"))
