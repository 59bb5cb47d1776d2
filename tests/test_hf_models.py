"""Issue 19, acceptance 1a: a tiny `transformers.GPT2LMHeadModel`, built from a `GPT2Config`
node whose vocabulary comes from the data, trains on `data=text` with YAML only (a config
folder outside the repository, used as a user does: `--config-dir`), single process and as
a 2-rank gloo DDP job; its checkpoint loads into GPT2LMHeadModel itself with
`weights_only=True`; `ringtrain evaluate` reproduces the run's last validation metric;
`ringtrain sample` prints text from the checkpoint alone, longer than the model's positions.
One run of each kind is shared by the asserts (module-scoped fixtures)."""
from __future__ import annotations

import json
import math
import re
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import SHAKESPEARE, run_cli, run_module
from helpers import TORCHRUN, ok

transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")

TINY_GPT2 = """
    # @package _global_
    defaults:
      - override /data: text
    model:
      _target_: transformers.GPT2LMHeadModel
      config:
        _target_: transformers.GPT2Config
        vocab_size: ${data.dims.vocab_size}
        n_positions: 32
        n_embd: 32
        n_layer: 2
        n_head: 2
        bos_token_id: null
        eos_token_id: null
    data:
      seq_len: 32
    """
TRAIN = ["model=tiny_gpt2", "optimizer=adamw", "optimizer.lr=3e-3", "trainer.batch_size=8", "trainer.max_steps=40",
         "trainer.eval_every_n_steps=20", "trainer.limit_val_batches=8", "data.cache_dir="]
VAL_LOSS = re.compile(r"step (\d+) epoch [\d.]+: val/loss=([\d.]+)")


@pytest.fixture(scope="module")
def user_dir(tmp_path_factory) -> Path:
    """A user's folder outside the repository: conf/model/tiny_gpt2.yaml and a text file."""
    root = tmp_path_factory.mktemp("hf_user")
    (root / "conf" / "model").mkdir(parents=True)
    (root / "conf" / "model" / "tiny_gpt2.yaml").write_text(textwrap.dedent(TINY_GPT2))
    text = SHAKESPEARE.read_text(encoding="utf-8")[:30000] if SHAKESPEARE.exists() else \
        "First Citizen:\nBefore we proceed any further, hear me speak.\n" * 500
    (root / "input.txt").write_text(text, encoding="utf-8")
    return root


def _train(user_dir: Path, name: str, *extra: str, launcher=None):
    args = ["--config-dir", "conf", *TRAIN, "data.path=input.txt", f"hydra.run.dir={name}", *extra]
    return ok(run_cli(args, cwd=user_dir, launcher=launcher, timeout=600))


@pytest.fixture(scope="module")
def single_run(user_dir):
    return user_dir / "single", _train(user_dir, "single")


def _val_losses(run_dir: Path) -> list[float]:
    return [float(loss) for _, loss in VAL_LOSS.findall((run_dir / "train.log").read_text())]


def test_a_tiny_gpt2_from_a_config_node_learns_its_vocabulary_from_the_data(single_run):
    run_dir, proc = single_run
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    vocab = state["data_dims"]["vocab_size"]
    assert state["config"]["model"]["config"]["vocab_size"] == "${data.dims.vocab_size}"
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32,
                                                                 n_layer=2, n_head=2))
    model.load_state_dict(state["model"])  # the library's own class, strict
    assert model.get_input_embeddings().num_embeddings == vocab < 100
    first, last = _val_losses(run_dir)[0], _val_losses(run_dir)[-1]
    assert last < first < math.log(vocab), (first, last)
    assert "bos_token_id" not in proc.stderr and "Traceback" not in proc.stderr


def test_evaluate_reproduces_the_last_validation_metric_and_sample_prints_text(single_run):
    run_dir, _ = single_run
    checkpoint = run_dir / "checkpoints" / "last.pt"
    # The run's own option (model=tiny_gpt2) needs the user's --config-dir again: a checkpoint names options.
    ok(run_module("evaluate", ["--config-dir", "conf", f"checkpoint={checkpoint}", "trainer.limit_val_batches=8"],
                  cwd=run_dir.parent))
    evaluated = json.loads((run_dir / "eval" / "last-val.json").read_text())["metrics"]["val/loss"]
    assert evaluated == pytest.approx(json.loads((run_dir / "metrics.json").read_text())["final"]["val/loss"], rel=1e-5)
    proc = ok(run_module("sample", ["--config-dir", "conf", f"checkpoint={checkpoint}", "prompt=Citizen:", "max_new_tokens=60"],
                         cwd=run_dir.parent))
    assert proc.stdout.startswith("Citizen:") and len(proc.stdout.strip()) >= 8 + 60 - 5  # past its 32 positions


@pytest.mark.slow
def test_a_tiny_gpt2_trains_as_a_two_rank_ddp_job(user_dir):
    _train(user_dir, "ddp", "strategy=ddp", "trainer.batch_size=4", launcher=TORCHRUN)
    first, last = _val_losses(user_dir / "ddp")[0], _val_losses(user_dir / "ddp")[-1]
    assert last < first, (first, last)
    state = torch.load(user_dir / "ddp" / "checkpoints" / "last.pt", weights_only=True)
    assert not any(key.startswith("module.") for key in state["model"])  # plain GPT2LMHeadModel names


def test_fsdp_shards_a_hugging_face_model_by_the_layers_it_declares():
    """strategy=fsdp with no shard_classes: a transformers model's `_no_split_modules` (its
    decoder layers) are the FSDP units."""
    from ringtrain.strategies.fsdp import default_shard_classes

    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=2,
                                                                     n_head=2, bos_token_id=None, eos_token_id=None))
    assert [cls.__name__ for cls in default_shard_classes(model)] == ["GPT2Block"]

    class Heads(torch.nn.Module):  # two repeated lists; the model declares only the layers whole
        _no_split_modules = ["GPT2Block"]

        def __init__(self):
            super().__init__()
            self.layers, self.heads = model.transformer.h, torch.nn.ModuleList([torch.nn.Linear(2, 2)] * 2)

    assert [cls.__name__ for cls in default_shard_classes(Heads())] == ["GPT2Block"]


def test_a_model_loss_task_trains_on_the_models_own_loss_and_its_metric_is_that_loss():
    """task.model_loss=true on Hugging Face style dict batches: the step's loss is the one the
    model computes given labels= (shifted inside transformers), and the task's validation sums
    on the logits (shift_labels, -100 padding skipped) give exactly that loss back."""
    from ringtrain.data.batches import predictions, training_loss
    from ringtrain.data.tasks import LanguageModelTask

    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=16, n_positions=8, n_embd=8, n_layer=1,
                                                                 n_head=2, bos_token_id=None, eos_token_id=None))
    model.eval()  # no dropout: the same logits on every call
    ids = torch.randint(0, 16, (2, 8))
    labels = ids.clone()
    labels[0, -3:] = -100  # padding
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    task = LanguageModelTask(model_loss=True, shift_labels=True)
    loss, _ = training_loss(task, model, batch)
    assert torch.allclose(loss, model(input_ids=ids, labels=labels).loss)
    sums = task.eval_sums(*predictions(task, model, batch))
    assert sums["count"].item() == 2 * 7 - 3
    assert torch.allclose(loss.double(), sums["loss"].double() / sums["count"], atol=1e-6)
