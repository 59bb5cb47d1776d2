"""Every option in conf/ reaches the code it configures and changes what it says it changes."""
from __future__ import annotations

import datetime

import pytest
import torch

from conftest import checkpoint_weights, compose_config, train_in_process
from ringtrain.config.schema import validate
from ringtrain.errors import ConfigError


def _optimizer(overrides: list[str]) -> torch.optim.Optimizer:
    from ringtrain.models.linear import LinearRegression
    from ringtrain.optim import build_optimizer

    run = validate(compose_config(overrides))
    return build_optimizer(run.optimizer, LinearRegression(1, 1), torch.device("cpu"))


def test_optimizer_options_reach_the_torch_optimizer():
    sgd = _optimizer(["optimizer.lr=0.2", "optimizer.momentum=0.9", "optimizer.nesterov=true",
                      "optimizer.weight_decay=0.01"])
    assert type(sgd) is torch.optim.SGD
    assert {k: sgd.defaults[k] for k in ("lr", "momentum", "nesterov", "weight_decay")} == {
        "lr": 0.2, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}
    adam = _optimizer(["optimizer=adam", "optimizer.betas=[0.8,0.9]", "optimizer.eps=1e-6", "optimizer.weight_decay=0.02"])
    assert type(adam) is torch.optim.Adam
    assert (adam.defaults["betas"], adam.defaults["eps"], adam.defaults["weight_decay"]) == ((0.8, 0.9), 1e-6, 0.02)
    adamw = _optimizer(["optimizer=adamw", "optimizer.weight_decay=0.3"])
    assert type(adamw) is torch.optim.AdamW
    assert [g["weight_decay"] for g in adamw.param_groups] == [0.3, 0.0]  # the weight matrix, then the bias


def test_val_batch_size_and_limit_val_batches(tmp_path):
    # Metrics are sums over samples: the validation batch size cannot change them.
    base = ["trainer.max_steps=20", "data.num_val_samples=100"]
    default = train_in_process(base, tmp_path / "a").metrics["val/loss"]
    odd = train_in_process(base + ["trainer.val_batch_size=7"], tmp_path / "b").metrics["val/loss"]
    assert odd == pytest.approx(default, rel=1e-6)  # float32 rounding of other batch groupings
    # limit_val_batches=2 with batches of 10: the metric of exactly the first 20 samples.
    limited = train_in_process(base + ["trainer.val_batch_size=10", "trainer.limit_val_batches=2"], tmp_path / "c")
    from ringtrain.data.regression import RegressionData

    data = RegressionData(num_val_samples=100)
    data.setup()
    val = data.val
    weights = checkpoint_weights(tmp_path / "c")
    predictions = val.inputs[:20] @ weights["linear.weight"].T + weights["linear.bias"]
    expected = (predictions - val.targets[:20]).pow(2).mean().item()
    assert limited.metrics["val/loss"] == pytest.approx(expected, rel=1e-5) and expected != pytest.approx(default)


@pytest.mark.parametrize("drop_last,steps_per_epoch", [(False, 4), (True, 3)])
def test_drop_last_drops_the_short_batch(tmp_path, drop_last, steps_per_epoch):
    result = train_in_process(["data.num_samples=100", f"trainer.drop_last={str(drop_last).lower()}",
                               "trainer.max_epochs=2"], tmp_path)
    assert result.steps == 2 * steps_per_epoch  # 100 samples in batches of 32


def test_a_batch_larger_than_the_data_is_the_whole_set_and_the_log_says_so(tmp_path, caplog):
    """Without drop_last a batch over the data is not refused: each step trains on all of it."""
    with caplog.at_level("INFO", logger="ringtrain"):
        result = train_in_process(["data.num_samples=50", "trainer.batch_size=1000", "trainer.max_steps=3"], tmp_path / "a")
    assert result.steps == 3 and result.metrics["val/loss"] > 0
    assert ("trainer.batch_size=1000 is more than the training set's 50 samples: each batch is the whole set, "
            "50 samples") in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="ringtrain"):  # a batch the data fills: nothing to say
        train_in_process(["data.num_samples=50", "trainer.batch_size=50", "trainer.max_steps=1"], tmp_path / "b")
    assert "run directory" in caplog.text and "is more than" not in caplog.text


def test_drop_last_with_data_only_the_run_can_set_up_is_refused_when_it_is_built(tmp_path):
    """The Python API's data sets (like data that needs its prepare_data) reach no pre-check:
    the run refuses a batch that drop_last leaves nothing of when it builds the data."""
    from ringtrain import Trainer
    from ringtrain.data.tasks import RegressionTask

    def points(n):
        return torch.utils.data.TensorDataset(torch.randn(n, 1), torch.randn(n, 1))

    trainer = Trainer(tmp_path / "run", batch_size=64, drop_last=True, max_steps=2, progress_bar=False)
    with pytest.raises(ConfigError, match=r"the training set has 40 samples, too few for one batch of "
                                          r"trainer.batch_size=64; set trainer.batch_size=40 or lower"):
        trainer.fit(torch.nn.Linear(1, 1), points(40), points(8), RegressionTask())


def test_progress_bar_shows_steps_and_the_train_loss(tmp_path, capsys):
    train_in_process(["trainer.progress_bar=true", "trainer.max_steps=10", "trainer.log_every_n_steps=5"], tmp_path)
    err = capsys.readouterr().err
    assert "train: 100%" in err and "10/10" in err and "loss=" in err


def test_strategy_timeout_reaches_the_process_group(monkeypatch):
    import ringtrain.distributed as distributed

    seen = {}
    monkeypatch.setattr(distributed.dist, "init_process_group", lambda **kwargs: seen.update(kwargs))
    for key, value in dict(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1").items():
        monkeypatch.setenv(key, value)
    run = validate(compose_config(["strategy=ddp", "strategy.timeout_minutes=1.5", "strategy.backend=gloo"]))
    run.strategy.setup_process("cpu")
    assert seen["timeout"] == datetime.timedelta(minutes=1.5) and seen["backend"] == "gloo"
    assert seen["init_method"] == "env://"


def test_regression_line_and_class_separation_are_the_data_sets_knobs():
    from ringtrain.data.classification import ClassificationData
    from ringtrain.data.regression import RegressionData

    data = RegressionData(weight=-1.5, bias=0.25, noise_std=0.0, num_samples=50)
    data.setup()
    assert torch.allclose(data.train.targets, -1.5 * data.train.inputs + 0.25)

    def centre_accuracy(separation: float) -> float:
        data = ClassificationData(num_features=32, num_samples=3000, class_separation=separation)
        data.setup()
        x, y = data.train.inputs, data.train.targets
        centres = torch.stack([x[y == c].mean(0) for c in range(10)])
        return (torch.cdist(data.val.inputs, centres).argmin(1) == data.val.targets).float().mean().item()

    assert centre_accuracy(1.0) < 0.6 < 0.95 < centre_accuracy(8.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_accelerator_cuda_without_a_gpu_is_refused():
    with pytest.raises(ConfigError, match="trainer.accelerator=cuda but no CUDA device is visible"):
        validate(compose_config(["trainer.accelerator=cuda"]))
