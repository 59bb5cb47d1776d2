"""trainer.activation_checkpointing through the training loop (trainer/loop/setup.py's
checkpoint_activations): one SGD step (lr 1, dropout on, so the recomputation must replay the
forward's dropout masks) gives the same gradients and weights, to 1e-6, with and without it, for
ringtrain's Transformer and a tiny transformers GPT-2 built from a config node (model=hf_gpt2),
in one process and under 2-rank fsdp (slow); a model without a switch is refused in one line.

That the switch took effect is seen, not assumed: every LayerNorm call made with autograd on is
counted (each block has two, the model one more), and a checkpointed block runs its forward twice
per step, once in the forward pass and once more in the backward pass that recomputes it.
"""
from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import pytest
import torch

from conftest import QUIET, assert_same_weights, checkpoint_weights, run_cli, run_module, train_in_process
from helpers import ok, refused

LAYERS = 2
# One optimizer step of plain SGD at lr 1: the weights move by exactly the gradient.
ONE_STEP = ["optimizer=sgd", "optimizer.lr=1.0", "trainer.max_steps=1", "trainer.batch_size=8",
            "trainer.limit_val_batches=1", "trainer.async_checkpoint=false"]
TRANSFORMER = ["model=transformer", "model.block_size=32", "model.d_model=32", f"model.n_layers={LAYERS}",
               "model.n_heads=2", "model.dropout=0.1", "data.vocab_size=32", "data.num_train_tokens=4000",
               "data.num_val_tokens=512"]
# hf_gpt2.yaml's GPT2Config node made tiny; GPT-2's dropouts default to 0.1.
GPT2 = ["model=hf_gpt2", "model.config.n_positions=32", "model.config.n_embd=32", f"model.config.n_layer={LAYERS}",
        "model.config.n_head=2", "data.cache_dir="]
# LayerNorm calls with autograd on in one step of one micro-batch: 2 a block and the final one;
# a checkpointed block runs again in backward.
PLAIN_CALLS, CHECKPOINTED_CALLS = 2 * LAYERS + 1, 4 * LAYERS + 1


@pytest.fixture
def text_file(tmp_path) -> str:
    path = tmp_path / "text.txt"
    path.write_text("First Citizen: Before we proceed any further, hear me speak.\n" * 60, encoding="utf-8")
    return str(path)


def cases(text: str) -> dict[str, list[str]]:
    return {"ringtrain Transformer": TRANSFORMER, "transformers GPT-2": GPT2 + [f"data.path={text}"]}


class StepRecorder:
    """In this process: LayerNorm calls made with autograd on, and the gradients SGD steps with."""

    def __init__(self, monkeypatch):
        self.calls, self.gradients = 0, []
        layer_norm, sgd_step = torch.nn.LayerNorm.forward, torch.optim.SGD.step
        recorder = self

        def counted_layer_norm(module, x):
            recorder.calls += torch.is_grad_enabled()
            return layer_norm(module, x)

        def recorded_step(optimizer, *args, **kwargs):
            recorder.gradients.append([p.grad.detach().clone() for group in optimizer.param_groups
                                       for p in group["params"] if p.grad is not None])
            return sgd_step(optimizer, *args, **kwargs)

        monkeypatch.setattr(torch.nn.LayerNorm, "forward", counted_layer_norm)
        monkeypatch.setattr(torch.optim.SGD, "step", recorded_step)


def one_step(overrides: list[str], run_dir: Path, monkeypatch) -> tuple[StepRecorder, dict]:
    with monkeypatch.context() as patch:
        recorder = StepRecorder(patch)
        result = train_in_process(ONE_STEP + overrides, run_dir)
    assert result.steps == 1 and len(recorder.gradients) == 1
    return recorder, checkpoint_weights(run_dir)


@pytest.mark.parametrize("case", ["ringtrain Transformer", "transformers GPT-2"])
def test_one_step_is_the_same_with_and_without_activation_checkpointing(case, tmp_path, text_file, monkeypatch):
    overrides = cases(text_file)[case]
    plain, plain_weights = one_step(overrides, tmp_path / "plain", monkeypatch)
    checkpointed, checkpointed_weights = one_step(overrides + ["trainer.activation_checkpointing=true"],
                                                  tmp_path / "checkpointed", monkeypatch)
    # The switch took: every block ran twice with autograd on (forward, and the recomputation).
    assert (plain.calls, checkpointed.calls) == (PLAIN_CALLS, CHECKPOINTED_CALLS)
    gradients, again = plain.gradients[0], checkpointed.gradients[0]
    assert len(gradients) == len(again) and all(g.shape == h.shape for g, h in zip(gradients, again))
    assert min(g.abs().max().item() for g in gradients) > 1e-6  # every tensor gets a real gradient
    for i, (g, h) in enumerate(zip(gradients, again)):
        difference = (g - h).abs().max().item()
        assert difference <= 1e-6, f"gradient {i} {tuple(g.shape)} differs by {difference}"
    assert_same_weights(plain_weights, checkpointed_weights, atol=1e-6)


def test_a_model_without_a_switch_is_refused_in_one_line_leaving_nothing_on_disk(tmp_path):
    """model=mlp has neither gradient_checkpointing_enable nor a config.activation_checkpointing."""
    proc = run_module("ringtrain", ["model=mlp", "data.num_features=8", "data.num_samples=64",
                                    "data.num_val_samples=16", "model.hidden_sizes=[4]", "trainer.batch_size=16",
                                    "trainer.max_steps=2", "trainer.activation_checkpointing=true", *QUIET],
                      cwd=tmp_path)
    refused(proc, "trainer.activation_checkpointing=true: MLPClassifier has no switch for it",
            "or set it false")
    assert list(tmp_path.rglob("*")) == []


def test_a_transformers_model_that_cannot_checkpoint_is_refused_as_a_config_error():
    """A transformers model whose class does not support it (supports_gradient_checkpointing
    False, as some architectures declare) is the same one-line ConfigError as a model without a
    switch, not transformers' ValueError."""
    transformers = pytest.importorskip("transformers")
    from ringtrain.errors import ConfigError
    from ringtrain.loop.setup import checkpoint_activations

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=None, eos_token_id=None))
    model.supports_gradient_checkpointing = False
    with pytest.raises(ConfigError, match="GPT2LMHeadModel has no switch for it"):
        checkpoint_activations(model)


def test_enabling_it_on_a_transformers_model_raises_no_deprecation_warning(recwarn):
    """transformers 5 keeps gradient_checkpointing_enable only as a deprecated alias of
    activation_checkpointing_enable (FutureWarning): the run uses the new name where it exists."""
    import warnings

    transformers = pytest.importorskip("transformers")
    from ringtrain.loop.setup import checkpoint_activations

    model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=16, n_positions=8, n_embd=8, n_layer=1, n_head=2, bos_token_id=None, eos_token_id=None))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        checkpoint_activations(model)
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    deprecations = [str(w.message) for w in caught if issubclass(w.category, (FutureWarning, DeprecationWarning))]
    assert deprecations == []


# --- 2-rank fsdp ----------------------------------------------------------------------------------

# A train.py that records, in each process (the launcher and both ranks: spawned ranks import
# this file as their __mp_main__, so the patches apply there too), the LayerNorm calls made with
# autograd on and the local shards of the gradients SGD steps with, in $RECORD_DIR.
RECORDING_TRAIN = textwrap.dedent('''
    import os
    import torch

    record = os.environ["RECORD_DIR"]
    calls = [0]
    layer_norm, sgd_step = torch.nn.LayerNorm.forward, torch.optim.SGD.step


    def rank():
        return os.environ.get("RANK", "launcher")


    def counted_layer_norm(module, x):
        if torch.is_grad_enabled():
            calls[0] += 1
            with open(os.path.join(record, f"calls-{rank()}"), "w") as file:  # a rank may end with os._exit
                file.write(str(calls[0]))
        return layer_norm(module, x)


    def recorded_step(optimizer, *args, **kwargs):
        grads = [p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                 for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.save([g.detach().clone() for g in grads], os.path.join(record, f"grads-{rank()}.pt"))
        return sgd_step(optimizer, *args, **kwargs)


    torch.nn.LayerNorm.forward = counted_layer_norm
    torch.optim.SGD.step = recorded_step

    if __name__ == "__main__":
        import sys

        from ringtrain.__main__ import main

        del sys.argv[1]  # train.py, which run_cli names after its launcher
        main()
''')


def fsdp_step(overrides: list[str], tmp_path: Path, name: str, monkeypatch) -> tuple[dict, dict, list]:
    script, record = tmp_path / "recording_train.py", tmp_path / f"record-{name}"
    script.write_text(RECORDING_TRAIN, encoding="utf-8")
    record.mkdir()
    with monkeypatch.context() as patch:
        patch.setenv("RECORD_DIR", str(record))
        # run_cli runs [launcher..., train.py, args]: our script, which drops train.py from its arguments.
        ok(run_cli(["strategy=fsdp", "strategy.nproc_per_node=2", *ONE_STEP, *overrides,
                           f"hydra.run.dir={tmp_path / name}"], launcher=[sys.executable, str(script)]))
    calls = {f.name[len("calls-"):]: int(f.read_text()) for f in record.glob("calls-*")}
    grads = [torch.load(record / f"grads-{rank}.pt") for rank in ("0", "1")]
    return calls, checkpoint_weights(tmp_path / name), grads


@pytest.mark.slow  # two 2-rank jobs a case: 20-65 s a case here, by load
@pytest.mark.parametrize("case", ["ringtrain Transformer", "transformers GPT-2"])
def test_under_two_rank_fsdp_one_step_is_the_same_with_and_without_it(case, tmp_path, text_file, monkeypatch):
    """FSDP2 shards each block (its pre-forward all-gather runs again inside the recomputation):
    each rank's gradient shards and the gathered weights agree to 1e-6."""
    overrides = cases(text_file)[case] + ["trainer.batch_size=4"]  # 2 ranks x 4: the same 8 rows a step
    plain_calls, plain_weights, plain_grads = fsdp_step(overrides, tmp_path, "plain", monkeypatch)
    calls, weights, grads = fsdp_step(overrides + ["trainer.activation_checkpointing=true"], tmp_path, "checkpointed",
                                monkeypatch)
    assert plain_calls == {"0": PLAIN_CALLS, "1": PLAIN_CALLS}
    assert calls == {"0": CHECKPOINTED_CALLS, "1": CHECKPOINTED_CALLS}
    for rank in (0, 1):
        assert len(plain_grads[rank]) == len(grads[rank]) > 0
        for i, (g, h) in enumerate(zip(plain_grads[rank], grads[rank])):
            difference = (g - h).abs().max().item()
            assert difference <= 1e-6, f"rank {rank}'s gradient shard {i} differs by {difference}"
    assert_same_weights(plain_weights, weights, atol=1e-6)
