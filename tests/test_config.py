"""Every config composes and builds; every user mistake is one clear line and a non-zero exit."""
from __future__ import annotations

import itertools
import os
import subprocess
import sys

import pytest
import torch

from conftest import CONF_DIR, compose_config, run_cli
from helpers import refused
from ringtrain.config.builders import build_data, build_model
from ringtrain.config.schema import validate
from ringtrain.errors import ConfigError

# Sizes that keep building every data set fast; they do not change what is being checked.
SMALL_DATA = {
    "regression": ["data.num_samples=64"],
    "classification": ["data.num_samples=64", "data.num_val_samples=16", "data.num_features=8"],
    "tokens": ["data.num_train_tokens=2000", "data.num_val_tokens=500"],
}


def _options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


def test_every_group_has_its_expected_options():
    assert _options("model") == ["hf_gpt2", "linear", "mlp", "transformer"]
    assert _options("data") == ["chat", "cifar10", "classification", "hf_rows", "hf_text", "mixture", "regression",
                                "stream", "text", "token_file", "token_shards", "tokens"]
    # The callbacks every run has are default.yaml's nodes; the options are what a run adds or removes.
    assert _options("callbacks") == ["best_checkpoints", "default", "early_stopping", "ema", "none"]
    assert _options("logger") == ["csv", "mlflow", "tensorboard", "wandb"]  # none: ~logger
    assert _options("optimizer") == ["adam", "adamw", "sgd"]
    assert _options("scheduler") == ["constant", "cosine"]
    assert _options("strategy") == ["ddp", "dp", "fsdp", "single"]
    assert _options("task") == ["classification", "language_model", "regression"]


def test_every_component_option_is_a_target_node():
    """No name-to-class registry: each built-in option is a YAML `_target_`."""
    for group in ("model", "data", "task", "optimizer", "scheduler"):
        for option in _options(group):
            node = compose_config([f"{group}={option}"] + (["data.path=README.md"] if option == "text" else []))[group]
            assert "_target_" in node and "name" not in node, (group, option)


FITTING = [("linear", "regression"), ("mlp", "classification"), ("transformer", "tokens")]


def test_a_component_is_built_as_hydras_instantiate_builds_it():
    """`build` calls a node of plain arguments itself, and hands Hydra the rest (nested nodes,
    `_partial_`): each gives what `instantiate(node, _convert_="all")` gives, plain copies of
    the node's lists and dicts, and a target's ValueError is one ConfigError line naming the node."""
    import functools

    from hydra.utils import instantiate

    from ringtrain.components import build

    plain = {"_target_": "builtins.dict", "sizes": [64, 32], "extra": {"scale": 2.0}, "name": "x"}
    nested = {"_target_": "builtins.dict", "inner": {"_target_": "builtins.dict", "sizes": [1]}}
    partial = {"_target_": "builtins.dict", "_partial_": True, "a": 1}
    for node in (plain, nested):
        built = build(node, "model")
        assert built == instantiate(dict(node), _convert_="all")
        assert type(built) is dict and all(type(v) in (list, dict, str) for v in built.values())
    built = build(plain, "model", filled=3)
    assert built["filled"] == 3 and built["sizes"] is not plain["sizes"] and built["extra"] is not plain["extra"]
    assert isinstance(build(partial, "model"), functools.partial) and build(partial, "model")() == {"a": 1}
    with pytest.raises(ConfigError, match=r"^optimizer \(torch.optim.SGD\): Invalid learning rate: -1.0; fix the "
                                          r"optimizer arguments$"):
        build({"_target_": "torch.optim.SGD", "lr": -1.0}, "optimizer", params=[torch.zeros(1, requires_grad=True)])


@pytest.mark.parametrize("model,data", FITTING)
def test_every_model_data_pair_composes_validates_and_builds(model, data):
    run = validate(compose_config([f"model={model}", f"data={data}", *SMALL_DATA[data]]))
    bundle = build_data(run.data)
    net = build_model(run.model, bundle.dims)
    inputs, _ = bundle.train.get_batch(__import__("torch").arange(2))
    assert net(inputs).shape[0] == 2


@pytest.mark.parametrize("model,data", [(m, d) for m, _ in FITTING for _, d in FITTING if (m, d) not in FITTING])
def test_a_model_the_data_does_not_fit_is_refused_naming_the_missing_size(model, data):
    with pytest.raises(ConfigError) as info:
        validate(compose_config([f"model={model}", f"data={data}"]))
    assert "is required by ringtrain.models." in str(info.value) and "pick data that gives it" in str(info.value)


def test_text_data_composes_and_builds(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("hello world, hello ringtrain. " * 200, encoding="utf-8")
    run = validate(compose_config(["model=transformer", "data=text", f"data.path={text}",
                                   f"data.cache_dir={tmp_path / 'cache'}"]))
    bundle = build_data(run.data)
    assert bundle.dims["vocab_size"] == len(set(text.read_text()))
    assert bundle.vocab == {"kind": "char", "chars": "".join(sorted(set(text.read_text())))}


@pytest.mark.parametrize(
    "optimizer,scheduler,strategy",
    list(itertools.product(_options("optimizer"), _options("scheduler"), _options("strategy"))),
)
def test_every_optimizer_scheduler_strategy_option_validates(optimizer, scheduler, strategy):
    ranks = ["strategy.nproc_per_node=2"] if strategy == "fsdp" else []  # fsdp needs a process group
    run = validate(compose_config([f"optimizer={optimizer}", f"scheduler={scheduler}", f"strategy={strategy}", *ranks]))
    expected = compose_config([f"optimizer={optimizer}", f"scheduler={scheduler}", f"strategy={strategy}"])
    built = f"{type(run.strategy).__module__}.{type(run.strategy).__qualname__}"
    assert run.optimizer["_target_"] == expected.optimizer._target_ and built == expected.strategy._target_
    assert run.scheduler["_target_"] == expected.scheduler._target_


def test_model_choice_picks_a_fitting_data_set_and_the_data_its_task():
    def chosen(overrides):
        cfg = compose_config(overrides)
        return cfg.data._target_.rsplit(".", 1)[1], cfg.task._target_.rsplit(".", 1)[1]

    assert chosen(["model=transformer"]) == ("MarkovTokens", "LanguageModelTask")
    assert chosen(["model=mlp"]) == ("ClassificationData", "ClassificationTask")
    assert chosen([]) == ("RegressionData", "RegressionTask")
    assert chosen(["model=transformer", "data=text"]) == ("CharText", "LanguageModelTask")


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["model=transformer", "data=regression"], "model.vocab_size is required by ringtrain.models.transformer.Transformer"),
        (["trainer.batch_size=0"], "trainer.batch_size=0 must be positive; set trainer.batch_size to 1 or more"),
        (["trainer.batch_size=abc"], "trainer.batch_size"),
        (["+trainer.bach_size=4"], "trainer.bach_size: unknown key"),
        (["trainer.precision=fp8"], "trainer.precision='fp8' is not supported"),
        (["trainer.precision=16-mixed", "trainer.accelerator=cpu"], "16-mixed needs a CUDA device"),
        (["trainer.max_epochs=0", "trainer.max_steps=0"], "set one of them positive"),
        (["trainer.max_steps=0"], "trainer.max_steps=0 would train nothing; set the number of optimizer steps to "
                                  "train, or -1 to train trainer.max_epochs epochs"),
        (["trainer.max_steps=-3"], "trainer.max_steps=-3 is not a number of steps"),
        (["optimizer.lr=-1"], "optimizer (torch.optim.SGD): Invalid learning rate: -1"),
        (["optimizer._target_=torch.optim.Lion"], "torch.optim has no module or attribute 'Lion'"),
        (["scheduler=cosine", "scheduler.min_lr=1"], "scheduler.min_lr=1 exceeds optimizer.lr=0.01"),
        (["trainer.precision=bf16"], "trainer.precision=bf16-mixed is the mixed-precision name here"),
        (["trainer.persistent_workers=true"], "set trainer.num_workers >= 1"),
        (["data.num_samples=-5"], "data.num_samples"),
        (["model=transformer", "data=text"], "data.path is not set"),
        (["model=transformer", "data=text", "data.path=/nonexistent/x.txt"], "does not exist"),
        (["trainer.resume=/nonexistent/last.pt"], "trainer.resume='/nonexistent/last.pt' is not a file"),
        (["trainer.checkpoint_every_n_steps=-1"], "trainer.checkpoint_every_n_steps=-1 must be >= 0 (0: save only "
                                                  "at evaluations, at the end and on a stop signal)"),
        # Another optimizer or schedule over a preset: the preset's keys it does not take, and the fix.
        (["optimizer._target_=torch.optim.RMSprop"],
         "optimizer.nesterov: torch.optim.RMSprop takes no argument 'nesterov'; the optimizer preset set it: "
         "remove it with ~optimizer.nesterov; its arguments are lr, alpha"),
        (["optimizer._target_=torch.optim.Adam"],
         "the optimizer preset set it (and nesterov): remove them with ~optimizer.momentum ~optimizer.nesterov;"),
        (["scheduler=cosine", "scheduler._target_=torch.optim.lr_scheduler.StepLR", "+scheduler.step_size=3"],
         "scheduler.min_lr: torch.optim.lr_scheduler.StepLR takes no argument 'min_lr'; the scheduler preset set "
         "it: remove it with ~scheduler.min_lr;"),
        (["+optimizer.momentun=0.9"], "takes no argument 'momentun'; did you mean optimizer.momentum?"),
        (["trainer.limit_val_batches=1", "trainer.val_batch_size=1", "strategy=ddp", "strategy.nproc_per_node=2"],
         "trainer.limit_val_batches=1 validates on 1 samples (one process's first batches), fewer than the 2 "
         "processes that share them"),
        # Which of the strategy's sizes is wrong, and its value.
        (["strategy=ddp", "strategy.nproc_per_node=0"], "strategy.nproc_per_node=0 must be positive"),
        (["strategy=ddp", "strategy.timeout_minutes=-1"], "strategy.timeout_minutes=-1 must be positive"),
        (["strategy=ddp", "strategy.bucket_cap_mb=0"], "strategy.bucket_cap_mb=0 must be positive"),
        # A function target is held against its signature and return annotation, not called.
        (["scheduler._target_=builtins.print"],
         "scheduler._target_='builtins.print' takes no argument 'optimizer', which ringtrain passes it"),
        (["optimizer._target_=builtins.print"], "takes no argument 'params', which ringtrain passes it"),
        (["model._target_=test_config.make_a_dataset"],
         "model._target_='test_config.make_a_dataset' returns a torch.utils.data.Dataset, not a torch.nn.Module"),
    ],
)
def test_bad_config_gives_one_clear_error(overrides, message):
    with pytest.raises(ConfigError) as info:
        validate(compose_config(overrides))
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_another_optimizer_over_the_preset_builds_once_its_leftovers_are_removed():
    """The README's example: any torch.optim class by _target_, the sgd preset's keys it lacks removed."""
    from ringtrain.optim import build_optimizer

    run = validate(compose_config(["optimizer._target_=torch.optim.RMSprop", "~optimizer.nesterov"]))
    optimizer = build_optimizer(run.optimizer, torch.nn.Linear(2, 1), torch.device("cpu"))
    assert type(optimizer) is torch.optim.RMSprop and optimizer.defaults["lr"] == 0.01


@pytest.mark.parametrize("overrides,message", [
    (["model=transformer", "model.d_model=30", "model.n_heads=4"], "model.d_model=30 must be divisible by model.n_heads=4"),
    (["model=transformer", "model.n_layers=0"], "model.n_layers=0 must be a positive integer"),
    (["model=mlp", "model.dropout=1.5"], "model.dropout=1.5 must be in [0, 1)"),
    (["model=mlp", "+model.in_features=5"], "model.in_features=5 but the data has in_features=3072"),
    (["model=transformer", "data.seq_len=128"], "the data's sequences are 128 tokens long but the model has 64 positions "
                                                "(block_size); raise the model's block_size to 128 or shorten data.seq_len"),
    (["trainer.batch_size=20000", "trainer.drop_last=true"],
     "trainer.drop_last=true drops every batch: the training set has 10000 samples, too few for one batch of "
     "trainer.batch_size=20000; set trainer.batch_size=10000 or lower, or trainer.drop_last=false"),
])
def test_a_mistake_found_as_the_run_builds_is_one_line_and_leaves_no_run_directory(tmp_path, overrides, message):
    """What only the built components know (the model's own checks, the data's lengths, the first
    step) is refused by the run itself, once: no pre-check builds them twice."""
    from conftest import train_in_process
    from ringtrain.errors import UserError

    with pytest.raises(UserError) as info:
        train_in_process(overrides, tmp_path / "run")
    assert message in str(info.value) and "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()


def test_each_rank_needs_a_sample_and_under_drop_last_a_whole_batch():
    from types import SimpleNamespace

    from ringtrain.config.builders import check_data_lengths

    trainer = SimpleNamespace(batch_size=6000, drop_last=True)
    with pytest.raises(ConfigError, match=r"too few for one batch of trainer.batch_size=6000 on each of 2 processes "
                                          r"\(12000 samples\); set trainer.batch_size=5000 or lower"):
        check_data_lengths(10000, 100, trainer, ranks=2)
    check_data_lengths(10000, 100, SimpleNamespace(batch_size=5000, drop_last=True), ranks=2)
    with pytest.raises(ConfigError, match="the validation set has 2 samples but 3 processes need at least one each"):
        check_data_lengths(10000, 2, SimpleNamespace(batch_size=8, drop_last=False), ranks=3)


# Function targets the next test follows: each notes that it was called.
CALLED: list[str] = []


def make_a_linear_model(in_features: int, out_features: int) -> torch.nn.Module:
    CALLED.append("model")
    return torch.nn.Linear(in_features, out_features)


def make_an_sgd(params, lr: float, **options) -> torch.optim.Optimizer:
    CALLED.append("optimizer")
    return torch.optim.SGD(params, lr=lr, **options)


def make_a_dataset() -> torch.utils.data.Dataset:
    raise AssertionError("the pre-check called a function target")


def test_the_pre_check_calls_no_function_target_and_the_run_builds_it(tmp_path):
    from conftest import train_in_process

    overrides = ["model._target_=test_config.make_a_linear_model", "optimizer._target_=test_config.make_an_sgd",
                 "trainer.max_steps=3", "data.num_samples=64"]
    CALLED.clear()
    validate(compose_config(overrides))
    assert CALLED == []  # a function may do anything when called: only the run calls it
    result = train_in_process(overrides, tmp_path / "run")
    assert CALLED == ["model", "optimizer"] and result.steps == 3


@pytest.mark.parametrize("args,line", [
    (["trainer.precision=fp8"], "error: trainer.precision='fp8' is not supported; use one of 32, bf16-mixed, 16-mixed"),
    (["strategy=ddp", "strategy.timeout_minutes=0"], "error: strategy.timeout_minutes=0 must be positive"),
    # Only the data knows this: refused as the run builds it, before its first step.
    (["trainer.batch_size=1000000", "trainer.drop_last=true"],
     "error: trainer.drop_last=true drops every batch: the training set has 10000 samples, too few for one batch of "
     "trainer.batch_size=1000000; set trainer.batch_size=10000 or lower, or trainer.drop_last=false (a step then "
     "trains on the whole set)"),
    # A function target is not called ahead (print would print); what it cannot take is said.
    (["scheduler._target_=builtins.print"],
     "error: scheduler._target_='builtins.print' takes no argument 'optimizer', which ringtrain passes it; "
     "point scheduler._target_ at a torch.optim.lr_scheduler.LRScheduler"),
])
def test_cli_bad_value_exits_2_with_one_line_before_any_work(tmp_path, args, line):
    proc = run_cli(args + [f"hydra.run.dir={tmp_path / 'run'}"])
    assert refused(proc) == line and proc.stdout.strip() == ""
    assert not (tmp_path / "run").exists(), "a mistake caught before work starts leaves nothing on disk"


def composition_refusal(args: list[str], capsys, task=lambda cfg: None) -> str:
    """train's Hydra app run in this process on `args` as its command line: the one line it
    exits 2 with. Composition mistakes never reach `task`."""
    from ringtrain.config import TRAIN, CommandLine, run_app

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sys, "argv", ["ringtrain", *args])
        with pytest.raises(SystemExit) as exit_info:
            run_app(TRAIN, task, CommandLine("ringtrain", list(args)))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize(
    "args,message",
    [
        (["trainer.bach_size=4"], "trainer.bach_size is not a setting of trainer; did you mean batch_size? known: accelerator,"),
        (["strategy.nproc_per_node=2"], "strategy.nproc_per_node is not a setting of this strategy; it belongs to "
                                        "strategy=ddp or strategy=fsdp: choose that option or drop the override"),
        (["model.d_model=64"], "model.d_model is not a setting of this model; it belongs to model=transformer"),
        (["model=transfomer"], "model=transfomer is not an option of model; choose one of hf_gpt2, linear, mlp, transformer "
                               "(did you mean transformer?)"),
        # One option of a list: Hydra names no options there, ringtrain lists the group's.
        (["callbacks=[default,early_stoping]"], "callbacks=early_stoping is not an option of callbacks; choose one of "
                                                "best_checkpoints, default, early_stopping,"),
        (["callbacks=[default,early_stoping]"], "(did you mean early_stopping?)"),
        (["logger=tensorbord"], "choose one of csv, mlflow, tensorboard, wandb (did you mean tensorboard?)"),
        (["logger=none"], "logger=none is not an option of logger; choose one of csv, mlflow, tensorboard, wandb; "
                          "~logger turns logging off"),
        (["model=small_cnn"], "choose one of hf_gpt2, linear, mlp, transformer; your own? put model/small_cnn.yaml in a "
                              "config folder and pass --config-dir <folder>"),
        (["optimiser.lr=0.1"], "optimiser is not a config group; did you mean optimizer? the groups are adapter, "
                               "callbacks, data,"),
        (["optimiser=adam"], "experiment, debug, hparams_search"),
        (["trainer.devices=2"], "trainer.devices is not a setting here; use strategy=ddp strategy.nproc_per_node=N"),
        (["trainer.fast_dev_run=true"], "use debug=fast_dev_run"),
        (["ckpt_path=x.pt"], "use trainer.resume=<path to last.pt>"),
        (["seed=42"], "seed is not a setting here; use trainer.seed"),
        (["model.widht=3"], "model.widht is not set by this model (ringtrain.models.linear.LinearRegression); to pass "
                            "a new argument write +model.widht=<value>"),
        # Any component's node says the same, a callback's too (its known keys may be none: a user's own callback).
        (["callbacks=[default,early_stopping]", "callbacks.early_stopping.patiense=3"],
         "callbacks.early_stopping.patiense is not set by callbacks.early_stopping (ringtrain.callbacks.early_stopping."
         "EarlyStopping); did you mean patience? to pass a new argument write +callbacks.early_stopping.patiense=<value>"),
        (["+trainer.seed=3"], "An item is already at 'trainer.seed'; Either remove + prefix"),
        (["optimizer.lr=0.1,0.2"], "'optimizer.lr=0.1,0.2' lists several values: add -m to sweep them"),
        (["optimizer.lr=["], "cannot read the override 'optimizer.lr=[' (no viable alternative at input '[')"),
        # A sweep's jobs are composed one at a time, as they run: the second model has no d_model.
        (["-m", "model=transformer,mlp", "model.d_model=64"], "model.d_model is not a setting of this model"),
        (["logger=null"], "logger=null cannot remove a group's option on the command line; write ~logger instead"),
    ],
)
def test_command_line_mistakes_are_one_line_from_hydras_own_exception(args, message, capsys, tmp_path):
    line = composition_refusal(args + [f"hydra.sweep.dir={tmp_path / 'sweep'}"], capsys)
    assert message in line


def test_valid_runs_and_sweeps_compose(tmp_path):
    from ringtrain.config import TRAIN, CommandLine, run_app

    composed = []
    for args in (["model=transformer", "model.d_model=64", "trainer.max_steps=5"],
                 ["-m", "optimizer.lr=1e-3,3e-3", "model=transformer", "model.d_model=64,128"]):
        with pytest.MonkeyPatch.context() as patch:
            argv = [*args, f"hydra.run.dir={tmp_path / 'run'}", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
            patch.setattr(sys, "argv", ["ringtrain", *argv])
            run_app(TRAIN, lambda cfg: composed.append((cfg.optimizer.lr, cfg.model.d_model)), CommandLine("ringtrain", argv))
    assert composed == [(0.01, 64), (1e-3, 64), (1e-3, 128), (3e-3, 64), (3e-3, 128)]


def test_cli_yaml_syntax_error_in_a_users_config_names_file_line_and_column(tmp_path):
    broken = tmp_path / "my_conf" / "model" / "broken.yaml"
    broken.parent.mkdir(parents=True)
    broken.write_text("# @package _global_\nmodel:\n  _target_: ringtrain.models.linear.LinearRegression\n  sizes: [1, 2\n")
    proc = run_cli(["--config-dir", str(tmp_path / "my_conf"), "model=broken", f"hydra.run.dir={tmp_path / 'run'}"],
                   cwd=tmp_path)
    assert refused(proc) == (
        f"error: {broken}, line 5, column 1: expected ',' or ']', but got '<stream end>' (while parsing a flow "
        f"sequence that starts at line 4, column 10); fix the YAML syntax there"
    )
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()


@pytest.fixture
def read_only_directory(tmp_path):
    """A directory nothing can be written in: a read-only tmpfs where mounting is allowed
    (root), else one without write permission (which root would ignore)."""
    directory = tmp_path / "read-only"
    directory.mkdir()
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(directory)],
                                 capture_output=True).returncode == 0
    except FileNotFoundError:
        mounted = False
    if mounted:
        yield directory
        subprocess.run(["umount", str(directory)], check=False)
    elif os.geteuid() == 0:
        pytest.skip("root without mount: no directory it cannot write in")
    else:
        directory.chmod(0o555)
        yield directory
        directory.chmod(0o755)


def test_cli_a_run_directory_that_cannot_be_made_is_one_line_before_any_work(tmp_path, read_only_directory, capsys):
    line = refused(run_cli([f"hydra.run.dir={read_only_directory / 'run'}"], cwd=tmp_path))
    assert line.startswith(f"error: the run directory {read_only_directory / 'run'} (hydra.run.dir) cannot be "
                           f"created: nothing can be written in {read_only_directory} ("), line
    assert list(read_only_directory.iterdir()) == [] and not (tmp_path / "outputs").exists()
    # In process: a path through a file (NotADirectoryError), a sweep's directory.
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    assert composition_refusal([f"hydra.run.dir={a_file / 'run'}"], capsys) == (
        f"error: the run directory {a_file / 'run'} (hydra.run.dir) cannot be created: {a_file} is a file, not a "
        f"directory; set hydra.run.dir to a directory you can write to")
    assert composition_refusal(["-m", "optimizer.lr=0.1,0.2", f"hydra.sweep.dir={a_file / 'sweep'}"], capsys) == (
        f"error: the sweep directory {a_file / 'sweep'} (hydra.sweep.dir) cannot be created: {a_file} is a file, "
        f"not a directory; set hydra.sweep.dir to a directory you can write to")


def test_cli_unknown_override_key_exits_2_with_one_line(tmp_path):
    proc = run_cli(["trainer.bach_size=4", f"hydra.run.dir={tmp_path}"])
    assert refused(proc).startswith("error: trainer.bach_size is not a setting of trainer")
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_cli_missing_text_file_names_the_fix(tmp_path):
    proc = run_cli(["model=transformer", "data=text", "data.path=missing.txt", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2
    assert "data.path='missing.txt' does not exist" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_cli_bad_checkpoint_fails_clearly_and_is_left_alone(tmp_path):
    bad = tmp_path / "last.pt"
    bad.write_bytes(b"not a checkpoint")
    proc = run_cli([f"trainer.resume={bad}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert proc.returncode == 2
    assert f"checkpoint '{bad}' is not a torch checkpoint file" in proc.stderr
    assert bad.read_bytes() == b"not a checkpoint"


def test_cli_never_overwrites_another_runs_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    assert run_cli(["trainer.max_steps=5", f"hydra.run.dir={run_dir}"]).returncode == 0
    before = (run_dir / "checkpoints" / "last.pt").read_bytes()
    # The run's record and log: a refused job adds nothing to them (no .hydra/ of its own).
    kept = {path: path.read_bytes() for path in [*(run_dir / ".hydra").iterdir(), run_dir / "train.log"]}
    # trainer.resume=null: a fresh run refuses a directory that holds checkpoints
    proc = run_cli(["trainer.max_steps=5", "trainer.resume=null", f"hydra.run.dir={run_dir}"])
    refused(proc, "already holds checkpoints and trainer.resume=null")
    # resume=auto (the default) continues only the same model
    proc = run_cli(["model=mlp", "data.num_features=8", f"hydra.run.dir={run_dir}"])
    refused(proc, "holds a run whose model._target_")
    assert (run_dir / "checkpoints" / "last.pt").read_bytes() == before
    assert {path: path.read_bytes() for path in kept} == kept and len(kept) == 4


def test_a_negative_setting_where_0_means_a_default_is_one_line_naming_what_0_does():
    from ringtrain.trainer import Trainer

    with pytest.raises(ConfigError, match=r"^trainer\.grad_clip_norm=-1\.0 must be >= 0 \(0: no clipping\)$"):
        Trainer(grad_clip_norm=-1.0)
