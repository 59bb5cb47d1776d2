"""Mistakes a user makes on the command line, each refused as they would meet it: one `error:`
line on stderr, exit status 2, and nothing left on disk (no run directory started, no file of
an earlier run changed). Every command is a real subprocess (`python -m ringtrain ...`).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from conftest import QUIET, run_cli, run_module, train_in_process
from helpers import corrupt_tensor_bytes, ok, refused

# A small MLP classifier run (8 features, hidden layer of 4).
MLP = ["model=mlp", "data.num_features=8", "data.num_samples=64", "data.num_val_samples=16",
       "model.hidden_sizes=[4]", "trainer.batch_size=16"]


def tree(root: Path) -> dict[str, bytes | None]:
    """Every file (its bytes) and folder (None) under `root`, dot files included."""
    return {str(path.relative_to(root)): path.read_bytes() if path.is_file() else None
            for path in sorted(root.rglob("*"))}


def train(args: list[str], cwd: Path | None = None):
    """Training as a user starts it: `python -m ringtrain ARGS`."""
    return run_module("ringtrain", [*args, *QUIET], cwd=cwd)


@pytest.fixture(scope="module")
def linear_run(tmp_path_factory) -> Path:
    """The run directory of a real two-step run of the default job (linear regression)."""
    run_dir = tmp_path_factory.mktemp("linear") / "run"
    train_in_process(["trainer.max_steps=2"], run_dir)
    return run_dir


@pytest.fixture(scope="module")
def mlp_run(tmp_path_factory) -> Path:
    """The run directory of a real two-step run of MLP, as the command line leaves it (its
    .hydra/ record and train.log too)."""
    run_dir = tmp_path_factory.mktemp("mlp") / "run"
    ok(run_cli(MLP + ["trainer.max_steps=2", f"hydra.run.dir={run_dir}"], cwd=run_dir.parent))
    assert (run_dir / "train.log").is_file() and (run_dir / ".hydra").is_dir()
    return run_dir


# --- 1. the user's own Dataset raises in its constructor ------------------------------------------

DATASET = '''
from torch.utils.data import Dataset


class Points(Dataset):
    """y = 2x + 1 at n points; n < 0 is the user's mistake."""

    def __init__(self, n: int = 64):
        if n == -1:
            raise ValueError(f"n must be >= 0, got {n}")
        if n == -2:
            raise RuntimeError(f"cannot make {n} points")
        self.x = torch.linspace(-1, 1, n).unsqueeze(1)
        self.y = 2 * self.x + 1

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]
'''

POINTS = '''
# @package _global_
data:
  train:
    _target_: mypoints.sets.Points
    n: 64
  val:
    _target_: mypoints.sets.Points
    n: 16
  dims: {in_features: 1, out_features: 1}
'''


@pytest.mark.parametrize("n, error", [
    (-1, "n must be >= 0, got -1"),  # a ValueError: the user's mistake in an argument
    pytest.param(-2, "RuntimeError: cannot make -2 points", marks=pytest.mark.slow),
])
def test_a_users_dataset_raising_in_its_constructor_is_one_line_and_no_run_directory(tmp_path, n, error):
    project = tmp_path / "project"
    (project / "mypoints").mkdir(parents=True)
    (project / "mypoints" / "__init__.py").write_text("")
    (project / "mypoints" / "sets.py").write_text(DATASET)
    (project / "conf" / "data").mkdir(parents=True)
    (project / "conf" / "data" / "points.yaml").write_text(POINTS)
    before = tree(project)

    proc = train(["--config-dir", "conf", "data=points", f"data.train.n={n}"], cwd=project)
    refused(proc, "mypoints.sets.Points", error)
    # No run directory (outputs/runs/<stamp>, nor outputs/); the project as it was but Python's caches.
    assert {k: v for k, v in tree(project).items() if "__pycache__" not in k} == before


# --- 2. a prompt with a comma ---------------------------------------------------------------------


def test_a_prompt_with_a_comma_says_to_quote_it(linear_run):
    checkpoint = linear_run / "checkpoints" / "last.pt"
    line = refused(run_module("ringtrain", ["sample", "prompt=Hello, world", f"checkpoint={checkpoint}"]))
    # The fix for one text with a comma is quoting it for Hydra; -m (a sweep) is the other reading.
    assert "quote" in line, line
    assert """"prompt='Hello, world'\"""" in line, line


# --- 3. a model target that is a function, not a module -------------------------------------------


def test_a_model_target_that_returns_a_tensor_is_one_sensible_line(tmp_path):
    line = refused(train(["model._target_=torch.nn.functional.relu", f"hydra.run.dir={tmp_path / 'run'}"],
                         cwd=tmp_path))
    assert "model._target_='torch.nn.functional.relu'" in line, line
    assert "not a torch.nn.Module; point model._target_ at one" in line, line
    assert "scheduler" not in line, line  # about the model, not what is built after it
    assert not (tmp_path / "run").exists()
    assert not (tmp_path / "outputs").exists()


# --- 4. export to a path through a file -----------------------------------------------------------


def test_export_to_a_path_through_a_file_is_one_line(tmp_path, linear_run):
    run_dir = tmp_path / "run"
    shutil.copytree(linear_run, run_dir)
    (tmp_path / "a-file").write_text("mine")
    before = tree(tmp_path)
    line = refused(run_module("ringtrain", ["export", f"checkpoint={run_dir / 'checkpoints' / 'last.pt'}",
                                            f"output={tmp_path / 'a-file' / 'x.safetensors'}"], cwd=tmp_path))
    assert f"{tmp_path / 'a-file'}, which is a file" in line, line
    assert tree(tmp_path) == before


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="needs Linux's /proc, where nothing can be created")
def test_export_to_a_path_that_cannot_be_written_is_one_line(tmp_path, linear_run):
    before = tree(tmp_path)
    line = refused(run_module("ringtrain", ["export", f"checkpoint={linear_run / 'checkpoints' / 'last.pt'}",
                                            "output=/proc/nope/x.safetensors"], cwd=tmp_path))
    assert line == ("error: output=/proc/nope/x.safetensors cannot be written: nothing can be created in /proc "
                    "(No such file or directory); choose an output in a folder you can write to")
    assert tree(tmp_path) == before and not Path("/proc/nope").exists()


# --- 5. init_from: another model's checkpoint -----------------------------------------------------


@pytest.mark.parametrize("where", ["default", pytest.param("given", marks=pytest.mark.slow)])
def test_init_from_another_models_checkpoint_is_one_line_and_the_run_directory_is_gone(tmp_path, mlp_run, where):
    """The default linear model from an MLP's last.pt. `default`: the run directory would be
    outputs/runs/<stamp> under the current directory; `given`: hydra.run.dir."""
    source = mlp_run / "checkpoints" / "last.pt"
    before = source.read_bytes()
    run_dir = [f"hydra.run.dir={tmp_path / 'run'}"] if where == "given" else []
    line = refused(train([f"trainer.init_from={source}", *run_dir], cwd=tmp_path))
    assert f"trainer.init_from={source}" in line and "layers.0.weight" in line, line
    assert list(tmp_path.iterdir()) == [], "the refused run left its directory (.hydra/, .lock, train.log)"
    assert source.read_bytes() == before


# --- 6. trainer.resume: a truncated checkpoint, a checkpoint of another size -----------------------


def _truncate(path: Path) -> None:
    with open(path, "r+b") as file:
        file.truncate(os.path.getsize(path) // 2)


@pytest.mark.parametrize("damage, into", [
    ("truncated", "own"),
    pytest.param("truncated", "new", marks=pytest.mark.slow),
    ("changed bytes", "own"),
    ("other size", "own"),
    ("other size", "new"),
])
def test_resume_from_an_unusable_checkpoint_is_one_line_and_leaves_everything_as_it_was(tmp_path, mlp_run, damage,
                                                                                          into):
    """`own`: trainer.resume=<file> alone, the run continues in the checkpoint's run directory;
    `new`: with hydra.run.dir=<a directory that does not exist>. `changed bytes`: bytes inside
    a tensor record, its length and zip intact (torch.load would return them). `other size`: the
    MLP's checkpoint with data of 16 features (its first layer has 8)."""
    run_dir = tmp_path / "run"
    shutil.copytree(mlp_run, run_dir)
    last = run_dir / "checkpoints" / "last.pt"
    args = [f"trainer.resume={last}"]
    if damage == "truncated":
        _truncate(last)
        phrases = [f"checkpoint '{last}' is truncated or corrupt"]
    elif damage == "changed bytes":
        phrases = [f"checkpoint '{last}' is corrupt: its record {corrupt_tensor_bytes(last)} does not match its checksum"]
    else:
        args.append("data.num_features=16")
        phrases = [f"checkpoint '{last}' does not fit this model", "size mismatch for layers.0.weight"]
    if into == "new":
        args.append(f"hydra.run.dir={tmp_path / 'new'}")
    before = tree(tmp_path)
    refused(train(args, cwd=tmp_path), *phrases)
    assert not (tmp_path / "new").exists() and not (tmp_path / "outputs").exists()
    after = tree(tmp_path)
    assert after.keys() == before.keys(), set(after) ^ set(before)
    changed = [name for name in before if after[name] != before[name]]
    assert not changed, f"the refused run changed {changed}"


# --- 7. a run directory that holds another model's run --------------------------------------------


def test_a_run_directory_of_another_models_run_is_refused_and_left_byte_identical(tmp_path):
    run_dir = tmp_path / "run"
    ok(run_cli(["trainer.max_steps=2", f"hydra.run.dir={run_dir}"], cwd=tmp_path))
    before = tree(run_dir)
    assert {".lock", ".hydra/config.yaml", "train.log", "checkpoints/last.pt"} <= before.keys()

    line = refused(train(["model=mlp", "data.num_features=8", f"hydra.run.dir={run_dir}"], cwd=tmp_path))
    assert f"{run_dir} holds a run whose model._target_" in line, line
    assert "'ringtrain.models.linear.LinearRegression' -> 'ringtrain.models.mlp.MLPClassifier'" in line, line
    after = tree(run_dir)
    assert after.keys() == before.keys(), set(after) ^ set(before)
    assert [name for name in before if after[name] != before[name]] == []


# --- 8. model=hf_gpt2 without transformers --------------------------------------------------------


def test_a_hugging_face_model_without_transformers_names_the_extra(tmp_path):
    text = tmp_path / "tiny.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 100)
    argv = ["ringtrain", "model=hf_gpt2", f"data.path={text}", f"hydra.run.dir={tmp_path / 'run'}", *QUIET]
    # transformers cannot be imported (None in sys.modules: `import transformers` raises ImportError).
    script = textwrap.dedent(f"""
        import sys
        sys.modules["transformers"] = None
        sys.argv = {argv!r}
        from ringtrain.__main__ import main
        main()
    """)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    line = refused(proc, "pip install 'ringtrain[hf]'")
    assert "transformers" in line, line
    assert not (tmp_path / "run").exists() and not (tmp_path / "outputs").exists()


# --- 9. logger settings that cannot work ----------------------------------------------------------

BROKEN_WANDB = 'raise ImportError("cannot import name \'Settings\' from \'wandb.sdk\' (simulated)")\n'


@pytest.mark.parametrize("args, broken, phrases", [
    (["logger=mlflow", "logger.mlflow.tracking_uri=bogus://x"], False,
     ["logger.mlflow.tracking_uri='bogus://x' cannot be used", "tracking server's http(s):// URI"]),
    (["logger=wandb", "logger.wandb.mode=online"], False,
     ["logger.wandb.mode=online needs a W&B API key", "WANDB_API_KEY", "logger.wandb.mode=offline"]),
    # Installed but broken (a dependency of another version): its ImportError, not a missing extra.
    (["logger=wandb"], True, ["logger.wandb: wandb is installed but importing it failed (ImportError: cannot import name",
                        "pip install --force-reinstall 'ringtrain[wandb]'"]),
], ids=["mlflow-uri", "wandb-online-without-a-key", "installed-but-broken"])
def test_a_logger_that_cannot_work_is_refused_before_training_and_leaves_nothing(tmp_path, monkeypatch, args, broken,
                                                                                  phrases):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no ~/.netrc, no W&B settings
    (tmp_path / "home").mkdir()
    if broken:
        (tmp_path / "wandb").mkdir()  # found first: `python -m` puts the working directory first on sys.path
        (tmp_path / "wandb" / "__init__.py").write_text(BROKEN_WANDB)
    before = tree(tmp_path)
    refused(train([*args, "trainer.max_steps=2"], cwd=tmp_path), *phrases)
    assert {k: v for k, v in tree(tmp_path).items() if "__pycache__" not in k} == before  # no outputs/, no run


# --- 10. adapter=lora without target_modules ------------------------------------------------------


def test_lora_without_target_modules_lists_the_models_layer_names(tmp_path):
    line = refused(train(["model=transformer", "model.n_layers=1", "adapter=lora", "trainer.max_steps=1"], cwd=tmp_path))
    assert line.startswith("error: LoRA needs target_modules (adapter.target_modules), the layers of Transformer to "
                           "adapt; its Linear/Conv1D layers are named qkv, proj, fc_in, fc_out, lm_head"), line
    assert list(tmp_path.iterdir()) == []  # no outputs/


# --- 11. resuming LoRA with another adapter.r ----------------------------------------------------


@pytest.mark.slow
def test_resuming_lora_with_another_rank_names_the_stored_adapter_r(tmp_path):
    lora = ["model=transformer", "model.n_layers=1", "adapter=lora", "adapter.target_modules=[qkv]",
            f"hydra.run.dir={tmp_path / 'run'}"]
    ok(train([*lora, "adapter.r=2", "trainer.max_steps=2"], cwd=tmp_path))
    before = tree(tmp_path)
    line = refused(train([*lora, "adapter.r=4", "trainer.max_steps=4", "trainer.resume=auto"], cwd=tmp_path))
    assert line == (f"error: checkpoint '{tmp_path / 'run' / 'checkpoints' / 'last.pt'}' holds adapters trained with "
                    f"adapter.r=2 (blocks.0.attn.qkv.lora_A.weight is [2, 128] there, [4, 128] here); resume with "
                    f"adapter.r=2")
    assert tree(tmp_path) == before
