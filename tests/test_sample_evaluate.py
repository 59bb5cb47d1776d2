"""Using what was trained: `ringtrain sample` and `ringtrain evaluate` on a checkpoint alone,
as real subprocesses; their refusals are one line and exit 2."""
from __future__ import annotations

import json
import random
import re
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from conftest import SHAKESPEARE, run_cli, run_module, train_in_process
from helpers import ok, refused
from ringtrain.errors import ConfigError
from ringtrain.tools.sample import generate, sample

# A tiny character Transformer: a few seconds on one core, and it sees a context of 16.
TINY_CHAR_MODEL = [
    "model=transformer", "data=text", "model.block_size=16", "model.d_model=32", "model.n_layers=1",
    "model.n_heads=2", "optimizer=adamw", "optimizer.lr=3e-3", "trainer.batch_size=16", "trainer.max_steps=40",
    "trainer.eval_every_n_steps=20",
]
WORDS = "the king and queen of rome speak to romeo while juliet sleeps under a pale moon".split()


@pytest.fixture(scope="module")
def char_run(tmp_path_factory) -> Path:
    """A run directory of a tiny char Transformer trained on generated text (data=text)."""
    root = tmp_path_factory.mktemp("char")
    rng = random.Random(0)
    text = "\n".join(" ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + "." for _ in range(300))
    (root / "words.txt").write_text(text, encoding="utf-8")
    train_in_process(TINY_CHAR_MODEL + [f"data.path={root / 'words.txt'}", "data.cache_dir="], root / "run")
    return root / "run"


@pytest.fixture(scope="module")
def vocabulary(char_run) -> str:
    return torch.load(char_run / "checkpoints" / "last.pt", weights_only=True)["vocab"]["chars"]


def test_sample_prints_the_prompt_and_200_characters_of_the_vocabulary(char_run, vocabulary):
    prompt = "The king"
    proc = ok(run_module("sample", [f"checkpoint={char_run / 'checkpoints/last.pt'}", f"prompt={prompt}",
                               "max_new_tokens=200", "temperature=0.8", "top_k=200", "seed=0", "device=cpu"]))
    text = proc.stdout.removesuffix("\n")  # print's newline; the sample itself may end in one
    assert text.startswith(prompt) and len(text) == len(prompt) + 200
    assert set(text) <= set(vocabulary)


def test_greedy_sampling_is_deterministic_and_ignores_the_seed(char_run):
    checkpoint = str(char_run / "checkpoints" / "last.pt")
    first = sample(checkpoint, prompt="romeo", max_new_tokens=60, temperature=0, seed=0, device="cpu")
    again = sample(checkpoint, prompt="romeo", max_new_tokens=60, temperature=0, seed=123, device="cpu")
    assert first == again and len(first[0]) == len("romeo") + 60
    # Sampling proper follows the seed: the same seed repeats, and the text is not the greedy one.
    drawn = sample(checkpoint, prompt="romeo", max_new_tokens=60, temperature=1.0, seed=5, num_samples=2, device="cpu")
    assert drawn == sample(checkpoint, prompt="romeo", max_new_tokens=60, temperature=1.0, seed=5, num_samples=2,
                           device="cpu")
    assert drawn[0] != drawn[1]


def test_generate_crops_the_context_to_block_size_and_works_for_any_logits_model():
    class Bigram(torch.nn.Module):  # no config, no block_size: the whole context is fed
        def __init__(self):
            super().__init__()
            self.table = torch.nn.Embedding(5, 5)
            with torch.no_grad():
                self.table.weight.copy_(torch.eye(5).roll(1, dims=1) * 10)  # i -> i + 1

        def forward(self, idx):
            return self.table(idx)

    out = generate(Bigram(), torch.tensor([[0]]), max_new_tokens=7, temperature=0)
    assert out.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]

    seen = []

    class Windowed(Bigram):
        config = type("Config", (), {"block_size": 3})()

        def forward(self, idx):
            seen.append(idx.shape[1])
            return super().forward(idx)

    generate(Windowed(), torch.tensor([[0]]), max_new_tokens=6, temperature=0.5, top_k=1,
             generator=torch.Generator().manual_seed(0))
    assert seen == [1, 2, 3, 3, 3, 3]


def test_a_stop_text_ends_the_sample_at_the_first_one_written(char_run):
    """stop= on the command line (a list, as Hydra reads it): the sample is the greedy one, up to
    and including the first stop text it writes; a plain character vocabulary has no end-of-text
    token, so without stop= it runs to max_new_tokens."""
    checkpoint = str(char_run / "checkpoints" / "last.pt")
    prompt = "romeo."  # then a new line, and text of several words
    (full,) = sample(checkpoint, prompt=prompt, max_new_tokens=80, temperature=0, device="cpu")
    assert len(full) == len(prompt) + 80
    written = full[len(prompt):]
    early, late = (next(written[i:i + 3] for i in range(start, 77) if "\n" not in written[i:i + 3]) for start in (30, 50))
    end = min(written.find(early) + 3, written.find(late) + 3)
    proc = ok(run_module("sample", [f"checkpoint={checkpoint}", f"prompt={prompt}", "max_new_tokens=80",
                                    "temperature=0", "device=cpu", f"stop=[{json.dumps(late)},{json.dumps(early)}]"]))
    assert proc.stdout.removesuffix("\n") == prompt + written[:end]
    # \n, as a command line writes a newline for Hydra: the sample ends at its first line's end.
    line = written.index("\n") + 1
    assert sample(checkpoint, prompt=prompt, max_new_tokens=80, temperature=0, device="cpu", stop="\\n") == \
        [prompt + written[:line]]


def test_sample_help_names_every_data_whose_runs_sample_and_the_stop_setting(tmp_path):
    shown = ok(run_module("sample", ["--help"], cwd=tmp_path)).stdout
    checkpoint = shown.split("checkpoint ", 1)[1].split("(required)")[0]
    for data in ("data=text", "token_file", "hf_text", "stream", "chat", "mixture", "hf_rows", "token_shards"):
        assert data in checkpoint, data
    assert re.search(r"^ +stop +texts that end a sample", shown, re.MULTILINE) and "end-of-turn" in shown


def test_evaluate_reports_exactly_the_val_loss_the_run_logged_at_its_last_step(char_run):
    logged = json.loads((char_run / "metrics.json").read_text())["final"]["val/loss"]
    proc = ok(run_module("evaluate", [f"checkpoint={char_run / 'checkpoints/last.pt'}"]))
    record = json.loads((char_run / "eval" / "last-val.json").read_text())  # the default output
    assert record["metrics"]["val/loss"] == pytest.approx(logged, abs=1e-6)
    assert record["step"] == 40 and record["split"] == "val" and record["world_size"] == 1
    assert proc.stdout.strip().splitlines() == [f"val/loss={record['metrics']['val/loss']:.6g}"]

    # The training split writes a file of its own: the validation result stays.
    ok(run_module("evaluate", [f"checkpoint={char_run / 'checkpoints/last.pt'}", "split=train"]))
    train = json.loads((char_run / "eval" / "last-train.json").read_text())
    assert train["split"] == "train" and list(train["metrics"]) == ["train/loss"]
    assert json.loads((char_run / "eval" / "last-val.json").read_text()) == record


@pytest.mark.parametrize("launch", [pytest.param("self-launched", marks=pytest.mark.slow), "torchrun"])
def test_evaluate_on_two_ranks_equals_one_process(char_run, tmp_path, launch):
    checkpoint = f"checkpoint={char_run / 'checkpoints/last.pt'}"
    ok(run_module("evaluate", [checkpoint, "split=train", f"output={tmp_path / 'one.json'}"]))
    two_ranks = [checkpoint, "split=train", "trainer.val_batch_size=7", f"output={tmp_path / 'two.json'}"]
    if launch == "torchrun":  # strategy=auto is ddp under torchrun
        ok(run_module("torch.distributed.run", ["--standalone", "--nproc_per_node=2", "-m", "ringtrain.tools.evaluate", *two_ranks]))
    else:
        ok(run_module("ringtrain.tools.evaluate", [*two_ranks, "strategy=ddp", "strategy.nproc_per_node=2"]))
    one, two = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "two.json"))
    assert two["world_size"] == 2 and two["strategy"] == "ddp"
    assert two["metrics"]["train/loss"] == pytest.approx(one["metrics"]["train/loss"], abs=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [["strategy=dp"], ["strategy=fsdp", "strategy.nproc_per_node=2"]])
def test_evaluate_under_dp_and_fsdp_gives_one_processs_metric(char_run, tmp_path, strategy):
    """The strategies `ringtrain evaluate --help` lists beside single and ddp."""
    checkpoint = f"checkpoint={char_run / 'checkpoints/last.pt'}"
    ok(run_module("evaluate", [checkpoint, f"output={tmp_path / 'one.json'}"]))
    ok(run_module("evaluate", [checkpoint, f"output={tmp_path / 'other.json'}", *strategy]))
    one, other = (json.loads((tmp_path / name).read_text()) for name in ("one.json", "other.json"))
    assert other["strategy"] == strategy[0].split("=")[1] and other["world_size"] == len(strategy)
    assert other["metrics"]["val/loss"] == pytest.approx(one["metrics"]["val/loss"], abs=1e-6)


@pytest.mark.slow
def test_limit_val_batches_gives_one_processs_metric_on_two_ranks(char_run, tmp_path):
    """limit_val_batches=3 with batches of 5 is the first 15 validation samples, shared among
    the ranks: two ranks report one process's value (not two ranks' 3 batches each)."""
    checkpoint = f"checkpoint={char_run / 'checkpoints/last.pt'}"

    def evaluate(name: str, *args: str) -> float:
        ok(run_module("evaluate", [checkpoint, "trainer.val_batch_size=5", f"output={tmp_path / name}", *args]))
        return json.loads((tmp_path / name).read_text())["metrics"]["val/loss"]

    one = evaluate("one.json", "trainer.limit_val_batches=3")
    two = evaluate("two.json", "trainer.limit_val_batches=3", "strategy=ddp", "strategy.nproc_per_node=2")
    assert json.loads((tmp_path / "two.json").read_text())["world_size"] == 2
    assert two == pytest.approx(one, rel=1e-6)  # each rank's own 3 batches (30 samples) gave 2.0278 for 2.0441


def test_evaluate_applies_overrides_to_the_stored_config(char_run, tmp_path):
    """Other data of the same kind (a copy of the text under another name) gives the same loss."""
    data = Path(torch.load(char_run / "checkpoints" / "last.pt", weights_only=True)["config"]["data"]["path"])
    (tmp_path / "copy.txt").write_text(data.read_text(encoding="utf-8"), encoding="utf-8")
    ok(run_module("evaluate", [f"checkpoint={char_run / 'checkpoints/last.pt'}", f"data.path={tmp_path / 'copy.txt'}",
                          "trainer.limit_val_batches=2", f"output={tmp_path / 'm.json'}"]))
    record = json.loads((tmp_path / "m.json").read_text())
    assert record["overrides"] == [f"data.path={tmp_path / 'copy.txt'}", "trainer.limit_val_batches=2"]
    assert 0 < record["metrics"]["val/loss"] < 10


def test_evaluate_config_is_the_checkpoints_own_changed_with_hydras_grammar(char_run, tmp_path):
    """The stored sections are the config's: key=value changes, ~key removes, +key adds."""
    checkpoint = char_run / "checkpoints" / "last.pt"
    proc = ok(run_module("evaluate", ["--cfg", "job", "--resolve", f"checkpoint={checkpoint}", "data.path=other.txt",
                                      "~data.cache_dir", "+data.extra=1", "trainer.val_batch_size=7"], cwd=tmp_path))
    cfg, stored = yaml.safe_load(proc.stdout), torch.load(checkpoint, weights_only=True)["config"]
    assert cfg["model"] == stored["model"] and cfg["task"] == stored["task"]
    assert cfg["data"] == {**{k: v for k, v in stored["data"].items() if k != "cache_dir"}, "path": "other.txt", "extra": 1}
    assert cfg["trainer"] == {**stored["trainer"], "val_batch_size": 7}
    assert cfg["strategy"]["_target_"] == "ringtrain.strategies.Single"  # strategy=auto, no torchrun
    assert not list(tmp_path.iterdir())


@pytest.fixture(scope="module")
def token_checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of data=tokens: token ids without a vocabulary."""
    run = tmp_path_factory.mktemp("tokens") / "run"
    train_in_process(["model=transformer", "model.block_size=8", "model.d_model=16", "model.n_layers=1",
                      "model.n_heads=2", "data.num_train_tokens=500", "data.num_val_tokens=100",
                      "trainer.max_steps=2"], run)
    return run / "checkpoints" / "last.pt"


def test_sample_refuses_a_checkpoint_without_a_vocabulary(token_checkpoint):
    refused(run_module("sample", [f"checkpoint={token_checkpoint}"]),
            f"{token_checkpoint} keeps no vocabulary to decode with (ringtrain.data.tokens.MarkovTokens gave none): "
            "sample from a model trained on data=text, token_file, hf_text, stream, chat, or hf_rows or token_shards "
            "with data.tokenizer")


def test_sample_refuses_a_model_that_is_not_a_language_model(tmp_path):
    """An MLP classifier's checkpoint: the line names the model and why, not `data=tokens?`."""
    train_in_process(["model=mlp", "data.num_features=8", "data.num_samples=64", "data.num_val_samples=16",
                      "trainer.max_steps=1"], tmp_path)
    with pytest.raises(ConfigError) as refusal:
        sample(str(tmp_path / "checkpoints" / "last.pt"))
    message = str(refusal.value)
    assert "holds ringtrain.models.mlp.MLPClassifier, trained with ringtrain.data.tasks.ClassificationTask" in message
    assert "(in_features, num_classes): not a language model" in message and "data=tokens" not in message
    assert "sample needs a run of task=language_model" in message


@pytest.mark.parametrize("args,phrases", [
    (["prompt='Zebra#'"], ["prompt has characters", "'#'", "'Z'", "'b'"]),  # Hydra's quotes: # is a sign
    (["top_k=0"], ["top_k=0 must be at least 1"]),
    # The same kind of bound as top_k=0 above (one pinned by default): -m slow.
    pytest.param(["temperature=-0.5"], ["temperature=-0.5 must be >= 0"], marks=pytest.mark.slow),
    (["max_tokens=5"], ["max_tokens is not a setting of ringtrain sample; did you mean max_new_tokens? the settings are"]),
    (["seed=x"], ["seed='x' is not of type int; write e.g. seed=0"]),
])
def test_sample_refusals_are_one_line_and_exit_2(char_run, args, phrases):
    refused(run_module("sample", [f"checkpoint={char_run / 'checkpoints/last.pt'}", *args]), *phrases)


def test_evaluate_multirun_writes_each_checkpoints_own_metrics(char_run, token_checkpoint, tmp_path):
    """`python -m ringtrain evaluate -m checkpoint=a,b`: one job per checkpoint (here of two kinds
    of data), each writing its own run's eval/last-val.json; nothing lands where it runs."""
    checkpoints = [tmp_path / name / "checkpoints" / "last.pt" for name in ("a", "b")]
    for source, checkpoint in zip((char_run / "checkpoints" / "last.pt", token_checkpoint), checkpoints):
        checkpoint.parent.mkdir(parents=True)
        shutil.copy(source, checkpoint)
    (tmp_path / "cwd").mkdir()
    proc = ok(run_module("ringtrain", ["evaluate", "-m", f"checkpoint={checkpoints[0]},{checkpoints[1]}",
                                       "trainer.limit_val_batches=2"], cwd=tmp_path / "cwd"))
    records = [json.loads((c.parent.parent / "eval" / "last-val.json").read_text()) for c in checkpoints]
    assert [r["checkpoint"] for r in records] == [str(c) for c in checkpoints]
    assert [r["step"] for r in records] == [40, 2] and all(r["overrides"] == ["trainer.limit_val_batches=2"] for r in records)
    assert proc.stdout.strip().splitlines() == [f"val/loss={r['metrics']['val/loss']:.6g}" for r in records]
    assert not list((tmp_path / "cwd").iterdir())


@pytest.mark.parametrize("args,phrases", [
    (["checkpoint=missing.pt"], ["checkpoint='missing.pt' is not a file"]),
    (["data.pth=x"], ["data.pth is not set by this data", "+data.pth=<value>"]),
    (["~data.pth"], ["Could not delete from config. 'data.pth' does not exist"]),
    # Messages every command shares (one Hydra app each, tools/__init__.py), pinned in process for
    # train by test_config.py and test_user_components.py and for fsdp by test_fsdp_training.py:
    # -m slow runs them through evaluate too.
    pytest.param(["+data.path=x"], ["An item is already at 'data.path'"], marks=pytest.mark.slow),
    (["optimizer.lr=1"], ["evaluation trains nothing"]),
    (["split=test"], ["split='test' is not one of val, train"]),
    pytest.param(["+model.widht=3"], ["takes no argument 'widht'"], marks=pytest.mark.slow),
    pytest.param(["strategy.nproc_per_node=2"], ["not a setting of this strategy", "belongs to strategy=ddp"],
                 marks=pytest.mark.slow),
    # The strategy's own refusal (FSDP.check), worded for training and evaluation alike.
    pytest.param(["strategy=fsdp"], ["strategy=fsdp needs a process group", "strategy.nproc_per_node >= 2",
                                     "for one process use strategy=single"], marks=pytest.mark.slow),
])
def test_evaluate_refusals_are_one_line_and_exit_2(char_run, args, phrases, tmp_path):
    checkpoint = [] if args[0].startswith("checkpoint=") else [f"checkpoint={char_run / 'checkpoints/last.pt'}"]
    refused(run_module("evaluate", checkpoint + args + [f"output={tmp_path / 'm.json'}"]), *phrases)
    assert not (tmp_path / "m.json").exists()


@pytest.mark.parametrize("change", ["one character fewer", "one character other"])
def test_evaluate_refuses_text_whose_ids_mean_other_characters(char_run, vocabulary, tmp_path, change):
    """Text data numbers its characters: text with a character fewer gives the model another
    vocab_size, text with one character swapped the same size but other meanings. Each is one
    line naming what differs, and no metrics are written."""
    chars = vocabulary[:-1] if change == "one character fewer" else vocabulary[:-1] + "~"
    (tmp_path / "other.txt").write_text(chars * 200, encoding="utf-8")
    expected = ({"one character fewer": f"the data gives vocab_size={len(vocabulary) - 1} but the checkpoint's model "
                                        f"was trained with vocab_size={len(vocabulary)}; evaluate on data of the same kind",
                 "one character other": "the data's vocabulary differs from the one the model was trained with"}[change])
    refused(run_module("evaluate", [f"checkpoint={char_run / 'checkpoints/last.pt'}", f"data.path={tmp_path / 'other.txt'}",
                                    f"output={tmp_path / 'm.json'}"]), expected)
    assert not (tmp_path / "m.json").exists()


@pytest.mark.slow
@pytest.mark.skipif(not SHAKESPEARE.exists(), reason=f"{SHAKESPEARE} is not here (Tiny Shakespeare)")
def test_shakespeare_char_then_sample_200_characters(tmp_path):
    """The issue's acceptance 6: train the preset on Tiny Shakespeare, then sample from it."""
    run = tmp_path / "run"
    ok(run_cli(["experiment=shakespeare_char", f"data.path={SHAKESPEARE}", f"data.cache_dir={tmp_path / 'cache'}",
                f"hydra.run.dir={run}"], timeout=1800))
    vocab = torch.load(run / "checkpoints" / "best.pt", weights_only=True)["vocab"]["chars"]
    proc = ok(run_module("sample", [f"checkpoint={run / 'checkpoints/best.pt'}", "prompt=ROMEO:", "max_new_tokens=200",
                               "temperature=0.8", "top_k=200", "seed=0"]))
    text = proc.stdout.removesuffix("\n")
    assert text.startswith("ROMEO:") and len(text) == len("ROMEO:") + 200 and set(text) <= set(vocab)
    # A trained model writes words and lines, not noise: mostly letters and spaces.
    assert sum(c.isalpha() or c.isspace() for c in text) > 0.85 * len(text)
