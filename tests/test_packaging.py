"""The wheel, built and installed as a user installs it (slow: `python -m pytest -m slow tests/test_packaging.py`).

The repository is copied to a temporary folder (so the build leaves nothing in the checkout)
and built with `pip wheel --no-deps --no-build-isolation`: no network, with this environment's
setuptools, which must satisfy pyproject's build requirement (setuptools>=77; the `test` extra
installs it). The wheel must hold the one import name `ringtrain`, every conf/**/*.yaml under
ringtrain/conf/, and build without setuptools' "Package would be ignored" warning.

It is then installed, NOT editable, into a fresh venv that sees this environment's dependencies
(torch, hydra, ...) but nothing of this environment's own ringtrain:

- `python -m venv --without-pip` makes the venv, and this environment's pip installs the wheel
  into it (`pip --python <venv python> install --no-deps --no-index`), so the `ringtrain`
  console script there runs the venv's interpreter;
- the dependencies come from a folder of symbolic links to every entry of this environment's
  site-packages except ringtrain's own (`ringtrain*`: the package or its dist-info) and the
  editable install's `__editable__*` files (its .pth and the finder that maps `ringtrain` to
  this checkout). A .pth file in the venv adds that folder with `site.addsitedir`, so the
  dependencies' own .pth files still work, and the editable finder is never there to load.

The default job is trained by the console script, by `python -m ringtrain`, and on 2 DDP ranks
by torchrun both with `-m ringtrain` and with `--no-python ringtrain`. Every command runs from
an empty temporary folder with PYTHONPATH unset, so neither the checkout nor the current
directory can supply ringtrain: a probe asserts `ringtrain.__file__` is in the venv and that
`data`, `models` and `trainer` do not import at all, and the training runs themselves run with
PYTHONVERBOSE=1, whose import trace must name the venv's ringtrain/__init__.py and no file of
this checkout's trainer/, models/, data/ or conf/.
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

LEARNED = re.compile(r"learned w=(\S+) b=(\S+)$")
SOURCE_DIRS = ("trainer", "models", "data", "conf")  # what the editable install maps ringtrain to
COMMANDS = {
    "console script": lambda venv: [str(venv / "bin" / "ringtrain")],
    "python -m": lambda venv: [str(venv / "bin" / "python"), "-m", "ringtrain"],
    "torchrun ddp": lambda venv: [str(venv / "bin" / "python"), "-m", "torch.distributed.run", "--standalone",
                                  "--nproc_per_node=2", "-m", "ringtrain", "strategy=ddp"],
    "torchrun --no-python ddp": lambda venv: [str(venv / "bin" / "python"), "-m", "torch.distributed.run",
                                              "--standalone", "--nproc_per_node=2", "--no-python",
                                              str(venv / "bin" / "ringtrain"), "strategy=ddp"],
}


def _setuptools_major() -> int:
    try:
        return int(importlib.metadata.version("setuptools").split(".")[0])
    except importlib.metadata.PackageNotFoundError:  # Python 3.12's venvs come without it
        return 0


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> tuple[Path, str]:
    """(the wheel, the build's verbose output), built from a copy of this checkout."""
    assert _setuptools_major() >= 77, (
        "pyproject.toml's build needs setuptools>=77 and --no-build-isolation uses this environment's "
        f"(the test extra brings it): {sys.executable} -m pip install 'setuptools>=77'")
    root = tmp_path_factory.mktemp("build")
    source = root / "src"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "outputs", "multirun", "__pycache__", ".pytest_cache",
        ".whl", "*.pt"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                           "-w", str(root / "wheels"), str(source)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    built, = (root / "wheels").glob("ringtrain-*.whl")
    return built, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh venv holding the installed wheel; the dependencies from this environment."""
    root = tmp_path_factory.mktemp("install")
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    proc = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index",
                           str(wheel[0])], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]

    deps = root / "deps"
    deps.mkdir()
    for site_packages in site.getsitepackages():
        for entry in Path(site_packages).iterdir():
            if entry.name.startswith(("ringtrain", "__editable__")) or (deps / entry.name).exists():
                continue
            (deps / entry.name).symlink_to(entry)
    venv_site = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    (venv_site / "zz_dependencies.pth").write_text(f"import site; site.addsitedir({str(deps)!r})\n")
    return venv


def _env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    return {**env, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra}


def _venv_site(venv: Path) -> Path:
    ringtrain, = venv.glob("lib/python*/site-packages/ringtrain")
    return ringtrain.parent


def test_the_wheel_builds_without_setuptools_ignoring_a_package(wheel):
    _, output = wheel
    assert "Package would be ignored" not in output and "absent from the `packages` configuration" not in output


def test_the_wheel_holds_one_import_name_and_every_config(wheel):
    with zipfile.ZipFile(wheel[0]) as archive:
        names = archive.namelist()
        top_level, = [name for name in names if name.endswith(".dist-info/top_level.txt")]
        assert archive.read(top_level).decode().split() == ["ringtrain"]
        entry_points, = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
        assert "ringtrain = ringtrain.__main__:main" in archive.read(entry_points).decode()
    assert {name.split("/")[0] for name in names if ".dist-info/" not in name} == {"ringtrain"}
    conf = REPO / "conf"
    configs = {f"ringtrain/conf/{path.relative_to(conf).as_posix()}" for path in conf.rglob("*.yaml")}
    assert "ringtrain/conf/train.yaml" in configs and len({Path(c).parent for c in configs}) >= 10  # the groups
    assert configs <= set(names), sorted(configs - set(names))
    for package in ("ringtrain/__main__.py", "ringtrain/models/__init__.py", "ringtrain/data/__init__.py",
                    "ringtrain/conf/__init__.py", "ringtrain/tools/train.py"):
        assert package in names, package


def test_the_install_imports_ringtrain_from_itself_and_no_data_models_or_trainer(venv, tmp_path):
    probe = ("import importlib.util as u, ringtrain, torch, hydra; print(ringtrain.__file__); "
             "print([u.find_spec(n) for n in ('data', 'models', 'trainer')])")
    proc = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, env=_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    file, specs = proc.stdout.splitlines()
    assert Path(file) == _venv_site(venv) / "ringtrain" / "__init__.py"
    assert specs == "[None, None, None]"


@pytest.mark.parametrize("command", list(COMMANDS))
def test_the_installed_ringtrain_trains_the_default_job_from_any_folder(venv, tmp_path, command):
    cwd, run_dir = tmp_path / "elsewhere", tmp_path / "run"
    cwd.mkdir()
    args = COMMANDS[command](venv) + ["trainer.progress_bar=false", f"hydra.run.dir={run_dir}"]
    proc = subprocess.run(args, cwd=cwd, env=_env(PYTHONVERBOSE="1"), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # The import trace: ringtrain from the venv, nothing from this checkout's sources.
    assert str(_venv_site(venv) / "ringtrain" / "__init__.py") in proc.stderr
    for folder in SOURCE_DIRS:
        assert f"{REPO / folder}{os.sep}" not in proc.stderr, folder
    last = (run_dir / "train.log").read_text().splitlines()[-3:]
    (w, b), = [LEARNED.search(line).groups() for line in last if LEARNED.search(line)]
    assert abs(float(w) - 2) < 0.05 and abs(float(b) - 3) < 0.05, last
