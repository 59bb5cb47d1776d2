"""The README's Python API example, run as a user runs it: docs/python_api_example.py, in one
process and on 2 spawned DDP ranks, learns y = 2x + 3, and both ways reach the same weights."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, assert_same_weights, checkpoint_weights
from ringtrain.errors import ConfigError

EXAMPLE = REPO / "docs" / "python_api_example.py"
LEARNED = re.compile(r"^learned w=(\S+) b=(\S+)$", re.MULTILINE)


def _run_example(cwd: Path, *flags: str) -> tuple[float, float, Path]:
    """(w, b) the script prints, and the run directory it wrote under cwd/outputs/runs."""
    cwd.mkdir()
    # ringtrain from its install alone: the clone's folders are not on the path, as for a user.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, str(EXAMPLE), *flags], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (w, b), = LEARNED.findall(proc.stdout)
    run_dir, = (cwd / "outputs" / "runs").iterdir()
    return float(w), float(b), run_dir


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[float, float, Path]]:
    root = tmp_path_factory.mktemp("api")
    return {"single": _run_example(root / "single"), "ddp": _run_example(root / "ddp", "--ddp")}


def test_the_example_is_short():
    assert len(EXAMPLE.read_text().splitlines()) <= 30


@pytest.mark.parametrize("mode", ["single", "ddp"])
def test_the_example_learns_the_line(runs, mode):
    w, b, _ = runs[mode]
    assert abs(w - 2) < 0.02 and abs(b - 3) < 0.02, (w, b)


def test_two_spawned_ranks_reach_the_weights_of_one_process(runs):
    (w1, b1, single), (w2, b2, ddp) = runs["single"], runs["ddp"]
    assert abs(w1 - w2) <= 1e-5 and abs(b1 - b2) <= 1e-5  # what fit() left in the caller's model
    assert_same_weights(checkpoint_weights(single), checkpoint_weights(ddp), atol=1e-5)


def test_a_misspelt_setting_is_a_config_error_naming_the_setting():
    from ringtrain import Trainer

    with pytest.raises(ConfigError, match="did you mean max_steps"):
        Trainer(max_step=3)


def test_the_readme_shows_the_example_verbatim():
    readme = (REPO / "README.md").read_text()
    if "python_api_example.py" not in readme:
        pytest.skip("README.md does not include docs/python_api_example.py yet")
    assert EXAMPLE.read_text().strip() in readme


FSDP_SCRIPT = '''
import sys

import torch
from torch.utils.data import TensorDataset

sys.path.insert(0, {docs!r})
from python_api_example import Line
from ringtrain import Trainer
from ringtrain.data.tasks import RegressionTask

if __name__ == "__main__":
    torch.manual_seed(0)  # the example's data, its settings for 2 ranks, strategy=fsdp
    x = torch.randn(2048, 1)
    y = 2 * x + 3 + 0.1 * torch.randn(2048, 1)
    trainer = Trainer(max_epochs=4, batch_size=16, optimizer={{"_target_": "torch.optim.SGD", "lr": 0.1}},
                      strategy={{"name": "fsdp", "nproc_per_node": 2, "state_dict_type": sys.argv[1]}},
                      progress_bar=False)
    model = Line()
    trainer.fit(model, TensorDataset(x[:1792], y[:1792]), TensorDataset(x[1792:], y[1792:]), task=RegressionTask())
    print(f"learned w={{model.linear.weight.item():.6f}} b={{model.linear.bias.item():.6f}}")
'''


@pytest.mark.parametrize("state_dict_type", [pytest.param("full", marks=pytest.mark.slow), pytest.param("sharded", marks=pytest.mark.slow)])
def test_fsdp_on_spawned_ranks_hands_the_trained_weights_back_to_the_callers_model(runs, tmp_path, state_dict_type):
    """Under fsdp each rank holds only its shards: the weights are gathered before the ranks end."""
    script = tmp_path / "fsdp_api.py"
    script.write_text(FSDP_SCRIPT.format(docs=str(REPO / "docs")))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(script), state_dict_type], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (w, b), = LEARNED.findall(proc.stdout)
    w1, b1, _ = runs["single"]
    assert abs(float(w) - w1) <= 1e-5 and abs(float(b) - b1) <= 1e-5


# --- a run from Python never continues another unless asked (issue 30) -------------------------


def _line_data(n: int = 64):
    from torch.utils.data import TensorDataset
    import torch

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, generator=generator)
    return TensorDataset(x, 2 * x + 3)


def test_fits_made_in_the_same_second_are_runs_of_their_own(tmp_path, monkeypatch):
    """A learning-rate loop: three Trainers made and fitted at once train three runs in three
    directories (a shared, time-named directory made the second and third resume the first's
    last.pt, train nothing and return the first's result)."""
    import torch
    from torch import nn

    from ringtrain import Trainer
    from ringtrain.data.tasks import RegressionTask

    monkeypatch.chdir(tmp_path)
    results, weights = [], []
    for lr in (0.01, 0.05, 0.1):
        torch.manual_seed(0)
        model = nn.Linear(1, 1)
        trainer = Trainer(max_steps=5, batch_size=8, progress_bar=False, optimizer={"_target_": "torch.optim.SGD", "lr": lr})
        results.append(trainer.fit(model, _line_data(), _line_data(16), task=RegressionTask()))
        weights.append(model.weight.item())
    assert [r.steps for r in results] == [5, 5, 5]
    assert len(set(weights)) == 3 and len({r.metrics["val/loss"] for r in results}) == 3
    assert len(list((tmp_path / "outputs" / "runs").iterdir())) == 3


def test_a_trainer_reused_for_another_model_trains_it_afresh_and_resuming_is_asked_for(tmp_path, monkeypatch):
    import torch
    from torch import nn

    from ringtrain import Trainer
    from ringtrain.data.tasks import RegressionTask

    monkeypatch.chdir(tmp_path)
    trainer = Trainer(max_steps=4, batch_size=8, progress_bar=False)
    for model in (nn.Linear(1, 1), nn.Linear(1, 1)):  # the second is not the first's run resumed
        start = model.weight.detach().clone()
        assert trainer.fit(model, _line_data(), _line_data(16), task=RegressionTask()).steps == 4
        assert not torch.equal(model.weight, start)
    assert len(list((tmp_path / "outputs" / "runs").iterdir())) == 2
    # Asked for: the same directory, continued from its last.pt.
    run_dir = tmp_path / "run"
    Trainer(run_dir, max_steps=4, batch_size=8, progress_bar=False).fit(nn.Linear(1, 1), _line_data(), _line_data(16),
                                                                        task=RegressionTask())
    with pytest.raises(Exception, match="already holds checkpoints and trainer.resume=null"):
        Trainer(run_dir, max_steps=8, batch_size=8, progress_bar=False).fit(
            nn.Linear(1, 1), _line_data(), _line_data(16), task=RegressionTask())
    continued = Trainer(run_dir, max_steps=8, batch_size=8, progress_bar=False, resume="auto").fit(
        nn.Linear(1, 1), _line_data(), _line_data(16), task=RegressionTask())
    assert continued.steps == 8
    assert torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)["progress"]["step"] == 8


def test_a_model_whose_own_child_is_called_module_resumes_whole(tmp_path):
    """A user's model may name a child `module` (a wrapper of their own): it is saved and
    restored as the model it is, not taken for DDP's or DataParallel's wrapper."""
    import torch
    from torch import nn

    from ringtrain import Trainer
    from ringtrain.data.tasks import RegressionTask

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.module, self.scale = nn.Linear(1, 1), nn.Parameter(torch.ones(1))

        def forward(self, x):
            return self.module(x) * self.scale

    def fit(run_dir, steps, resume=None):
        torch.manual_seed(0)
        model = Scaled()
        Trainer(run_dir, max_steps=steps, batch_size=8, progress_bar=False, resume=resume).fit(
            model, _line_data(), _line_data(16), task=RegressionTask())
        return model.state_dict()

    straight = fit(tmp_path / "straight", 8)
    fit(tmp_path / "resumed", 4)
    resumed = fit(tmp_path / "resumed", 8, resume="auto")
    assert set(resumed) == {"module.weight", "module.bias", "scale"}
    assert all(torch.equal(straight[name], resumed[name]) for name in straight)
