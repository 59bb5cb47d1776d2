"""Every file path the documentation, the configs' comments and the code's docstrings and
comments name exists: prose that points a reader at a file that is gone is a defect."""
from __future__ import annotations

import re
from pathlib import Path

from conftest import REPO

# A path as prose writes it: from the repository root, in the installed namespace
# (ringtrain/loop/fit.py is trainer/loop/fit.py), or inside trainer/ (loop/fit.py).
PATH = re.compile(r"(?<![\w./-])((?:ringtrain|trainer|data|models|conf|tests|benchmarks|docs|config|loop|checkpoints|"
                  r"strategies|tools|callbacks|loggers)/[\w./-]*\w\.(?:py|yaml|md|png|json))")
NAMESPACE = {"ringtrain/data/": "data/", "ringtrain/models/": "models/", "ringtrain/conf/": "conf/", "ringtrain/": "trainer/"}
INSIDE_TRAINER = ("config/", "loop/", "checkpoints/", "strategies/", "tools/", "callbacks/", "loggers/")
# Files a run or a user makes, named as examples (a user's project: my_conf/, shapes.py, ...),
# not files of this repository.
MADE_ELSEWHERE = re.compile(r"(^|/)(my_\w*|metrics|sweep_summary|config|hydra|overrides|hparams|summary|shapes|nets|"
                            r"tiny_gpt2|dict_rows|counter|numbers|mine)\b|^(data|conf)/(\*|train|val|[a-z_]+\.(jsonl|json|txt|csv|parquet))")


def _where(path: str) -> list[Path]:
    """Where a named path may live in the repository."""
    for prefix, folder in NAMESPACE.items():
        if path.startswith(prefix):
            return [REPO / (folder + path[len(prefix):])]
    candidates = [REPO / path]
    if path.startswith(INSIDE_TRAINER):
        candidates.append(REPO / "trainer" / path)
    return candidates


def _documents() -> list[Path]:
    # benchmarks/RESULTS.md is a log: each entry names the files of the code it measured then.
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    for folder in ("trainer", "data", "models", "conf", "benchmarks", "tests"):
        files += sorted((REPO / folder).rglob("*.py")) + sorted((REPO / folder).rglob("*.yaml"))
    return files + [REPO / "train.py", REPO / "pyproject.toml"]


def test_every_file_path_the_docs_and_docstrings_name_exists():
    missing = []
    for document in _documents():
        for number, line in enumerate(document.read_text().splitlines(), start=1):
            for path in PATH.findall(line):
                if MADE_ELSEWHERE.search(path) or any(place.exists() for place in _where(path)):
                    continue
                missing.append(f"{document.relative_to(REPO)}:{number} names {path}")
    assert missing == []
