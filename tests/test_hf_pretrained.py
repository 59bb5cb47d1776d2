"""Issue 19, acceptance 1b: a Hugging Face model from `from_pretrained` of a local directory,
fine-tuned with nothing but YAML in a config dir outside the repository, single process, as a
2-rank gloo DDP job and under fsdp; its checkpoint loads into transformers' own class with
weights_only=True, `ringtrain evaluate` gives the run's last validation loss, and `ringtrain
export format=hf` writes a directory `from_pretrained` loads with the checkpoint's weights.

The pretrained directory is made here with `save_pretrained` from a tiny GPT2Config (there is
no hub: HF_HUB_OFFLINE=1). The validation split has 49 windows, so under 2 ranks one rank
has a batch more than the other: fsdp's evaluation must keep its sharded forwards in step.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import run_cli, run_module
from helpers import TORCHRUN, ok

transformers = pytest.importorskip("transformers")

WORDS = "the king queen of a to and my lord is not thy good".split()
MODEL_YAML = """\
# @package _global_
# A causal LM from a local pretrained directory, fine-tuned on a text file.
defaults:
  - override /data: text
model:
  _target_: transformers.AutoModelForCausalLM.from_pretrained
  pretrained_model_name_or_path: {pretrained}
data:
  path: {text}
  seq_len: 32
  cache_dir: ""
"""
FINE_TUNE = ["model=pretrained_gpt2", "optimizer=adamw", "optimizer.lr=3e-3", "trainer.eval_every_n_steps=10",
             "trainer.log_every_n_steps=5"]


@pytest.fixture(scope="module", autouse=True)
def offline(hf_offline):  # conftest.py: no hub, in this process and its subprocesses
    yield


def pretrained_user_folder(root: Path, **gpt2: Any) -> Path:
    """A user's folder: a text file, a pretrained tiny GPT-2 (`gpt2`: its config's sizes) and a
    config dir naming both, no Python."""
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(10)) for _ in range(400))
    (root / "words.txt").write_text(text, encoding="utf-8")
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=len(set(text)), n_positions=32, n_layer=2, n_head=2,
                                     bos_token_id=0, eos_token_id=0, **gpt2)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "tiny-gpt2")
    (root / "conf" / "model").mkdir(parents=True)
    (root / "conf" / "model" / "pretrained_gpt2.yaml").write_text(
        MODEL_YAML.format(pretrained=root / "tiny-gpt2", text=root / "words.txt"))
    return root


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    return pretrained_user_folder(tmp_path_factory.mktemp("hf_user"), n_embd=32)


def _fine_tune(user: Path, name: str, overrides: list[str], launcher=None) -> Path:
    run = user / name
    ok(run_cli(["--config-dir", str(user / "conf"), *FINE_TUNE, *overrides, f"hydra.run.dir={run}"],
               cwd=user, launcher=launcher))
    return run


def _train_losses(run: Path) -> list[float]:
    return [float(v) for v in re.findall(r"step \d+: loss=([\d.]+)", (run / "train.log").read_text())]


def _check_run(user: Path, run: Path, evaluate: bool) -> dict[str, torch.Tensor]:
    """Loss falling; the checkpoint in transformers' own class; `ringtrain evaluate` gives the
    run's last validation loss. Returns the checkpoint's weights."""
    losses = _train_losses(run)
    assert len(losses) >= 4 and losses[-1] < 0.8 * losses[0], losses
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    own = transformers.GPT2LMHeadModel(transformers.GPT2Config.from_pretrained(user / "tiny-gpt2"))
    own.load_state_dict(state["model"])  # strict: every tensor, no other
    if evaluate:
        proc = ok(run_module("ringtrain", ["evaluate", "--config-dir", str(user / "conf"),
                                           f"checkpoint={run / 'checkpoints' / 'last.pt'}"], cwd=user))
        final = json.loads((run / "metrics.json").read_text())["final"]["val/loss"]
        assert proc.stdout.splitlines()[0] == f"val/loss={final:.6g}"
    return state["model"]


def _export(user: Path, run: Path, name: str) -> Path:
    """`export(...)` from Python: the job composed from the checkpoint with the user's options."""
    from ringtrain.tools import composed_job
    from ringtrain.tools.checkpoint_model import read_checkpoint
    from ringtrain.tools.export import export

    path = str(run / "checkpoints" / "last.pt")
    return export(path, "hf", str(user / name), job=composed_job(read_checkpoint(path), path, config_dir=user / "conf"))


def _check_export(exported: Path, weights: dict[str, torch.Tensor]) -> None:
    """`from_pretrained` of the exported directory: transformers' class, the checkpoint's weights."""
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported)
    assert type(loaded) is transformers.GPT2LMHeadModel
    assert loaded.state_dict().keys() == weights.keys()
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, weights[name]), name


def test_pretrained_gpt2_fine_tunes_from_yaml_then_evaluates_and_exports_for_from_pretrained(user):
    run = _fine_tune(user, "single", ["trainer.max_steps=20", "trainer.batch_size=8"])
    weights = _check_run(user, run, evaluate=True)
    proc = ok(run_module("ringtrain", ["export", "--config-dir", str(user / "conf"),
                                       f"checkpoint={run / 'checkpoints' / 'last.pt'}", "format=hf"],
                         cwd=user))
    assert proc.stdout.strip() == str(run / "export" / "step-00000020")  # the run's export/ by default
    assert "no tokenizer written: the data's char vocabulary has no Hugging Face tokenizer" in proc.stderr
    _check_export(run / "export" / "step-00000020", weights)


@pytest.mark.slow
def test_pretrained_gpt2_fine_tunes_under_fsdp_on_two_ranks_and_exports(user):
    run = _fine_tune(user, "fsdp", ["trainer.max_steps=20", "trainer.batch_size=4", "strategy=fsdp",
                                    "strategy.nproc_per_node=2"])
    weights = _check_run(user, run, evaluate=False)
    _check_export(_export(user, run, "fsdp-export"), weights)


@pytest.mark.slow
def test_pretrained_gpt2_fine_tunes_as_a_two_rank_ddp_job_under_torchrun(user):
    run = _fine_tune(user, "ddp", ["trainer.max_steps=20", "trainer.batch_size=4", "strategy=ddp"],
                     launcher=TORCHRUN)
    weights = _check_run(user, run, evaluate=True)
    _check_export(_export(user, run, "ddp-export"), weights)


@pytest.mark.slow
def test_a_pretrained_models_checkpoint_samples_and_evaluates_without_its_base_directory(user, tmp_path):
    """The checkpoint keeps the model's class and config (`architecture`): from another folder,
    with the from_pretrained directory renamed away and no network (HF_HUB_OFFLINE), sample and
    evaluate rebuild it from the checkpoint alone."""
    import shutil

    base = tmp_path / "base"
    shutil.copytree(user / "tiny-gpt2", base)
    run = _fine_tune(user, "moved-base", ["trainer.max_steps=4", f"model.pretrained_model_name_or_path={base}"])
    checkpoint = run / "checkpoints" / "last.pt"
    stored = torch.load(checkpoint, weights_only=True)
    assert stored["architecture"]["class"] == "transformers.models.gpt2.modeling_gpt2.GPT2LMHeadModel"
    base.rename(tmp_path / "renamed-away")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    sampled = ok(run_module("ringtrain", ["sample", "--config-dir", str(user / "conf"), f"checkpoint={checkpoint}",
                                          "prompt=the king", "max_new_tokens=5",
                                          "temperature=0", "device=cpu"], cwd=elsewhere))
    assert sampled.stdout.startswith("the king")
    evaluated = ok(run_module("ringtrain", ["evaluate", "--config-dir", str(user / "conf"), f"checkpoint={checkpoint}"],
                              cwd=elsewhere))
    final = json.loads((run / "metrics.json").read_text())["final"]["val/loss"]
    assert evaluated.stdout.splitlines()[0] == f"val/loss={final:.6g}"
    assert not (tmp_path / "base").exists() and list(elsewhere.iterdir()) == []