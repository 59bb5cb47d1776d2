"""trainer.compile compiles a model's repeated blocks, each in place (strategies/compilation.py):
ringtrain's Transformer, a Hugging Face GPT-2 built from its config, and a user's model with an
nn.ModuleList of identical blocks train as eager does (losses to 1e-5 over 5 steps), keep plain
state-dict keys, and resume exactly with compiling on. Real inductor compiles: one block each."""
from __future__ import annotations

import logging

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

from conftest import assert_same_weights, checkpoint_weights
from ringtrain import Trainer
from ringtrain.callbacks import Callback
from ringtrain.data.tasks import LanguageModelTask
from ringtrain.models.transformer import Transformer
from ringtrain.strategies.compilation import repeated_blocks

VOCAB, T = 16, 16
# UserBlock's calls: [eager, compiled]. A tensor, so that dynamo traces the count into the graph
# (a Python list or int would be guarded on, and recompiled for, at every call).
CALLS = torch.zeros(2, dtype=torch.long)


class UserBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        CALLS[int(torch.compiler.is_compiling())] += 1
        return x + torch.tanh(self.mix(self.norm(x)))


class UserModel(nn.Module):
    """A user's own model: embeddings, an nn.ModuleList of identical blocks, a head."""

    def __init__(self, width: int = 32, depth: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.layers = nn.ModuleList(UserBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=T, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


MODELS = {
    "transformer": (lambda: Transformer(vocab_size=VOCAB, block_size=T, n_layers=2, n_heads=2, d_model=32, dropout=0.0),
                    lambda model: model.blocks),
    "hf_gpt2": (_gpt2, lambda model: model.transformer.h),
    "user": (UserModel, lambda model: model.layers),
}


class StepLosses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_step_end(self, run, end) -> None:
        self.losses.append(end.losses[0][0].item())


def _train(build, run_dir, max_steps: int, **options) -> list[float]:
    torch.manual_seed(0)
    model = build()
    tokens = torch.randint(0, VOCAB, (64, T + 1), generator=torch.Generator().manual_seed(1))
    data = TensorDataset(tokens[:, :-1], tokens[:, 1:])
    losses = StepLosses()
    Trainer(run_dir, max_steps=max_steps, batch_size=8, progress_bar=False, eval_every_n_steps=max_steps,
            limit_val_batches=1, optimizer={"_target_": "torch.optim.AdamW", "lr": 3e-3}, callbacks=[losses],
            loggers=[], **options).fit(model, data, data, task=LanguageModelTask())
    return losses.losses


def test_the_repeated_blocks_are_the_largest_module_list_of_one_class():
    for build, blocks in MODELS.values():
        model = build()
        assert repeated_blocks(model) is blocks(model)
    mixed = nn.Sequential(nn.ModuleList([nn.Linear(2, 2), nn.ReLU()]), nn.ModuleList([nn.Linear(2, 2)]))
    assert repeated_blocks(mixed) is None  # nothing repeated: the whole model is compiled


@pytest.mark.parametrize("name", MODELS)
def test_regional_compile_trains_as_eager_and_resumes_exactly(name, tmp_path, monkeypatch, caplog):
    build, blocks = MODELS[name]
    real_compile, compiled = torch.compile, []
    monkeypatch.setattr(torch, "compile", lambda fn, **options: compiled.append(fn.__self__) or real_compile(fn, **options))
    CALLS.zero_()
    eager = _train(build, tmp_path / "eager", 5)
    with caplog.at_level(logging.WARNING, logger="ringtrain"):
        straight = _train(build, tmp_path / "compiled", 5, compile=True)
        _train(build, tmp_path / "resumed", 3, compile=True)
        resumed = _train(build, tmp_path / "resumed", 5, compile=True, resume="auto")
    assert "torch.compile failed" not in caplog.text
    model = build()
    kinds = {type(block) for block in blocks(model)}
    assert len(compiled) == 3 * len(blocks(model)) and {type(m) for m in compiled} == kinds  # each block, not the model
    if name == "user":
        eager_calls, compiled_calls = CALLS.tolist()
        # Compiled: the compiled runs' 5 + 3 + 2 steps and a probe each. Eager: the eager run's
        # 5 steps and every run's validation (one batch at its last step).
        assert (eager_calls, compiled_calls) == ((5 + 4) * 3, (5 + 3 + 2 + 3) * 3)
    assert straight == pytest.approx(eager, abs=1e-5)
    assert resumed == straight[3:]
    weights = checkpoint_weights(tmp_path / "compiled")
    assert weights.keys() == model.state_dict().keys()  # plain keys: no _orig_mod.
    assert_same_weights(checkpoint_weights(tmp_path / "resumed"), weights, atol=0)
