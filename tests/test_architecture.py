"""docs/ARCHITECTURE.md's rules, held by the code: each package imports only the layers below
it, no module imports itself back through others, and modules and functions stay small."""
from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO

# docs/ARCHITECTURE.md "Packages and what each may import", from the bottom up.
LAYERS = {
    "ringtrain.errors": 0, "ringtrain.conf": 0,
    "ringtrain.distributed": 1, "ringtrain.components": 1,
    "ringtrain.storage": 2,
    "ringtrain.checkpoints": 3, "ringtrain.optim": 3,
    "ringtrain.data": 4, "ringtrain.models": 4, "ringtrain.strategies": 4, "ringtrain.loggers": 4,
    "ringtrain.callbacks": 4,
    "ringtrain.config": 5,
    "ringtrain.loop": 6,
    "ringtrain.run": 7,
    "ringtrain.trainer": 8,
    "ringtrain.tools": 9,
    "ringtrain.__main__": 10, "ringtrain": 10,
}
FOLDERS = {"trainer": "ringtrain", "data": "ringtrain.data", "models": "ringtrain.models", "conf": "ringtrain.conf"}
MAX_MODULE_LINES = 350
MAX_FUNCTION_LINES = 60
# Modules or functions over those sizes, each with the reason it is one piece.
SIZE_EXCEPTIONS: dict[str, str] = {
    "ringtrain.loop.fit.fit": "the loop, read top to bottom in one place: forward, backward, clip, step in sight, "
                              "as nanoGPT's train.py reads, then decide and act (at most MAX_FIT_LINES)",
}
MAX_FIT_LINES = 90
# The one function that decides what follows a step, and what only it may call: the schedules'
# `due` (Evaluator, CheckpointManager) and eval_every_minutes, the cross-rank agreement, the
# non-finite check.
DECISION = "ringtrain.loop.fit.StepEnds.decide"
DECIDING_CALLS = ("due", "time_is_up", "exchange", "check")


def _modules() -> dict[str, Path]:
    modules = {}
    for folder, package in FOLDERS.items():
        for path in sorted((REPO / folder).rglob("*.py")):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            name = ".".join((package, *parts)).removesuffix(".__init__")
            modules[name] = path
    return modules


def _imports(path: Path) -> set[str]:
    """Every ringtrain module `path` imports, at the top or inside a function; not what its
    `if __name__ == "__main__":` block imports to run as a program (`python -m ringtrain.tools.x`
    goes through the entry, ringtrain/__main__.py, as `ringtrain x` does)."""
    tree = ast.parse(path.read_text())
    tree.body = [node for node in tree.body if not (isinstance(node, ast.If) and "__main__" in ast.unparse(node.test))]
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ringtrain"):
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name.startswith("ringtrain"))
    return found


def _package(module: str) -> str:
    """The layer a module belongs to: the longest name in LAYERS that it starts with."""
    return max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)


def test_each_package_imports_only_the_layers_below_it():
    wrong = []
    for name, path in _modules().items():
        own = _package(name)
        for imported in _imports(path):
            other = _package(imported)
            if other != own and LAYERS[other] >= LAYERS[own]:
                wrong.append(f"{path.relative_to(REPO)} imports {imported} ({other} is not below {own})")
    assert wrong == []


def test_only_checkpoint_code_imports_the_checkpoints():
    """Data, configuration and loggers write files through ringtrain.storage; the checkpoints
    package is checkpoint code, not a file-utility floor."""
    wrong = [f"{path.relative_to(REPO)} imports {imported}" for name, path in _modules().items()
             if _package(name) in ("ringtrain.data", "ringtrain.config", "ringtrain.loggers")
             for imported in _imports(path) if _package(imported) == "ringtrain.checkpoints"]
    assert wrong == []


def test_no_module_imports_itself_back_through_others():
    modules = _modules()
    graph = {name: {m for m in _imports(path) if m in modules and m != name} for name, path in modules.items()}
    cycles, done = [], set()

    def visit(name: str, stack: list[str]) -> None:
        if name in stack:
            cycles.append(" -> ".join(stack[stack.index(name):] + [name]))
            return
        if name in done:
            return
        for imported in sorted(graph[name]):
            visit(imported, stack + [name])
        done.add(name)

    for name in sorted(graph):
        visit(name, [])
    assert cycles == []


def test_modules_and_functions_stay_small():
    too_big = []
    for name, path in _modules().items():
        source = path.read_text()
        if source.count("\n") > MAX_MODULE_LINES and name not in SIZE_EXCEPTIONS:
            too_big.append(f"{name}: {source.count(chr(10))} lines")
        for node in ast.walk(ast.parse(source)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                if length > MAX_FUNCTION_LINES and f"{name}.{node.name}" not in SIZE_EXCEPTIONS:
                    too_big.append(f"{name}.{node.name}: {length} lines")
    assert too_big == []


def test_the_only_top_level_import_name_is_ringtrain():
    """pyproject.toml maps every folder into the one package (docs/ARCHITECTURE.md's table)."""
    import tomllib

    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {package.split(".")[0] for package in setuptools["packages"]} == {"ringtrain"}
    assert setuptools["package-dir"] == {"ringtrain": "trainer", "ringtrain.models": "models",
                                         "ringtrain.data": "data", "ringtrain.conf": "conf"}


def test_only_the_entry_module_reads_the_command_line():
    """Hydra alone parses the command line: ringtrain/__main__.py reads sys.argv once and hands
    Hydra what it reads; no other module looks at it."""
    readers = sorted(str(path.relative_to(REPO)) for path in (REPO / "trainer").rglob("*.py")
                     if "sys.argv" in path.read_text())
    assert readers == ["trainer/__main__.py"]


def _calls(path: Path, names: tuple[str, ...]) -> dict[str, set[str]]:
    """name -> the functions (qualified in the module, nested ones by their outermost method)
    in which `<something>.name(...)` is called."""
    found: dict[str, set[str]] = {}

    def visit(node: ast.AST, where: list[str]) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = where + [node.name]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in names:
            found.setdefault(node.func.attr, set()).add(".".join(where[:2]))
        for child in ast.iter_child_nodes(node):
            visit(child, where)

    visit(ast.parse(path.read_text()), [])
    return found


def test_fit_reads_step_decide_act_and_one_function_decides():
    """Issue 36: `fit` is at most MAX_FIT_LINES lines, and what follows a step is decided only in
    DECISION: no other function of the loop or the callbacks asks a schedule whether it is due,
    agrees across ranks or checks for non-finite values (strategies' own `check` is config work)."""
    fit = next(node for node in ast.walk(ast.parse((REPO / "trainer/loop/fit.py").read_text()))
               if isinstance(node, ast.FunctionDef) and node.name == "fit")
    assert fit.end_lineno - fit.lineno + 1 <= MAX_FIT_LINES
    callers: dict[str, set[str]] = {}
    for name, path in _modules().items():
        if _package(name) in ("ringtrain.loop", "ringtrain.callbacks", "ringtrain.run", "ringtrain.trainer"):
            for call, where in _calls(path, DECIDING_CALLS).items():
                callers.setdefault(call, set()).update(f"{name}.{function}" for function in where)
    assert callers == {call: {DECISION} for call in DECIDING_CALLS}
