"""The single-process loop end to end: learning, accumulation, resume, precision, checkpoints."""
from __future__ import annotations

import math
import os

import pytest
import torch

from conftest import assert_same_weights, checkpoint_weights, train_in_process
from ringtrain.callbacks import Callback
from ringtrain.models.linear import LinearRegression
from ringtrain.models.transformer import Transformer

SMALL_MLP = [
    "model=mlp", "data.num_features=32", "data.num_samples=512", "data.num_val_samples=128",
    "model.hidden_sizes=[16]",
]
SMALL_TRANSFORMER = [
    "model=transformer", "model.block_size=16", "model.d_model=32", "model.n_layers=1",
    "model.n_heads=2", "data.num_train_tokens=4000", "data.num_val_tokens=1000", "data.vocab_size=16",
    "data.branching=2",
]


def test_default_job_learns_the_tutorial_line(tmp_path):
    result = train_in_process([], tmp_path)
    weights = checkpoint_weights(tmp_path)
    w, b = weights["linear.weight"].item(), weights["linear.bias"].item()
    assert abs(w - 2) < 0.02 and abs(b - 3) < 0.02, (w, b)
    assert result.metrics["val/loss"] < 0.02  # the noise floor is 0.1**2 = 0.01
    assert result.steps == 10 * math.ceil(10000 / 32)


def test_mlp_learns_its_classification_task(tmp_path):
    result = train_in_process(SMALL_MLP + ["optimizer=adam", "optimizer.lr=0.01", "trainer.max_epochs=5"], tmp_path)
    assert result.monitor == "val/acc" and result.metrics["val/acc"] > 0.9  # chance is 0.1


@pytest.mark.slow
def test_transformer_loss_falls_far_below_uniform(tmp_path):
    result = train_in_process(
        SMALL_TRANSFORMER + ["optimizer=adamw", "optimizer.lr=3e-3", "trainer.max_steps=150"], tmp_path
    )
    assert result.metrics["val/loss"] < math.log(16) - 1.0  # uniform guessing is log(16) = 2.77


def test_accumulating_k_batches_of_b_equals_one_batch_of_k_times_b(tmp_path):
    common = SMALL_MLP + ["trainer.max_steps=12", "trainer.seed=3"]
    train_in_process(common + ["trainer.batch_size=32"], tmp_path / "big")
    train_in_process(common + ["trainer.batch_size=8", "trainer.accumulate_grad_batches=4"], tmp_path / "acc")
    assert_same_weights(checkpoint_weights(tmp_path / "big"), checkpoint_weights(tmp_path / "acc"), atol=1e-6)


def assert_resumed_run_equals_uninterrupted(common: list[str], full: list[str], partial: list[str], tmp_path):
    """Train `full` straight; train `partial`, then resume it to `full`: identical weights."""
    train_in_process(common + full, tmp_path / "straight")
    train_in_process(common + partial, tmp_path / "first")
    train_in_process(common + full + [f"trainer.resume={tmp_path / 'first/checkpoints/last.pt'}"], tmp_path / "second")
    straight, resumed = checkpoint_weights(tmp_path / "straight"), checkpoint_weights(tmp_path / "second")
    for key in straight:
        assert torch.equal(straight[key], resumed[key]), key


@pytest.mark.slow
def test_resume_from_n_steps_to_2n_equals_2n_uninterrupted(tmp_path):
    # dropout on and momentum on: the RNG state and optimizer state must both come back.
    common = SMALL_TRANSFORMER + ["model.dropout=0.1", "optimizer=adamw", "trainer.log_every_n_steps=5"]
    assert_resumed_run_equals_uninterrupted(common, ["trainer.max_steps=40"], ["trainer.max_steps=17"], tmp_path)


def test_resume_with_a_stateless_optimizer_matches(tmp_path):
    # Plain SGD keeps no per-parameter state: only its hyperparameters come back.
    assert_resumed_run_equals_uninterrupted([], ["trainer.max_steps=400"], ["trainer.max_steps=150"], tmp_path)


def test_resume_across_an_epoch_boundary_with_accumulation_matches(tmp_path):
    common = SMALL_MLP + ["trainer.batch_size=48", "trainer.accumulate_grad_batches=2", "optimizer=adam"]
    # 512 samples / 48 = 11 micro-batches = 6 optimizer steps per epoch (the last one short)
    assert_resumed_run_equals_uninterrupted(common, ["trainer.max_epochs=3"], ["trainer.max_steps=8"], tmp_path)


@pytest.mark.slow
def test_bf16_mixed_trains_on_cpu(tmp_path):
    result = train_in_process(
        SMALL_TRANSFORMER + ["trainer.precision=bf16-mixed", "optimizer=adamw", "optimizer.lr=3e-3",
                             "trainer.max_steps=100"],
        tmp_path,
    )
    assert result.metrics["val/loss"] < math.log(16) - 0.5


def test_checkpoints_hold_plain_data_and_load_into_a_bare_model(tmp_path):
    train_in_process(["trainer.max_epochs=2", "trainer.eval_every_n_steps=100"], tmp_path)
    for name in ("last.pt", "best.pt"):
        state = torch.load(tmp_path / "checkpoints" / name, weights_only=True)
        assert {"model", "optimizer", "scheduler", "progress", "rng", "config"} <= state.keys()
        assert state["config"]["model"]["_target_"] == "ringtrain.models.linear.LinearRegression"
        assert state["data_dims"] == {"in_features": 1, "out_features": 1}
        bare = LinearRegression(**state["data_dims"])
        bare.load_state_dict(state["model"])  # strict: no "module." prefixes
    assert state["progress"]["step"] == 2 * 313
    assert not list((tmp_path / "checkpoints").glob(".*tmp*")), "temporary files left behind"


def test_checkpoint_every_n_steps_saves_last_between_evaluations(tmp_path, monkeypatch):
    from ringtrain.checkpoints import CheckpointManager

    saved = []
    original_save = CheckpointManager.save

    def recording_save(self, step, best, hook):
        saved.append((step, best))
        return original_save(self, step, best, hook)

    monkeypatch.setattr(CheckpointManager, "save", recording_save)
    # 16 steps per epoch: in 12 steps the only evaluation is the final one.
    train_in_process(SMALL_MLP + ["trainer.max_steps=12", "trainer.checkpoint_every_n_steps=5"], tmp_path)
    assert saved == [(5, False), (10, False), (12, True)]
    assert (tmp_path / "checkpoints" / "best.pt").exists()  # the final evaluation set a best
    assert torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=True)["progress"]["step"] == 12
    # keep_last_k=2 (the default): the two newest step files, plus last.pt and best.pt
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "best.pt", "last.pt", "step-00000010.pt", "step-00000012.pt"]


def test_gradient_clipping_bounds_the_update(tmp_path):
    # One SGD step with lr 1 and clip 1e-3 can move the weights by at most 1e-3 in norm.
    train_in_process(["trainer.max_steps=1", "trainer.checkpoint=true", "trainer.max_epochs=1",
                      "optimizer.lr=1.0", "trainer.grad_clip_norm=0.001", "trainer.seed=5"], tmp_path / "c")
    torch.manual_seed(5)
    start = LinearRegression(1, 1).state_dict()
    end = checkpoint_weights(tmp_path / "c")
    moved = torch.cat([(end[k] - start[k]).flatten() for k in end]).norm().item()
    assert 0 < moved <= 1e-3 + 1e-7


def _lrs(scheduler, optimizer, steps):
    lrs = [optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        optimizer.step()
        scheduler.step()
        lrs.append(optimizer.param_groups[0]["lr"])
    return lrs


def test_cosine_schedule_warms_up_then_decays_to_min_lr():
    from ringtrain.optim import build_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    scheduler = build_scheduler({"_target_": "ringtrain.optim.WarmupCosine", "warmup_steps": 10, "min_lr": 0.1}, optimizer, 110)
    lrs = _lrs(scheduler, optimizer, 110)
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[10] == pytest.approx(1.0) and lrs[110] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[10:], lrs[11:]))


def test_constant_schedule_warms_up_and_resumes_from_its_state():
    from ringtrain.optim import build_scheduler

    node = {"_target_": "ringtrain.optim.WarmupConstant", "warmup_steps": 4}
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    scheduler = build_scheduler(node, optimizer, 100)
    assert _lrs(scheduler, optimizer, 2)[-1] == pytest.approx(0.5 * 3 / 4)
    fresh = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.5)
    restored = build_scheduler(node, fresh, 100)  # built before loading, as the loop resumes
    fresh.load_state_dict(optimizer.state_dict())
    restored.load_state_dict(scheduler.state_dict())
    assert fresh.param_groups[0]["lr"] == pytest.approx(0.5 * 3 / 4)
    assert _lrs(restored, fresh, 5)[1:] == pytest.approx([0.5] * 5)


def test_any_torch_scheduler_works_by_target_with_ringtrains_warmup():
    from ringtrain.optim import build_scheduler

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0)
    node = {"_target_": "torch.optim.lr_scheduler.StepLR", "step_size": 2, "gamma": 0.5, "warmup_steps": 4}
    lrs = _lrs(build_scheduler(node, optimizer, 100), optimizer, 8)
    assert lrs == pytest.approx([0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 0.5, 0.5, 0.25])


def test_one_cycle_gets_the_runs_total_steps_by_name(tmp_path):
    result = train_in_process(["scheduler._target_=torch.optim.lr_scheduler.OneCycleLR", "+scheduler.max_lr=0.05",
                               "~scheduler.warmup_steps", "trainer.max_steps=40"], tmp_path)
    assert result.steps == 40  # OneCycleLR raises if stepped past total_steps


def test_adamw_decays_matrices_but_not_biases_or_norms():
    from ringtrain.optim import parameter_groups

    model = Transformer(vocab_size=11, block_size=8, d_model=16, n_heads=2, n_layers=1)
    decay, no_decay = parameter_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


class FailAtStep8(Callback):
    def on_step_start(self, run, step) -> None:
        if step == 8:
            raise RuntimeError("out of memory, say")


def test_a_failing_run_leaves_its_event_file_flushed_and_closed(tmp_path):
    import os

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with pytest.raises(RuntimeError, match="out of memory, say"):
        train_in_process(["trainer.log_every_n_steps=2", "trainer.max_steps=20",
                          f"+callbacks.fail._target_={__name__}.FailAtStep8"], tmp_path)
    (event_file,) = tmp_path.glob("events.out.tfevents.*")
    open_files = {os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")}
    assert str(event_file.resolve()) not in open_files, "the event file was left open"
    events = EventAccumulator(str(tmp_path)).Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [2, 4, 6]
    assert not (tmp_path / "checkpoints").exists()


@pytest.fixture
def torch_determinism_restored(monkeypatch):
    """trainer.deterministic sets process-wide torch flags and an environment variable; the
    tests after this one get torch's defaults back."""
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    saved = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark
    yield
    torch.use_deterministic_algorithms(saved[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[1:]


def test_deterministic_runs_of_the_transformer_are_bit_identical(tmp_path, torch_determinism_restored):
    overrides = SMALL_TRANSFORMER + ["model.dropout=0.1", "optimizer=adamw", "trainer.max_steps=20",
                                     "trainer.deterministic=true"]
    train_in_process(overrides, tmp_path / "a")
    assert torch.are_deterministic_algorithms_enabled() and not torch.backends.cudnn.benchmark
    assert torch.backends.cudnn.deterministic
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    train_in_process(overrides, tmp_path / "b")
    first, second = checkpoint_weights(tmp_path / "a"), checkpoint_weights(tmp_path / "b")
    assert first.keys() == second.keys()
    assert all(torch.equal(first[key], second[key]) for key in first)


VALIDATED_AT: list[float] = []


class EpochAtValidation(Callback):
    def on_validation_end(self, run, metrics):
        VALIDATED_AT.append(round(run.epoch, 6))


def test_a_finished_run_started_again_validates_at_the_epoch_its_checkpoint_stands(tmp_path):
    """The same command on a finished run (a requeue) validates only, at the checkpoint's step
    and epoch, not at epoch 0."""
    VALIDATED_AT.clear()
    args = ["trainer.max_steps=40", "trainer.eval_every_n_steps=40",
            f"+callbacks.epoch_at_validation._target_={__name__}.EpochAtValidation"]
    train_in_process(args, tmp_path)
    train_in_process(args, tmp_path)  # nothing to train: validates again
    assert len(VALIDATED_AT) == 2 and VALIDATED_AT[0] > 0
    assert VALIDATED_AT[1] == VALIDATED_AT[0]
