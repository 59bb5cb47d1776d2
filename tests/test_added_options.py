"""The options added with components, resilience and fsdp reach the code they configure.

Each test sets the option through the config (or the strategy section) and checks what the
code it configures received or did; the behaviour behind them is tested where it lives
(test_user_components, test_resilience, test_fsdp*).
"""
from __future__ import annotations

import pytest
import torch
from torch.utils.data import Dataset

from conftest import compose_config, train_in_process
from ringtrain.config.schema import validate
from ringtrain.errors import ConfigError


class Squares(Dataset):
    """A map-style Dataset without get_batch: batches come from a torch DataLoader."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int):
        x = torch.tensor([float(index) / 64])
        return x, 2 * x + 3


def test_loader_options_reach_the_training_and_validation_loaders(tmp_path, monkeypatch):
    import ringtrain.loop.setup as loop

    seen = []

    def recording(*args, workers, **kwargs):
        seen.append(workers)
        return original(*args, workers=workers, **kwargs)

    original = loop.build_train_loader
    monkeypatch.setattr(loop, "build_train_loader", recording)
    train_in_process(["trainer.max_steps=2", "trainer.num_workers=2", "trainer.persistent_workers=true",
                      "trainer.prefetch_factor=3", "trainer.pin_memory=true"], tmp_path)
    (workers,) = seen
    assert (workers.num_workers, workers.persistent_workers, workers.prefetch_factor, workers.pin_memory) == (2, True, 3, True)


def test_persistent_workers_live_across_epochs_with_their_prefetch(tmp_path):
    from ringtrain.loop.loaders import WorkerOptions, build_train_loader

    options = WorkerOptions(num_workers=1, persistent_workers=True, prefetch_factor=3, seed=0)
    loader = build_train_loader(Squares(), 16, 0, 1, 0, False, torch.device("cpu"), workers=options)
    first = [x for x, _ in loader.batches(0)]
    torch_loader = loader._loader
    second = [x for x, _ in loader.batches(1)]
    assert len(first) == len(second) == 4 and loader._loader is torch_loader  # one DataLoader, kept
    assert torch_loader.persistent_workers and torch_loader.prefetch_factor == 3 and torch_loader.num_workers == 1
    assert sorted(torch.cat(first).flatten().tolist()) == sorted(torch.cat(second).flatten().tolist())


def test_keep_last_k_keeps_that_many_step_files(tmp_path):
    train_in_process(["trainer.max_steps=12", "trainer.checkpoint_every_n_steps=3", "trainer.keep_last_k=1",
                      "trainer.eval_every_n_steps=100"], tmp_path)
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["best.pt", "last.pt", "step-00000012.pt"]


@pytest.mark.parametrize("names", [["SIGUSR2"], []])
def test_stop_signals_reach_the_handler(tmp_path, monkeypatch, names):
    import ringtrain.run as run

    seen = []

    class Recording(run.StopSignals):
        def __init__(self, signal_names):
            seen.append(list(signal_names))
            super().__init__(signal_names)

    monkeypatch.setattr(run, "StopSignals", Recording)
    train_in_process(["trainer.max_steps=2", f"trainer.stop_signals=[{','.join(names)}]"], tmp_path)
    assert seen == [names]


@pytest.mark.parametrize("value,message", [
    ("[SIGKILL]", "'SIGKILL' is not a signal this process can catch"),
    ("[SIGTERMS]", "'SIGTERMS' is not a signal this process can catch"),
])
def test_bad_stop_signals_are_one_line(value, message):
    with pytest.raises(ConfigError, match=message):
        validate(compose_config([f"trainer.stop_signals={value}"]))


def test_decay_matrices_only_false_decays_every_parameter():
    from ringtrain.models.linear import LinearRegression
    from ringtrain.optim import build_optimizer

    run = validate(compose_config(["optimizer=adamw", "optimizer.decay_matrices_only=false", "optimizer.weight_decay=0.3"]))
    adamw = build_optimizer(run.optimizer, LinearRegression(1, 1), torch.device("cpu"))
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.3] and len(adamw.param_groups[0]["params"]) == 2


def test_task_monitor_and_mode_choose_what_best_pt_and_a_sweep_follow(tmp_path):
    result = train_in_process(["model=mlp", "data.num_features=16", "data.num_samples=256", "data.num_val_samples=64",
                               "model.hidden_sizes=[8]", "trainer.max_steps=8", "trainer.eval_every_n_steps=2",
                               "task.monitor=val/loss", "task.mode=min"], tmp_path)
    assert (result.monitor, result.mode) == ("val/loss", "min")
    best = torch.load(tmp_path / "checkpoints" / "best.pt", weights_only=True)
    assert best["monitor"] == "val/loss" and result.best_metric == pytest.approx(best["progress"]["best_metric"])


def test_fsdp_options_reach_fully_shard(monkeypatch):
    import ringtrain.strategies.fsdp as fsdp
    from ringtrain.models.transformer import Block, Transformer
    from ringtrain.config.schema import strategy_option, trainer_config
    from ringtrain.distributed import DistInfo

    seen = {}
    monkeypatch.setattr(fsdp, "shard_model", lambda model, device, **options: seen.update(options) or model)
    strategy = strategy_option("fsdp", shard_classes=["Block"], reshard_after_forward=False, cpu_offload=True)
    info = DistInfo(0, 0, 2, torch.device("cpu"), "gloo")
    trainer = trainer_config(precision="bf16-mixed")
    strategy.setup_module(Transformer(vocab_size=8, block_size=4, n_layers=2, d_model=8, n_heads=2), info, trainer)
    assert seen == {"shard_classes": (Block,), "reshard_after_forward": False, "param_dtype": torch.bfloat16,
                    "cpu_offload": True}


def test_strategy_fsdp_options_compose_and_validate():
    run = validate(compose_config(["strategy=fsdp", "strategy.nproc_per_node=2", "strategy.reshard_after_forward=false",
                                   "strategy.cpu_offload=true", "strategy.shard_classes=[Block]"]))
    assert (run.strategy.reshard_after_forward, run.strategy.cpu_offload, run.strategy.shard_classes) == (False, True, ["Block"])
