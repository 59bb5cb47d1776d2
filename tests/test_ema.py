"""The EMA callback (trainer/callbacks/ema.py, `callbacks=[default,ema]`) in real runs: its average
is the textbook EMA of every applied step's weights, resumes exactly, is what validation logs
and what `ringtrain evaluate|export weights=ema` use, and is the same under 2-rank ddp and fsdp
as in one process.

One 20-step MLP run with the EMA (decay 0.9: far from the weights after 20 steps) and the same
run without it are shared by the tests (module fixtures); a small callback listed after the EMA
(`Recorder`) records the trainable weights the EMA saw at the start and after every step.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import assert_same_weights, run_cli, run_module, train_in_process
from helpers import TORCHRUN, ok, refused
from ringtrain.callbacks import Callback

DECAY = 0.9
EMA = ["callbacks=[default,ema]", f"callbacks.ema.decay={DECAY}"]
# An MLP without dropout, SGD with momentum: one process with batch 32 equals 2 ranks with 16
# (tests/test_distributed.py); validation at steps 10 and 20.
MLP = [
    "model=mlp", "data.num_features=24", "data.num_samples=512", "data.num_val_samples=129",
    "model.hidden_sizes=[16]", "optimizer=sgd", "optimizer.lr=0.05", "optimizer.momentum=0.9",
    "trainer.seed=7", "trainer.eval_every_n_steps=10",
]
STEPS = 20
RECORD = ["+callbacks.zz_record._target_=test_ema.Recorder"]  # listed after ema: sees what it averaged


class Recorder(Callback):
    """Records the model's trainable weights as the EMA callback sees them: at the start (what
    the average starts from) and after every applied step (what it takes in); at the end they go
    to <run dir>/recorded.pt (`recorded(run_dir)`)."""

    def on_fit_start(self, run) -> None:
        self.records = [_trainable(run.model)]

    def on_step_end(self, run, step) -> None:
        assert step.applied
        self.records.append(_trainable(run.model))

    def on_fit_end(self, run, result) -> None:
        torch.save(self.records, run.run_dir / "recorded.pt")


def recorded(run_dir: Path) -> list[dict[str, torch.Tensor]]:
    return torch.load(run_dir / "recorded.pt", weights_only=True)


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}


def _checkpoint(run_dir: Path, name: str = "last.pt") -> dict:
    return torch.load(run_dir / "checkpoints" / name, weights_only=True)


def _hand_ema(records: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """ema_0 = the initial weights; ema_k = d * ema_(k-1) + (1 - d) * w_k, in float64."""
    ema = {name: w.double() for name, w in records[0].items()}
    for weights in records[1:]:
        ema = {name: DECAY * ema[name] + (1 - DECAY) * weights[name].double() for name in ema}
    return ema


def _largest_difference(a: dict, b: dict) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("ema") / "run"
    train_in_process(MLP + EMA + RECORD + ["trainer.batch_size=32", f"trainer.max_steps={STEPS}"], run_dir)
    return run_dir


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory) -> Path:
    """The same run without the EMA callback."""
    run_dir = tmp_path_factory.mktemp("plain") / "run"
    train_in_process(MLP + ["trainer.batch_size=32", f"trainer.max_steps={STEPS}"], run_dir)
    return run_dir


# --- the average ---------------------------------------------------------------------------

def test_checkpoint_ema_is_the_hand_computed_ema_of_every_steps_weights(ema_run):
    records = recorded(ema_run)
    assert len(records) == STEPS + 1  # the start, then one per step
    state = _checkpoint(ema_run)
    assert state["progress"]["step"] == STEPS
    kept = state["callbacks"]["ema"]
    assert kept["decay"] == DECAY
    assert_same_weights(kept["weights"], _hand_ema(records), atol=1e-6)
    # The checkpoint of step 10's validation (written in the background as training went on): step 10's.
    assert_same_weights(_checkpoint(ema_run, "step-00000010.pt")["callbacks"]["ema"]["weights"],
                        _hand_ema(records[:11]), atol=1e-6)
    # The checkpoint's weights are the last step's (validation on the average put them back) ...
    assert_same_weights(state["model"], records[-1], atol=0)
    # ... and far from the average: the comparison above tells an EMA from the weights.
    assert _largest_difference(kept["weights"], state["model"]) > 1e-2


def test_training_with_ema_takes_exactly_the_steps_it_takes_without(ema_run, plain_run):
    # Validating on the average (at steps 10 and 20) swaps the weights out and back: bit for bit.
    with_ema, without = _checkpoint(ema_run)["model"], _checkpoint(plain_run)["model"]
    for key in without:
        assert torch.equal(with_ema[key], without[key]), key


def test_resumed_run_ends_with_the_uninterrupted_runs_ema_and_weights(tmp_path, ema_run):
    run_dir = tmp_path / "interrupted"
    common = MLP + EMA + RECORD + ["trainer.batch_size=32"]
    train_in_process(common + ["trainer.max_steps=7"], run_dir)
    # The checkpoint of step 7 holds the average of step 7 (the uninterrupted run's records).
    assert_same_weights(_checkpoint(run_dir)["callbacks"]["ema"]["weights"],
                        _hand_ema(recorded(ema_run)[:8]), atol=1e-6)
    train_in_process(common + [f"trainer.max_steps={STEPS}"], run_dir)  # the same directory: resumes at 7

    straight, resumed = _checkpoint(ema_run), _checkpoint(run_dir)
    assert resumed["progress"]["step"] == STEPS
    for key in straight["model"]:
        assert torch.equal(straight["model"][key], resumed["model"][key]), key
    straight_ema, resumed_ema = straight["callbacks"]["ema"]["weights"], resumed["callbacks"]["ema"]["weights"]
    assert straight_ema.keys() == resumed_ema.keys()
    for key in straight_ema:
        assert torch.equal(straight_ema[key], resumed_ema[key]), f"ema {key}"


# --- the tools -----------------------------------------------------------------------------

def test_evaluate_weights_ema_reproduces_the_runs_last_validation_and_weights_model_does_not(
        tmp_path, ema_run, plain_run):
    # Both in one command: a multirun over weights, each job's metrics in a file of its own, by
    # default eval/last-ema-val.json and eval/last-val.json, each naming the weights it measured.
    ok(run_module("ringtrain", ["evaluate", "-m", f"checkpoint={ema_run / 'checkpoints' / 'last.pt'}",
                                "weights=ema,model"]))
    records = {name: json.loads((ema_run / "eval" / f"last{name}-val.json").read_text()) for name in ("-ema", "")}
    assert [record["weights"] for record in records.values()] == ["ema", "model"]
    on_ema, on_model = (record["metrics"] for record in records.values())
    logged = json.loads((ema_run / "metrics.json").read_text())["final"]  # validated on the average
    assert set(on_ema) == set(logged) == {"val/loss", "val/acc"}
    for name, value in logged.items():
        assert on_ema[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    # weights=model: the weights' own metric, which the run without the EMA logged.
    without_ema = json.loads((plain_run / "metrics.json").read_text())["final"]
    assert on_model["val/loss"] == pytest.approx(without_ema["val/loss"], rel=1e-6)
    assert abs(on_model["val/loss"] - logged["val/loss"]) > 1e-3


def test_export_weights_ema_writes_the_average(tmp_path, ema_run):
    from safetensors.torch import load_file

    output = tmp_path / "ema.safetensors"
    ok(run_module("ringtrain", ["export", f"checkpoint={ema_run / 'checkpoints' / 'last.pt'}", "weights=ema",
                                f"output={output}"]))
    exported, kept = load_file(output), _checkpoint(ema_run)["callbacks"]["ema"]["weights"]
    assert exported.keys() == kept.keys()
    for key in kept:
        assert torch.equal(exported[key], kept[key]), key


@pytest.mark.parametrize("tool, run, weights, keeps", [
    ("evaluate", "ema_run", "nope", "(it keeps model, ema)"),
    ("export", "plain_run", "ema", "(it keeps model)"),
])
def test_weights_the_checkpoint_does_not_keep_are_refused_in_one_line_naming_what_it_keeps(
        request, tmp_path, tool, run, weights, keeps):
    checkpoint = request.getfixturevalue(run) / "checkpoints" / "last.pt"
    args = [tool, f"checkpoint={checkpoint}", f"weights={weights}"]
    output = tmp_path / ("out.json" if tool == "evaluate" else "out.safetensors")
    refused(run_module("ringtrain", args + [f"output={output}"]), f"weights={weights}", keeps)
    assert not output.exists()


# --- several ranks -------------------------------------------------------------------------

# A Transformer without biases (tests/test_fsdp_training.py): fsdp shards its Blocks.
SMALL = [
    "model=transformer", "model.block_size=16", "model.d_model=32", "model.n_layers=2", "model.n_heads=2",
    "model.bias=false", "data.num_train_tokens=20000", "data.num_val_tokens=1000", "data.vocab_size=16",
    "data.branching=2", "trainer.log_every_n_steps=10", "trainer.eval_every_n_steps=10", "optimizer.lr=0.1",
]


@pytest.mark.parametrize("strategy", [pytest.param("ddp", marks=pytest.mark.slow), pytest.param("fsdp", marks=pytest.mark.slow)])
def test_two_ranks_keep_the_single_process_ema_of_the_same_global_batch(tmp_path, request, strategy):
    if strategy == "ddp":
        common, single_dir = MLP + EMA + [f"trainer.max_steps={STEPS}"], request.getfixturevalue("ema_run")
        batch = 32
    else:
        common, single_dir, batch = SMALL + EMA + [f"trainer.max_steps={STEPS}"], tmp_path / "single", 16
        train_in_process(common + [f"trainer.batch_size={batch}"], single_dir)
    # Under torchrun: it starts the ranks sooner than strategy.nproc_per_node=2's launcher does.
    ok(run_cli(common + [f"strategy={strategy}", f"trainer.batch_size={batch // 2}",
                         f"hydra.run.dir={tmp_path / strategy}"], launcher=TORCHRUN))

    single, ranks = _checkpoint(single_dir), _checkpoint(tmp_path / strategy)
    assert ranks["layout"]["world_size"] == 2
    assert_same_weights(ranks["model"], single["model"], atol=1e-5)
    single_ema, ranks_ema = single["callbacks"]["ema"]["weights"], ranks["callbacks"]["ema"]["weights"]
    # Full tensors by parameter name (gathered from the shards under fsdp), as one process keeps them.
    assert {k: tuple(v.shape) for k, v in ranks_ema.items()} == {k: tuple(v.shape) for k, v in single_ema.items()}
    assert_same_weights(ranks_ema, single_ema, atol=1e-5)
    assert _largest_difference(single_ema, single["model"]) > 1e-3  # an average, not the weights
    # The logged validation (on the average) is the single process's too.
    logged = json.loads((tmp_path / strategy / "metrics.json").read_text())["final"]
    expected = json.loads((single_dir / "metrics.json").read_text())["final"]
    assert logged == pytest.approx(expected, rel=1e-5)
