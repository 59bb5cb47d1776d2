"""GPU-speed features, checked on CPU: torch.compile with its eager fall-back and checkpoint
round trips, no host syncs between logging steps, throughput/MFU/memory logging, TF32,
activation checkpointing, pinned batches, the GPU preset and the GPT benchmark's --tiny run."""
from __future__ import annotations

import inspect
import logging
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from conftest import REPO, assert_same_weights, checkpoint_weights, compose_config, train_in_process
from ringtrain.callbacks import Callback
from ringtrain.config.schema import validate
from ringtrain.errors import ConfigError
from ringtrain.models.transformer import Transformer

SMALL_TRANSFORMER = [
    "model=transformer", "model.block_size=16", "model.d_model=32", "model.n_layers=1",
    "model.n_heads=2", "data.num_train_tokens=4000", "data.num_val_tokens=1000", "data.vocab_size=16",
    "data.branching=2", "optimizer=adamw",
]
COMPILE_FAILED = "trainer.compile: torch.compile failed"


def _compile_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if COMPILE_FAILED in r.getMessage()]


# --- trainer.compile ------------------------------------------------------------------------


@pytest.mark.slow
def test_compiled_run_trains_and_checkpoints_move_between_compiled_and_eager(tmp_path, caplog, monkeypatch):
    """The one real inductor compile of the default suite (~20-40 s on 2 cores, less with a
    warm inductor cache): a compiled run trains like the eager one, its checkpoint has bare
    keys, loads into an uncompiled model, and resumes with compile toggled either way."""
    real_compile, compiled_models = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda model, **options: compiled_models.append(model) or real_compile(model, **options))
    common = SMALL_TRANSFORMER + ["trainer.batch_size=16", "trainer.log_every_n_steps=3",
                                  "trainer.eval_every_n_steps=4", "trainer.limit_val_batches=2"]
    eager = train_in_process(common + ["trainer.max_steps=8"], tmp_path / "eager")
    compiled = train_in_process(common + ["trainer.max_steps=4", "trainer.compile=true"], tmp_path / "compiled")
    assert not _compile_warnings(caplog), "torch.compile fell back to eager on CPU"

    state = torch.load(tmp_path / "compiled/checkpoints/last.pt", weights_only=True)
    assert not [k for k in state["model"] if "_orig_mod" in k or k.startswith("module.")]
    bare = Transformer(vocab_size=16, block_size=16, d_model=32, n_layers=1, n_heads=2, dropout=0.0)
    bare.load_state_dict(state["model"])  # strict
    assert compiled.metrics["val/loss"] == pytest.approx(
        train_in_process(common + ["trainer.max_steps=4"], tmp_path / "eager4").metrics["val/loss"], rel=1e-4)

    # compiled -> eager, and eager -> compiled: both reach the uninterrupted eager run's weights
    # (up to inductor's float reassociation).
    train_in_process(common + ["trainer.max_steps=8", f"trainer.resume={tmp_path / 'compiled/checkpoints/last.pt'}"],
                     tmp_path / "to_eager")
    train_in_process(common + ["trainer.max_steps=8", "trainer.compile=true",
                               f"trainer.resume={tmp_path / 'eager4/checkpoints/last.pt'}"], tmp_path / "to_compiled")
    straight = checkpoint_weights(tmp_path / "eager")
    assert_same_weights(straight, checkpoint_weights(tmp_path / "to_eager"), atol=1e-4)
    assert_same_weights(straight, checkpoint_weights(tmp_path / "to_compiled"), atol=1e-4)
    assert not _compile_warnings(caplog) and len(compiled_models) == 2  # the two compiled runs, with inductor
    assert eager.metrics["val/loss"] < math.log(16)


def _compile_with(monkeypatch, backend) -> list[dict]:
    """torch.compile, everywhere, with `backend` instead of inductor; returns the calls' options."""
    real_compile = torch.compile
    calls: list[dict] = []

    def compile_with_backend(model, **options):
        calls.append(options)
        return real_compile(model, backend=backend)

    monkeypatch.setattr(torch, "compile", compile_with_backend)
    return calls


def _failing_backend(graph_module, example_inputs):
    raise RuntimeError("inductor cannot lower this op (simulated)")


def _backend_whose_backward_fails(graph_module, example_inputs):
    """Forward runs (the graph as dynamo traced it); the backward fails the way a lazily
    compiled backward graph does, at the first backward."""

    def fail(grad):
        raise RuntimeError("backward graph failed to compile (simulated)")

    def run(*inputs):
        outputs = graph_module(*inputs)
        for output in outputs if isinstance(outputs, (tuple, list)) else [outputs]:
            if isinstance(output, torch.Tensor) and output.requires_grad:
                output.register_hook(fail)
        return outputs

    return run


@pytest.mark.slow
@pytest.mark.parametrize("backend", [_failing_backend, _backend_whose_backward_fails], ids=["forward", "backward"])
def test_a_compile_that_fails_falls_back_to_eager_with_one_warning(backend, monkeypatch, tmp_path, caplog):
    common = SMALL_TRANSFORMER + ["model.dropout=0.1", "trainer.max_steps=5", "trainer.log_every_n_steps=2"]
    eager = train_in_process(common, tmp_path / "eager")
    _compile_with(monkeypatch, backend)
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        fell_back = train_in_process(common + ["trainer.compile=true"], tmp_path / "fell_back")
    (warning,) = _compile_warnings(caplog)
    assert "(simulated)" in warning and "training continues in eager mode" in warning and "\n" not in warning
    # Nothing of the failed attempt leaks into training: not the RNG (dropout), not gradients.
    assert fell_back.metrics == eager.metrics
    assert_same_weights(checkpoint_weights(tmp_path / "eager"), checkpoint_weights(tmp_path / "fell_back"), atol=0)


def test_a_models_own_error_is_raised_as_is_and_not_taken_for_a_compile_failure(monkeypatch, caplog):
    from ringtrain.strategies.compilation import CompiledModel

    _compile_with(monkeypatch, "eager")
    model = CompiledModel(Transformer(vocab_size=8, block_size=4, d_model=8, n_layers=1, n_heads=2))
    with pytest.raises(ValueError, match="exceeds model.block_size=4"):
        model(torch.zeros(1, 6, dtype=torch.long))
    assert model.is_compiled and not _compile_warnings(caplog)
    assert model(torch.zeros(2, 4, dtype=torch.long)).shape == (2, 4, 8)


def test_compile_mode_reaches_torch_compile(monkeypatch, tmp_path):
    calls = _compile_with(monkeypatch, "eager")
    train_in_process(SMALL_TRANSFORMER + ["trainer.max_steps=2", "trainer.compile=true",
                                          "trainer.compile_mode=max-autotune-no-cudagraphs"], tmp_path / "a")
    train_in_process(SMALL_TRANSFORMER + ["trainer.max_steps=2", "trainer.compile=true"], tmp_path / "b")
    assert [call["mode"] for call in calls] == ["max-autotune-no-cudagraphs", None]


@pytest.mark.parametrize("override,message", [
    (["trainer.compile=true", "trainer.compile_mode=fastest"], "trainer.compile_mode='fastest' is not supported; use one of default, reduce-overhead"),
    (["trainer.compile_mode=max-autotune"], "has no effect without compiling; add trainer.compile=true"),
    (["trainer.compile=true", "strategy=dp"], "trainer.compile=true does not work with strategy=dp"),
    (["trainer.compile=true", "strategy=ddp", "strategy.bucket_cap_mb=0.5"], "strategy.bucket_cap_mb=0.5 is below DDP's first bucket"),
    (["trainer.peak_tflops=-1"], "trainer.peak_tflops=-1.0 must be >= 0"),
    (["trainer.peak_tflops=nan"], "trainer.peak_tflops=nan must be >= 0"),
    (["trainer.tf32=sometimes"], "trainer.tf32"),
    (["model=transformer", "model.activation_checkpointing=sometimes"], "model.activation_checkpointing"),
])
def test_bad_speed_settings_are_one_line_errors(override, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as error:
        validate(compose_config(override))
    assert "\n" not in str(error.value)


# --- no host syncs between logging steps ------------------------------------------------------

TORCH_DIR = os.path.dirname(torch.__file__)
# What reads a tensor's value on the host; on a GPU each of these waits for the device.
SYNCING_METHODS = ("item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__")


READS: list[str] = []  # host reads of tensor values, in order
STARTS: list[int] = []  # len(READS) as each step starts


class StepStarts(Callback):
    """Marks where each step's reads begin (a callback: the loop's own hook, no patching)."""

    def on_step_start(self, run, step) -> None:
        STARTS.append(len(READS))


class ReadsTheLoss(Callback):
    """The classic: loss.item() after every step."""

    def on_step_end(self, run, end) -> None:
        self.last_loss = end.losses[0][0].item()


def _syncs_per_step(overrides: list[str], run_dir: Path, monkeypatch) -> dict[int, list[str]]:
    """Train, counting host reads of tensor values made outside torch itself, per step: from
    the start of step k's forward to the start of step k+1's (k's logging/evaluation included).

    torch's own reads are left out: they are of host-resident values (e.g. AdamW's step
    counters, kept on the CPU unless the optimizer is fused or capturable) and are not
    ringtrain's to change; on CUDA, test_cuda_steps_between_log_steps_do_not_sync checks
    everything, torch included, with torch.cuda.set_sync_debug_mode.
    """
    READS.clear()
    STARTS.clear()

    def counting(name, original):
        def counted(tensor, *args, **kwargs):
            caller = inspect.currentframe().f_back
            if not caller.f_code.co_filename.startswith(TORCH_DIR):
                READS.append(f"Tensor.{name} at {Path(caller.f_code.co_filename).name}:{caller.f_lineno}")
            return original(tensor, *args, **kwargs)
        return counted

    for name in SYNCING_METHODS:
        monkeypatch.setattr(torch.Tensor, name, counting(name, getattr(torch.Tensor, name)))
    train_in_process(overrides + [f"+callbacks.step_starts._target_={__name__}.StepStarts"], run_dir)
    ends = STARTS[1:] + [len(READS)]
    return {step: READS[start:end] for step, (start, end) in enumerate(zip(STARTS, ends), start=1)}


SYNC_TEST_RUN = SMALL_TRANSFORMER + [
    "trainer.max_steps=12", "trainer.log_every_n_steps=5", "trainer.accumulate_grad_batches=2",
    "trainer.grad_clip_norm=1.0", "trainer.eval_every_n_steps=100", "trainer.checkpoint_every_n_steps=100",
]


@pytest.mark.parametrize("precision", ["32", "bf16-mixed"])
def test_steps_between_log_steps_read_nothing_from_the_device(precision, monkeypatch, tmp_path):
    syncs = _syncs_per_step(SYNC_TEST_RUN + [f"trainer.precision={precision}"], tmp_path, monkeypatch)
    assert len(syncs) == 12
    logged = {5, 10, 12}  # every 5th step and the last (which also evaluates and saves)
    assert all(syncs[step] for step in logged)  # the counter sees the reads that are there
    assert {step: calls for step, calls in syncs.items() if step not in logged and calls} == {}


def test_the_sync_check_catches_an_item_call_inserted_in_the_step(monkeypatch, tmp_path):
    syncs = _syncs_per_step(SYNC_TEST_RUN + [f"+callbacks.reads._target_={__name__}.ReadsTheLoss"], tmp_path,
                            monkeypatch)
    flagged = {step for step, calls in syncs.items() if any("Tensor.item at test_speed_features.py" in c for c in calls)}
    assert flagged == set(range(1, 13))


class NoSyncBetweenLogSteps(Callback):
    """CUDA's sync debug mode set to error from the start of each step that does not log to its end."""

    def on_step_start(self, run, step) -> None:
        if step % run.trainer.log_every_n_steps and step != run.total_steps:
            torch.cuda.set_sync_debug_mode("error")

    def on_step_end(self, run, end) -> None:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (RINGTRAIN_TEST_CUDA=1)")
def test_cuda_steps_between_log_steps_do_not_sync(tmp_path):
    train_in_process(SYNC_TEST_RUN + ["trainer.accelerator=cuda", "trainer.precision=bf16-mixed",
                                      "trainer.grad_clip_norm=0",
                                      f"+callbacks.no_sync._target_={__name__}.NoSyncBetweenLogSteps"], tmp_path)


# --- throughput, MFU, memory ------------------------------------------------------------------


def _scalars(run_dir: Path) -> dict[str, list[float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir)).Reload()
    return {tag: [e.value for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_throughput_and_mfu_are_logged_on_cpu_when_the_peak_is_given(tmp_path, caplog):
    common = SMALL_TRANSFORMER + ["trainer.max_steps=6", "trainer.log_every_n_steps=3"]
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        train_in_process(common + ["trainer.peak_tflops=0.5"], tmp_path / "peak")
    scalars = _scalars(tmp_path / "peak")
    assert len(scalars["throughput/step_ms"]) == 2 and all(v > 0 for v in scalars["throughput/step_ms"])
    # MFU = flops_per_token x tokens/s / peak: the logged figures agree with each other.
    flops = Transformer(vocab_size=16, block_size=16, d_model=32, n_layers=1, n_heads=2).flops_per_token()
    expected = [100 * flops * t / 0.5e12 for t in scalars["throughput/tokens_per_sec"]]
    assert scalars["throughput/mfu_percent"] == pytest.approx(expected, rel=1e-5)
    assert "memory/peak_allocated_gib" not in scalars  # CUDA only
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step 3: loss="))
    assert "tok/s=" in line and "ms/step=" in line and "mfu=" in line

    train_in_process(common, tmp_path / "no_peak")  # CPU, no peak given: no MFU
    assert "throughput/mfu_percent" not in _scalars(tmp_path / "no_peak")


def test_a_model_without_flops_per_token_gets_no_mfu_and_one_info_line(tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        train_in_process(["model=mlp", "data.num_features=8", "data.num_samples=256", "trainer.max_steps=4",
                          "trainer.log_every_n_steps=2", "trainer.peak_tflops=1"], tmp_path)
    scalars = _scalars(tmp_path)
    assert "throughput/mfu_percent" not in scalars and "throughput/samples_per_sec" in scalars
    assert sum("MLPClassifier has no flops_per_token()" in r.getMessage() for r in caplog.records) == 1


def test_only_token_data_logs_tokens_per_second(tmp_path, caplog):
    """Regression targets are (batch, 1) floats, not tokens: the speed is samples/s."""
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        train_in_process(["model=linear", "trainer.max_steps=4", "trainer.log_every_n_steps=2"], tmp_path)
    scalars = _scalars(tmp_path)
    assert "throughput/tokens_per_sec" not in scalars and "throughput/samples_per_sec" in scalars
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("step 2: loss="))
    assert "samples/s=" in line and "tok/s" not in line


@pytest.mark.parametrize("name,bf16,tf32", [
    ("NVIDIA H100 80GB HBM3", 989.4, 494.7), ("NVIDIA H100 PCIe", 756.0, 378.0), ("NVIDIA H100 NVL", 835.5, 417.5),
    ("NVIDIA H200", 989.4, 494.7), ("NVIDIA A100-SXM4-80GB", 312.0, 156.0), ("NVIDIA A100 80GB PCIe", 312.0, 156.0),
    ("NVIDIA L4", 121.0, 60.0), ("NVIDIA L40S", 362.1, 183.0), ("NVIDIA A10G", 125.0, 62.5),
    ("NVIDIA GeForce RTX 4090", 165.2, 82.6), ("Tesla V100-SXM2-16GB", None, None),
])
def test_gpu_peaks_are_found_by_device_name(name, bf16, tf32):
    from ringtrain.callbacks.metrics import gpu_peaks, peak_tflops_for

    peaks = gpu_peaks(name)
    assert (peaks.bf16, peaks.tf32) == (bf16, tf32)
    assert peak_tflops_for(peaks, "bf16-mixed", tf32=True) == bf16
    assert peak_tflops_for(peaks, "32", tf32=True) == (tf32 or peaks.fp32)
    assert peak_tflops_for(peaks, "32", tf32=False) == peaks.fp32
    assert peak_tflops_for(peaks, "16-mixed", tf32=True) == peaks.fp16


def test_an_unknown_gpu_gets_no_mfu_and_one_info_line(monkeypatch, caplog):
    from types import SimpleNamespace

    from ringtrain.callbacks.metrics import _flops

    model = Transformer(vocab_size=16, block_size=16, d_model=32, n_layers=1, n_heads=2)
    trainer = SimpleNamespace(peak_tflops=0.0, precision="bf16-mixed", tf32=True)
    dist = SimpleNamespace(device=torch.device("cuda", 0), world_size=2, is_main=True)
    run = SimpleNamespace(trainer=trainer, dist=dist, model=model, module=model)
    peaks = {}
    with caplog.at_level(logging.INFO, logger="ringtrain"):
        for name in ("NVIDIA Imaginary X1", "NVIDIA H100 80GB HBM3"):
            monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None, name=name: name)
            peaks[name] = _flops(run)
    assert peaks == {"NVIDIA Imaginary X1": (model.flops_per_token(), None),
                     "NVIDIA H100 80GB HBM3": (model.flops_per_token(), 2 * 989.4e12)}
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "'NVIDIA Imaginary X1'" in lines[0] and "trainer.peak_tflops" in lines[0]


# --- TF32, the loss, pinned batches -------------------------------------------------------------


def test_tf32_sets_the_cuda_matmul_precision_and_leaves_the_cpu_alone():
    from ringtrain.strategies import set_matmul_precision

    before = torch.get_float32_matmul_precision()
    try:
        set_matmul_precision(torch.device("cpu"), True)
        assert torch.get_float32_matmul_precision() == before == "highest"
        set_matmul_precision(torch.device("cuda"), True)  # only a flag: no GPU needed to set it
        assert torch.get_float32_matmul_precision() == "high"
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # the new API reads it too
        set_matmul_precision(torch.device("cuda"), False)
        assert torch.get_float32_matmul_precision() == "highest"
    finally:
        torch.set_float32_matmul_precision(before)


def test_the_lm_loss_copies_no_logits_unless_asked_and_keeps_a_float32_loss(monkeypatch):
    from ringtrain.data.tasks import LanguageModelTask

    head = torch.nn.Linear(8, 50)
    hidden, targets = torch.randn(2, 6, 8), torch.randint(0, 50, (2, 6))
    targets[0, 0] = -100  # padding counts in neither the loss nor its mean
    seen = []
    real_cross_entropy = F.cross_entropy
    monkeypatch.setattr(F, "cross_entropy", lambda logits, *a, **k: seen.append(logits) or real_cross_entropy(logits, *a, **k))
    logits = head(hidden)
    LanguageModelTask().loss(logits, targets)  # precision 32: the float32 logits themselves, no copy
    assert seen[-1].untyped_storage().data_ptr() == logits.untyped_storage().data_ptr()
    exact = real_cross_entropy(logits.flatten(0, 1), targets.flatten())
    low = logits.detach().bfloat16().requires_grad_()
    # bf16 logits, as CUDA autocast gives them: passed as they are (a raw loop's and nanoGPT's
    # cross-entropy), and the loss is still a float32 number: per-token losses summed in float32.
    loss = LanguageModelTask().loss(low, targets)
    assert seen[-1].dtype == torch.bfloat16 and seen[-1].untyped_storage().data_ptr() == low.untyped_storage().data_ptr()
    assert loss.dtype == torch.float32 and abs(loss.item() - exact.item()) < 2e-2
    loss.backward()
    assert low.grad.dtype == torch.bfloat16 and torch.isfinite(low.grad).all()
    # float32_loss: the float32 copy first, as Hugging Face's loss makes it.
    upcast = LanguageModelTask(float32_loss=True).loss(low, targets)
    assert seen[-1].dtype == torch.float32
    assert torch.equal(upcast, real_cross_entropy(low.float().flatten(0, 1), targets.flatten()))
    # The same number per token either way, summed: loss_sum over the tokens not -100.
    assert torch.allclose(LanguageModelTask().loss_sum(logits, targets), exact * (targets != -100).sum(), rtol=1e-6)


def test_batches_are_pinned_before_their_non_blocking_copy_on_cuda(monkeypatch):
    from ringtrain.data import PairDataset
    from ringtrain.loop.loaders import WorkerOptions, build_train_loader

    events: list[str] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda t, *a: events.append("pin") or t)
    monkeypatch.setattr(torch.Tensor, "to", lambda t, device, non_blocking=False: events.append(
        f"to {torch.device(device).type} non_blocking={non_blocking}") or t)
    data = PairDataset(torch.randn(8, 2), torch.randn(8, 1))
    for pin, expected in [(True, ["pin", "pin", "to cuda non_blocking=True", "to cuda non_blocking=True"]),
                          (False, ["to cuda non_blocking=True", "to cuda non_blocking=True"])]:
        events.clear()
        loader = build_train_loader(data, 4, 0, 1, 0, False, torch.device("cuda"), workers=WorkerOptions(pin_memory=pin))
        assert len(list(loader.batches(0))) == 2 and events == expected


class OptimizerSettings(Callback):
    def on_fit_start(self, run) -> None:
        self.defaults = dict(run.optimizer.defaults)


def test_adam_and_adamw_are_fused_by_default_on_the_cpu_sgd_runs_single_tensor_and_a_set_choice_is_left_alone(tmp_path):
    from ringtrain.optim import build_optimizer
    from ringtrain.run import train_rank

    seen = OptimizerSettings()
    job = validate(compose_config(SMALL_TRANSFORMER + ["trainer.max_steps=1"]))
    job.callbacks["settings"] = seen
    train_rank(job, str(tmp_path))
    assert seen.defaults["fused"] is True  # optimizer=adamw in a real run on the CPU
    cpu, model = torch.device("cpu"), torch.nn.Linear(2, 2)
    chosen = {name: build_optimizer(node, model, cpu).defaults for name, node in {
        "adam": {"_target_": "torch.optim.Adam"}, "sgd": {"_target_": "torch.optim.SGD", "lr": 0.1},
        "foreach": {"_target_": "torch.optim.AdamW", "foreach": True},
        "unfused": {"_target_": "torch.optim.AdamW", "fused": False}}.items()}
    assert chosen["adam"]["fused"] is True and not chosen["sgd"]["fused"] and chosen["sgd"]["foreach"] is False
    assert chosen["foreach"]["foreach"] is True and not chosen["foreach"]["fused"] and chosen["unfused"]["fused"] is False


# --- activation checkpointing -------------------------------------------------------------------


def test_activation_checkpointing_gives_the_same_gradients():
    sizes = dict(vocab_size=32, block_size=16, n_layers=3, n_heads=2, d_model=32, dropout=0.1)
    idx, targets = torch.randint(0, 32, (4, 16)), torch.randint(0, 32, (4, 16))
    gradients = []
    for checkpointing in (False, True):
        torch.manual_seed(0)
        model = Transformer(**sizes, activation_checkpointing=checkpointing)
        torch.manual_seed(1)  # the same dropout masks; checkpoint() replays them in recomputation
        F.cross_entropy(model(idx).flatten(0, 1), targets.flatten()).backward()
        gradients.append({name: p.grad for name, p in model.named_parameters()})
    assert_same_weights(gradients[0], gradients[1], atol=1e-6)


@pytest.mark.slow
def test_activation_checkpointing_trains_to_the_same_weights(tmp_path):
    common = SMALL_TRANSFORMER + ["model.n_layers=2", "trainer.max_steps=8"]
    train_in_process(common, tmp_path / "plain")
    result = train_in_process(common + ["model.activation_checkpointing=true"], tmp_path / "checkpointed")
    assert_same_weights(checkpoint_weights(tmp_path / "plain"), checkpoint_weights(tmp_path / "checkpointed"), atol=1e-6)
    assert math.isfinite(result.metrics["val/loss"])


# --- the GPU preset and the GPT benchmark ---------------------------------------------------------


def test_the_shakespeare_gpu_preset_composes_and_validates(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("First Citizen:\nBefore we proceed any further, hear me speak.\n" * 400, encoding="utf-8")
    cfg = compose_config(["experiment=shakespeare_char_gpu", f"data.path={text}"])
    run = validate(cfg)
    model, trainer = run.model, run.trainer
    assert (model["n_layers"], model["n_heads"], model["d_model"], model["block_size"], model["dropout"]) == (6, 6, 384, 256, 0.2)
    assert (trainer.batch_size, trainer.max_steps, trainer.precision, trainer.compile) == (64, 5000, "bf16-mixed", True)
    assert (trainer.eval_every_n_steps, trainer.limit_val_batches, trainer.grad_clip_norm) == (250, 200, 1.0)
    assert run.optimizer["lr"] == 1e-3 and run.optimizer["betas"] == [0.9, 0.99]
    assert (run.scheduler["warmup_steps"], run.scheduler["min_lr"]) == (100, 1e-4)
    assert run.data["seq_len"] == 256


@pytest.mark.slow
def test_the_gpt_benchmark_tiny_prints_every_row_or_why_it_skipped():
    """bench_gpt.py --tiny with fewer steps (two real compiles: ~30-60 s cold on 2 cores)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks/bench_gpt.py"), "--tiny", "--warmup", "2", "--steps", "2", "--windows", "1"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {line.split("|")[1].strip(): line for line in proc.stdout.splitlines() if line.startswith("| ") and "tok/s" not in line}
    for name in ("ringtrain eager", "ringtrain compiled", "ringtrain compiled whole", "raw loop eager",
                 "raw loop compiled", "Lightning", "Accelerate"):
        assert name in rows, proc.stdout
        cells = rows[name].split("|")  # '', row, tok/s, ms/step, MFU, memory, vs best raw loop, first step, ''
        assert "skipped" in rows[name] or (cells[6].strip().endswith("x") and cells[7].strip().endswith(" s")), rows[name]


@pytest.mark.slow
def test_compiled_ddp_two_ranks_match_one_eager_process(tmp_path, caplog):
    """torch.compile inside DDP (2 gloo ranks, each compiling: ~1-2 minutes on 2 cores), with
    gradient accumulation (no_sync): the weights of one eager process with the whole batch."""
    from conftest import run_cli

    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    common = SMALL_TRANSFORMER + ["trainer.max_steps=6", "trainer.seed=3", "trainer.limit_val_batches=2"]
    proc = run_cli(common + ["strategy=ddp", "trainer.compile=true", "trainer.batch_size=8",
                             "trainer.accumulate_grad_batches=2", f"hydra.run.dir={tmp_path / 'ddp'}"],
                   launcher=torchrun, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert COMPILE_FAILED not in proc.stdout + proc.stderr
    train_in_process(common + ["trainer.batch_size=32"], tmp_path / "single")
    assert_same_weights(checkpoint_weights(tmp_path / "ddp"), checkpoint_weights(tmp_path / "single"), atol=1e-4)
