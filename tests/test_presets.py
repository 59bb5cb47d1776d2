"""Every experiment and debug preset composes, validates and runs its smallest form; the debug
options they rely on do what they say."""
from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from conftest import CONF_DIR, SHAKESPEARE, compose_config, train_in_process

# The smallest form of each experiment: its own settings, with sizes and steps cut down.
TINY_TRANSFORMER = ["model.n_layers=1", "model.d_model=32", "model.n_heads=2", "model.block_size=16"]
SMALLEST = {
    "linear_regression": ["data.num_samples=256", "data.num_val_samples=64", "trainer.max_steps=4"],
    "shakespeare_char": TINY_TRANSFORMER + ["trainer.max_steps=3", "trainer.limit_val_batches=2"],
    # compile is the preset's GPU setting; tests/test_speed_features.py compiles on CPU
    "shakespeare_char_gpu": TINY_TRANSFORMER + ["trainer.max_steps=3", "trainer.limit_val_batches=2",
                                                "trainer.batch_size=8", "trainer.compile=false"],
    "gpt2_small": TINY_TRANSFORMER + ["data.vocab_size=512", "data.num_train_tokens=2048",
                                      "data.num_val_tokens=512", "trainer.max_steps=2", "trainer.batch_size=4"],
}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_the_presets_are_the_documented_ones():
    assert _options("experiment") == sorted(SMALLEST)
    assert _options("debug") == ["fast_dev_run", "overfit", "profiler"]


# What the presets sized for a GPU say, in one line before any work, when there is none.
CPU_ALTERNATIVES = {"shakespeare_char_gpu": "use experiment=shakespeare_char instead",
                    "gpt2_small": "use model=transformer (GPT-style"}


@pytest.mark.parametrize("name", sorted(SMALLEST))
def test_every_experiment_preset_runs_its_smallest_form(name, tmp_path, caplog):
    extra = SMALLEST[name]
    if name.startswith("shakespeare_char"):
        text = tmp_path / "tiny.txt"
        text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 40, encoding="utf-8")
        extra = extra + [f"data.path={text}", f"data.cache_dir={tmp_path / 'cache'}"]
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        result = train_in_process([f"experiment={name}", *extra], tmp_path / "run")
    assert result.steps == int(next(o for o in extra if o.startswith("trainer.max_steps")).split("=")[1])
    assert all(torch.isfinite(torch.tensor(v)) for v in result.metrics.values()) and result.metrics

    messages = [r.getMessage() for r in caplog.records]
    notices = [i for i, m in enumerate(messages) if m.startswith("this preset is sized for a GPU")]
    if name in CPU_ALTERNATIVES and not torch.cuda.is_available():
        assert len(notices) == 1 and CPU_ALTERNATIVES[name] in messages[notices[0]], messages
        first_step = next(i for i, m in enumerate(messages) if m.startswith(("step ", "done:")))
        assert notices[0] < first_step  # said before the work
    else:
        assert not notices, messages


def test_experiment_presets_keep_their_shapes():
    gpt2 = compose_config(["experiment=gpt2_small"])
    assert (gpt2.model.n_layers, gpt2.model.n_heads, gpt2.model.d_model, gpt2.model.block_size) == (12, 12, 768, 1024)
    assert gpt2.data.vocab_size == 50304 and gpt2.data.seq_len == 1024 and gpt2.trainer.precision == "bf16-mixed"
    shakespeare = compose_config(["experiment=shakespeare_char"])
    assert shakespeare.data._target_ == "ringtrain.data.text.CharText" and shakespeare.optimizer._target_ == "torch.optim.AdamW"
    assert compose_config(["experiment=linear_regression"]).optimizer.lr == 0.01


def test_the_gpu_shakespeare_preset_trains_on_a_window_at_every_offset(tmp_path):
    """Its data.stride: 1 (nanoGPT's random windows; fixed non-overlapping ones overfit): the
    composed preset's data holds one 257-character window per start in the training text."""
    from ringtrain.config.builders import build_data
    from ringtrain.config.schema import validate

    text = tmp_path / "tiny.txt"
    text.write_text("".join(chr(ord("a") + i % 26) for i in range(3000)), encoding="utf-8")
    cfg = compose_config(["experiment=shakespeare_char_gpu", f"data.path={text}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert cfg.data.stride == 1 and cfg.data.seq_len == cfg.model.block_size == 256
    train = build_data(validate(cfg).data).train
    training_characters = int(3000 * 0.9)  # data.val_fraction: 0.1
    assert len(train) == training_characters - 256
    assert torch.equal(train[1][0][:-1], train[0][0][1:])  # each window starts one character after the one before


def test_debug_fast_dev_run_trains_three_steps_and_writes_no_checkpoint(tmp_path):
    result = train_in_process(["model=transformer", "debug=fast_dev_run", "data.num_train_tokens=4096"], tmp_path)
    assert result.steps == 3 and "val/loss" in result.metrics
    assert not (tmp_path / "checkpoints").exists()
    assert list(tmp_path.glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_debug_overfit_drives_the_loss_on_its_own_batches_far_down(tmp_path):
    # MLP with dropout off: on 4 fixed batches the loss must fall to near zero.
    result = train_in_process(["model=mlp", "debug=overfit", "data.num_features=64", "data.num_samples=512",
                               "optimizer=adam", "optimizer.lr=3e-3", "trainer.max_steps=100"], tmp_path)
    assert result.metrics["val/acc"] == 1.0 and result.metrics["val/loss"] < 0.01


def test_debug_overfit_with_the_default_sgd_drives_the_linear_models_loss_far_down(tmp_path):
    result = train_in_process(["debug=overfit"], tmp_path)  # conf/debug/overfit.yaml's first figure
    assert result.steps == 200 and result.metrics["val/loss"] < 0.05


@pytest.mark.slow
def test_debug_overfit_with_adam_memorises_below_the_transformers_data_floor(tmp_path):
    """conf/debug/overfit.yaml's transformer figure: far below the Markov data's floor, log 4."""
    result = train_in_process(["model=transformer", "debug=overfit", "optimizer=adam"], tmp_path)
    assert result.metrics["val/loss"] < 0.2 < math.log(4)


@pytest.mark.parametrize("world_size", [1, 2])
def test_overfit_batches_validates_on_exactly_the_samples_trained_on(world_size):
    from ringtrain.data.regression import RegressionData
    from ringtrain.loop.loaders import build_train_loader, build_val_loader

    data = RegressionData(num_samples=500)
    data.setup()
    train = data.train
    cpu = torch.device("cpu")
    trained, validated = [], []
    for rank in range(world_size):  # what the Trainer builds on each rank with overfit_batches=3
        loader = build_train_loader(train, 8, rank, world_size, 0, False, cpu, shuffle=False, limit_batches=3)
        val = build_val_loader(train, 16, rank, world_size, cpu, limit_samples=3 * 8 * world_size)
        epoch_0, epoch_1 = (torch.cat([x for x, _ in loader.batches(epoch)]) for epoch in (0, 1))
        assert epoch_0.shape == (24, 1) and torch.equal(epoch_0, epoch_1)  # the same batches every epoch
        trained.append(epoch_0)
        validated.append(torch.cat([x for x, _ in val.batches()]))
    first_samples = sorted(train.inputs[: 24 * world_size].flatten().tolist())
    assert sorted(torch.cat(trained).flatten().tolist()) == first_samples
    assert sorted(torch.cat(validated).flatten().tolist()) == first_samples


@pytest.mark.slow
def test_debug_profiler_writes_a_trace_tensorboard_can_open(tmp_path):
    result = train_in_process(["model=transformer", "debug=profiler", "data.num_train_tokens=8192"], tmp_path)
    assert result.steps == 10
    traces = list((tmp_path / "profiler").glob("*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {f"ProfilerStep#{i}" for i in range(2, 7)}  # 5 steps after 2 to settle
    assert any("aten::scaled_dot_product_attention" in e.get("name", "") for e in events)
    # The optimizer's own profiler ranges are in the trace, one per step.
    assert sum(e.get("name") == "Optimizer.step#SGD.step" for e in events) == 5


@pytest.mark.skipif(not SHAKESPEARE.exists(), reason=f"{SHAKESPEARE} is not here")
def test_shakespeare_preset_builds_the_real_text(tmp_path):
    from ringtrain.config.builders import build_data
    from ringtrain.config.schema import validate

    run = validate(compose_config(["experiment=shakespeare_char", f"data.path={SHAKESPEARE}",
                                   f"data.cache_dir={tmp_path}"]))
    bundle = build_data(run.data)
    assert bundle.dims["vocab_size"] == 65
    assert len(bundle.train) == (int(len(SHAKESPEARE.read_text()) * 0.9) - 1) // 64
