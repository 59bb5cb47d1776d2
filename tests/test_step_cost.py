"""The loop's own cost per optimizer step, counted in device ops rather than timed.

On a small model the work of a step (forward, loss, backward, optimizer step) is a few dozen
microseconds, and every tensor op the loop adds around it (a gradient norm, an isfinite, a
torch.where, a stack) costs a few microseconds of dispatch: issue 21 measured the loop's
bookkeeping at several times the model's work. Counting the `aten::` ops torch.profiler
records catches such an op the day it is added, with no timing and so no flakiness.
"""
from __future__ import annotations

import subprocess
import sys
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from conftest import train_in_process
from ringtrain.callbacks import Callback

# Device ops a plain step (no log, no evaluation, no save) may add to the bare work of
# forward + loss + backward + optimizer.step + zero_grad: the loss's detach (see the test).
MAX_EXTRA_OPS_PER_STEP = 1
PROFILED_STEP = 3  # default job: logs every 50 steps, evaluates and saves at each epoch's end


def _aten_ops(run) -> Counter:
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        run()
    return Counter(e.name for e in profiler.events() if e.name.startswith("aten::"))


COUNTED: dict[str, Counter] = {}


class ProfileLoopStep(Callback):
    """The aten ops from step PROFILED_STEP's start to the end of every other callback's
    on_step_end (this one is listed last): COUNTED["loop"]."""

    def on_step_start(self, run, step) -> None:
        if step == PROFILED_STEP:
            self.profiler = profile(activities=[ProfilerActivity.CPU])
            self.profiler.__enter__()

    def on_step_end(self, run, end) -> None:
        if end.step == PROFILED_STEP:
            self.profiler.__exit__(None, None, None)
            COUNTED["loop"] = Counter(e.name for e in self.profiler.events() if e.name.startswith("aten::"))


class ProfileOneStep(ProfileLoopStep):
    """The loop's step, then the same model's bare step on a batch of the same shape."""

    def on_step_end(self, run, end) -> None:
        super().on_step_end(run, end)
        if end.step != PROFILED_STEP:
            return
        inputs, targets = torch.randn(run.trainer.batch_size, 1), torch.randn(run.trainer.batch_size, 1)

        def bare_step():
            run.task.loss(run.module(inputs), targets).backward()
            run.optimizer.step()
            run.optimizer.zero_grad(set_to_none=True)

        COUNTED["bare"] = _aten_ops(bare_step)


def _extra_ops_of_a_plain_step(tmp_path) -> Counter:
    """The aten ops of one whole optimizer step of the default job (single, fp32) as the loop
    runs it, callbacks included, minus those of the same model's bare step."""
    COUNTED.clear()
    train_in_process(["trainer.max_steps=5", "strategy=single", "trainer.precision=32",
                      f"+callbacks.profile_one_step._target_={__name__}.ProfileOneStep"], tmp_path)
    return COUNTED["loop"] - COUNTED["bare"]


def test_a_plain_step_adds_at_most_a_few_device_ops(monkeypatch, tmp_path):
    """A step that neither logs, evaluates nor saves dispatches at most
    MAX_EXTRA_OPS_PER_STEP (1) aten op beyond the bare step of the same model, with the
    defaults (on_nonfinite=stop, constant schedule): the `detach` of each micro-batch's loss,
    which the meter and the non-finite watch share (both only list it). Any op added to every
    step fails this test: a `loss.neg()` makes it 2, a `torch.isfinite(loss)` 12. Before
    issue 21 the count was 64: a gradient norm every step, isfinite, where, and more."""
    extra = _extra_ops_of_a_plain_step(tmp_path)
    assert sum(extra.values()) <= MAX_EXTRA_OPS_PER_STEP, sorted(extra.items())


# The ops a Transformer step of ringtrain's runs beyond a hand-written step's, each with why and
# what it costs. Nothing else: a new op in the step fails the test below until it is listed here.
TRANSFORMER_STEP_EXTRAS = {
    # StepLoss keeps each micro-batch's loss detached, for the metrics and the non-finite watch
    # to read later without holding the graph: a view, no copy (~1 us of dispatch on the CPU).
    "aten::detach": 1,
    # (LanguageModelTask passes the logits as they are, as this hand-written step does; its
    # float32_loss option adds a float32 copy, and bf16 logits add a float32 sum of the B x T
    # per-token losses: neither on this float32 CPU step, data/tasks.py.)
}


def test_a_transformer_step_runs_a_hand_written_steps_ops_plus_the_listed_extras(tmp_path):
    """One plain step (no log, evaluation or save) of `model=transformer optimizer=adamw`, as
    the loop runs it, callbacks included, against nanoGPT's step written by hand: forward,
    F.cross_entropy, backward, the same fused AdamW, gradients set to None."""
    import torch.nn.functional as F

    from ringtrain.models.transformer import Transformer
    from ringtrain.optim import parameter_groups

    COUNTED.clear()
    train_in_process(["model=transformer", "model.n_layers=2", "model.d_model=32", "optimizer=adamw",
                      "trainer.max_steps=4", "trainer.checkpoint=false",
                      f"+callbacks.profile_loop_step._target_={__name__}.ProfileLoopStep"], tmp_path)
    model = Transformer(vocab_size=64, block_size=64, n_layers=2, n_heads=4, d_model=32, dropout=0.0)
    optimizer = torch.optim.AdamW(parameter_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), fused=True)
    tokens = torch.randint(0, 64, (32, 65))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step():
        F.cross_entropy(model(inputs).flatten(0, 1), targets.flatten()).backward()
        optimizer.step()
        for param in model.parameters():
            param.grad = None

    for _ in range(PROFILED_STEP - 1):  # the optimizer's state exists, as at the loop's step 3
        step()
    hand_written = _aten_ops(step)
    assert COUNTED["loop"] - hand_written == Counter(TRANSFORMER_STEP_EXTRAS)
    assert not hand_written - COUNTED["loop"]


# --- what the cheap non-finite watch still guarantees ------------------------------------------


def _poison_gradients_at(step: int, monkeypatch) -> None:
    """NaN gradients at optimizer step `step`, whose loss stays finite: only the update is bad."""
    from ringtrain.strategies import Precision

    original, calls = Precision.unscale_, []

    def unscale_then_poison(self, optimizer):
        original(self, optimizer)
        calls.append(None)
        if len(calls) == step:
            for group in optimizer.param_groups:
                for param in group["params"]:
                    param.grad.fill_(float("nan"))

    monkeypatch.setattr(Precision, "unscale_", unscale_then_poison)


def test_a_nonfinite_update_on_a_saving_step_is_caught_before_the_save(monkeypatch, tmp_path, caplog):
    """Step 4 saves last.pt (checkpoint_every_n_steps=4) and neither logs nor measures its
    gradient norm; its update is the first bad one and its loss was finite, so only the
    weights' check at the save can catch it: the run stops naming step 4, saving nothing."""
    _poison_gradients_at(4, monkeypatch)
    result = train_in_process(["trainer.max_steps=10", "trainer.checkpoint_every_n_steps=4"], tmp_path)
    assert result.stopped == "non-finite" and result.steps == 4
    assert "at step 4; stopped at step 4 (nothing was saved)" in caplog.text
    assert not list((tmp_path / "checkpoints").glob("*.pt"))


def test_a_nonfinite_update_between_checks_is_named_by_the_next_loss(monkeypatch, tmp_path, caplog):
    """Step 2's update is bad, with a finite loss, and nothing checks it (no log, no save):
    step 3's loss is the first non-finite value, found at step 3's save, which never happens."""
    _poison_gradients_at(2, monkeypatch)
    result = train_in_process(["trainer.max_steps=10", "trainer.checkpoint_every_n_steps=3"], tmp_path)
    assert result.stopped == "non-finite" and result.steps == 3
    assert "at step 3; stopped at step 3 (nothing was saved)" in caplog.text


def test_the_command_leaves_what_is_alive_at_its_end_out_of_the_exit_collections(tmp_path):
    """Python's exit walked the ~320 000 objects torch, Hydra and TensorBoard leave, in each of
    its last full collections: 0.4 s of the default job's 2.6 s (benchmarks/bench_process.py).
    The command freezes them once the job is over; the job's own outputs are unchanged."""
    probe = (
        "import atexit, gc, sys\n"
        "atexit.register(lambda: print('frozen at exit:', gc.get_freeze_count()))\n"
        f"sys.argv = ['ringtrain', 'trainer.max_steps=2', 'hydra.run.dir={tmp_path / 'run'}']\n"
        "from ringtrain.__main__ import main\n"
        "main()\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    frozen = int(done.stdout.split("frozen at exit:")[1])
    assert frozen > 100_000
    assert (tmp_path / "run" / "checkpoints" / "last.pt").is_file()
    assert (tmp_path / "run" / "metrics.json").is_file()


def test_a_callback_with_nothing_to_do_at_a_step_is_not_called_at_it(monkeypatch, tmp_path):
    """Issue 37: at a step that does not log, on_step_end is called only on the callbacks with
    work there (the losses and sample counts kept for the next log); the progress bar without a
    bar, the summary once printed and the profiler without profile_steps say so in on_fit_start."""
    from ringtrain.callbacks import console, metrics

    calls = Counter()
    for cls in (console.ProgressBar, console.ModelSummary, metrics.Profiler, metrics.Throughput,
                metrics.TrainMetrics):
        def counting(self, run, end, original=cls.on_step_end, name=cls.__name__):
            if not end.logging:
                calls[name] += 1
            original(self, run, end)
        monkeypatch.setattr(cls, "on_step_end", counting)
    train_in_process(["trainer.max_steps=20", "trainer.progress_bar=false"], tmp_path)
    assert calls == {"TrainMetrics": 19, "Throughput": 19}  # step 20, the last, logs
