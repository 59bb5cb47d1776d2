"""Clean checkpoints still work now that a checkpoint is data: each kind of run is trained from one
directory, then evaluated, exported (and sampled, consolidated where that applies) from another,
the job rebuilt from the checkpoint's recorded choices and overrides alone; and a run continued
from another directory with trainer.resume=<file> ends with exactly the weights of the run
trained straight through.

  default      the default job (linear regression)
  transformer  model=transformer on a text file
  user_model   the user's own model option from --config-dir (needed again by every tool)
  hf_local     a Hugging Face model from a local save_pretrained folder (from_pretrained)
  lora         adapter=lora over that model
  fsdp         strategy=fsdp with sharded checkpoints, two ranks (consolidate too)
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import QUIET, SHAKESPEARE, run_module
from helpers import ok, refused

TEXT = "\n".join(f"line {i}: the quick brown fox jumps over the lazy dog" for i in range(300))
USER_MODEL = """\
_target_: ringtrain.models.mlp.MLPClassifier
hidden_sizes: [8]
"""
CASES = {
    "default": (["trainer.max_steps=6"], ()),
    "transformer": (["model=transformer", "data=text", "data.path={text}", "model.block_size=16", "model.d_model=32",
                     "model.n_layers=1", "model.n_heads=2", "trainer.max_steps=6", "trainer.batch_size=8"], ("sample",)),
    "user_model": (["--config-dir", "{conf}", "model=my_mlp", "data=classification", "data.num_samples=64",
                    "data.num_val_samples=16", "trainer.batch_size=16", "trainer.max_steps=6"], ()),
    "hf_local": (["--config-dir", "{conf}", "model=pretrained_gpt2", "optimizer=adamw", "trainer.max_steps=6"],
                 ("sample", "export_hf")),
    "lora": (["--config-dir", "{conf}", "model=pretrained_gpt2", "optimizer=adamw", "trainer.max_steps=6",
              "adapter=lora", "adapter.target_modules=[c_attn,c_fc]", "adapter.r=4"], ("sample", "export_peft")),
    "fsdp": (["model=mlp", "data.num_samples=64", "data.num_val_samples=16", "model.hidden_sizes=[8]",
              "strategy=fsdp", "strategy.nproc_per_node=2", "strategy.state_dict_type=sharded",
              "trainer.batch_size=8", "trainer.max_steps=6"], ("consolidate",)),
}
SLOW = ("transformer", "user_model", "hf_local", "lora", "fsdp")  # the default job stays in the default suite


def _user_folder(root: Path) -> Path:
    """Where the user trains: a text file, their own options, a pretrained tiny GPT-2."""
    root.mkdir()
    (root / "input.txt").write_text(SHAKESPEARE.read_text()[:20000] if SHAKESPEARE.exists() else TEXT)
    (root / "conf" / "model").mkdir(parents=True)
    (root / "conf" / "model" / "my_mlp.yaml").write_text(USER_MODEL)
    return root


def _with_pretrained(root: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from test_hf_pretrained import MODEL_YAML, WORDS  # noqa: F401  (the same user folder as the fine-tuning tests)

    torch.manual_seed(0)
    vocab = len(set((root / "input.txt").read_text()))
    config = transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_layer=2, n_head=2, n_embd=32,
                                     bos_token_id=0, eos_token_id=0)
    transformers.GPT2LMHeadModel(config).save_pretrained(root / "tiny-gpt2")
    (root / "conf" / "model" / "pretrained_gpt2.yaml").write_text(
        MODEL_YAML.format(pretrained=root / "tiny-gpt2", text=root / "input.txt"))


def _train(where: Path, args: list[str]):
    return ok(run_module("ringtrain", [*args, *QUIET], cwd=where, timeout=600))


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow if c in SLOW else ())
                                  for c in CASES])
def test_a_clean_checkpoint_works_from_another_directory_and_resumes_exactly(case, tmp_path, hf_offline):
    user = _user_folder(tmp_path / "user")
    if case in ("hf_local", "lora"):
        _with_pretrained(user)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    template, extras = CASES[case]
    args = [a.format(text=user / "input.txt", conf=user / "conf") for a in template]
    config_dir = args[:2] if args[0] == "--config-dir" else []
    steps = next(int(a.split("=")[1]) for a in args if a.startswith("trainer.max_steps="))
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    _train(user, [*args, f"hydra.run.dir={straight}"])
    _train(user, [*[a for a in args if not a.startswith("trainer.max_steps=")], f"trainer.max_steps={steps // 2}",
                  f"hydra.run.dir={resumed}"])
    checkpoint = resumed / "checkpoints" / "last.pt"

    # The tools, from another directory: the job comes from the checkpoint's recipe.
    metrics = elsewhere / "metrics.json"
    ok(run_module("ringtrain", ["evaluate", *config_dir, f"checkpoint={checkpoint}", f"output={metrics}"], cwd=elsewhere))
    logged = json.loads((resumed / "metrics.json").read_text())["final"]
    assert json.loads(metrics.read_text())["metrics"] == pytest.approx(logged, rel=1e-5)
    ok(run_module("ringtrain", ["export", *config_dir, f"checkpoint={checkpoint}", f"output={elsewhere / 'w.safetensors'}"],
                  cwd=elsewhere))
    assert (elsewhere / "w.safetensors").is_file()
    if "sample" in extras:
        text = ok(run_module("ringtrain", ["sample", *config_dir, f"checkpoint={checkpoint}", "prompt=line",
                                           "max_new_tokens=20", "device=cpu"], cwd=elsewhere)).stdout
        assert text.startswith("line") and len(text) >= 20
    for kind in ("hf", "peft"):
        if f"export_{kind}" in extras:
            ok(run_module("ringtrain", ["export", *config_dir, f"checkpoint={checkpoint}", f"format={kind}",
                                        f"output={elsewhere / kind}"], cwd=elsewhere))
            assert (elsewhere / kind / ("adapter_config.json" if kind == "peft" else "config.json")).is_file()
    if "consolidate" in extras:
        ok(run_module("ringtrain", ["consolidate", *config_dir, f"checkpoint={checkpoint}",
                                    f"output={elsewhere / 'one.pt'}"], cwd=elsewhere))
        assert "model" in torch.load(elsewhere / "one.pt", weights_only=True)

    # Continued from another directory: the weights of the run trained straight through.
    _train(elsewhere, [*config_dir, f"trainer.resume={checkpoint}", f"trainer.max_steps={steps}"])
    from conftest import checkpoint_weights

    a, b = checkpoint_weights(straight), checkpoint_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), case


@pytest.mark.slow
@pytest.mark.parametrize("adapter", [[], ["adapter=lora", "adapter.target_modules=[c_attn,c_fc]", "adapter.r=4"]],
                         ids=["full", "lora"])
def test_a_run_whose_config_names_relative_folders_is_used_from_another_directory(adapter, tmp_path, hf_offline):
    """The run's relative paths (its model folder, its text) are recorded absolute: sample,
    evaluate and export work from elsewhere; the model folder moved away is one line naming it."""
    user = _user_folder(tmp_path / "user")
    _with_pretrained(user)
    args = ["--config-dir", str(user / "conf"), "model=pretrained_gpt2", "model.pretrained_model_name_or_path=tiny-gpt2",
            "data.path=input.txt", "optimizer=adamw", "trainer.max_steps=4", *adapter, f"hydra.run.dir={tmp_path / 'run'}"]
    _train(user, args)
    checkpoint = tmp_path / "run" / "checkpoints" / "last.pt"
    assert torch.load(checkpoint, weights_only=True)["job"]["paths"]["model.pretrained_model_name_or_path"] == \
        str(user / "tiny-gpt2")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    tool = ["--config-dir", str(user / "conf"), f"checkpoint={checkpoint}"]
    ok(run_module("ringtrain", ["evaluate", *tool, f"output={elsewhere / 'm.json'}"], cwd=elsewhere))
    assert ok(run_module("ringtrain", ["sample", *tool, "prompt=line", "max_new_tokens=5"], cwd=elsewhere)).stdout
    ok(run_module("ringtrain", ["export", *tool, f"format={'peft' if adapter else 'hf'}", f"output={elsewhere / 'out'}"],
                  cwd=elsewhere))
    (user / "tiny-gpt2").rename(user / "moved")
    if adapter:  # the base is read again: its folder named in one line, no Hub retries
        line = refused(run_module("ringtrain", ["evaluate", *tool, f"output={elsewhere / 'm2.json'}"], cwd=elsewhere),
                       str(user / "tiny-gpt2"))
        assert "Retrying" not in line and not (elsewhere / "m2.json").exists()
    else:  # a full fine-tune is rebuilt from the config its checkpoint keeps
        ok(run_module("ringtrain", ["evaluate", *tool, f"output={elsewhere / 'm2.json'}"], cwd=elsewhere))
