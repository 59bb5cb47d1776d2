"""Components from `_target_` nodes (every model, data set, task, optimizer, scheduler, strategy,
callback and logger, ringtrain's or a user's): `check` holds a node against its target's
signature, each mistake one line naming the key and the fix; `build` is Hydra's instantiate
(or, for a node of plain arguments, what it does with one).
"""
from __future__ import annotations

import copy
import difflib
import importlib
import inspect
import types
import typing
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ringtrain.errors import ConfigError

# Keys Hydra's instantiate reads itself; they are never arguments of the target.
HYDRA_KEYS = ("_target_", "_args_", "_partial_", "_convert_", "_recursive_")
# The optional libraries ringtrain's extras install (pyproject.toml), by import name.
EXTRAS = {"transformers": "hf", "datasets": "hf", "tokenizers": "hf", "safetensors": "hf", "peft": "peft",
          "torchvision": "vision", "timm": "vision", "wandb": "wandb", "mlflow": "mlflow", "optuna": "sweep"}


def locate(path: Any, key: str) -> Callable:
    if not isinstance(path, str) or not path or path.startswith(".") or path.endswith("."):
        raise ConfigError(f"{key}._target_={path!r} is not an import path; write e.g. my_pkg.nets.MyNet")
    parts = path.split(".")
    for found in range(len(parts), 0, -1):  # the longest prefix that is a module
        name = ".".join(parts[:found])
        try:
            module = importlib.import_module(name)
            break
        except ModuleNotFoundError as err:
            if err.name is not None and not name.startswith(err.name):
                # The module exists but something it imports does not: the user's code needs fixing.
                extra = EXTRAS.get(err.name.split(".")[0])
                fix = f"pip install 'ringtrain[{extra}]'" if extra else "install or fix that import"
                raise ConfigError(f"{key}._target_={path!r}: importing {name} failed ({err}); {fix}") from None
        except Exception as err:  # the module exists and raised while importing
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ConfigError(f"{key}._target_={path!r}: importing {name} raised {type(err).__name__}: {first}") from None
    else:  # no prefix is a module
        if extra := EXTRAS.get(parts[0]):
            raise ConfigError(f"{key}._target_={path!r} needs {parts[0]}, which is not installed: "
                              f"pip install 'ringtrain[{extra}]'")
        raise ConfigError(f"{key}._target_={path!r}: no module named {parts[0]!r}; check the spelling, and that it is "
                          f"importable from where you run (the current directory, PYTHONPATH or pip install)")
    obj: Any = module
    for depth, attribute in enumerate(parts[found:], start=found):
        if not hasattr(obj, attribute):
            owner = ".".join(parts[:depth])
            names = [n for n in dir(obj) if not n.startswith("_")]
            close = difflib.get_close_matches(attribute, names, n=3)
            if isinstance(obj, types.ModuleType) and depth == found and "." not in path[len(owner) + 1:] and not close:
                # torch.optim.Lion, the last name missing and nothing close: a module or a class this version lacks.
                raise ConfigError(f"{key}._target_={path!r}: {owner} has no module or attribute {attribute!r}; "
                                  f"check the spelling (it has {', '.join(names[:12]) or 'nothing public'})")
            hint = f"did you mean {' or '.join(close)}?" if close else f"it has {', '.join(names[:12]) or 'nothing public'}"
            raise ConfigError(f"{key}._target_={path!r}: {owner} has no attribute {attribute!r}; {hint}")
        obj = getattr(obj, attribute)
    if not callable(obj):
        raise ConfigError(f"{key}._target_={path!r} is not a class or function; point it at one")
    return obj


def accepts(target: Any, name: str) -> bool:
    parameters = parameters_of(target)
    return parameters is not None and (name in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values()))


def check(node: Any, key: str, kind: type | None = None, provided: Iterable[str] | None = (),
          reserved: Iterable[str] = (), provided_by: str = "", passed: Iterable[str] = ()) -> Callable:
    """`kind`: what the target must build (a class is checked now, a function by `check_built`
    once it has run: it is never called here). `provided`: arguments ringtrain fills by name
    (None: not known yet, a missing one is left to the build), filled by `provided_by` (named
    in the message). `reserved`: ringtrain's own keys, not passed on. `passed`: arguments
    ringtrain always passes by name, so the target must take them.
    """
    if not isinstance(node, Mapping) or "_target_" not in node:
        raise ConfigError(f"{key} has no _target_; give the class to build, e.g. {key}._target_=my_pkg.MyThing")
    target = locate(node["_target_"], key)
    _check_kind(node, key, target, kind)
    parameters = parameters_of(target)
    if parameters is None or node.get("_partial_"):
        return target  # a builtin without a signature, or a partial that gets the rest later
    takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
    for name in passed:
        if name not in parameters and not takes_any:  # `passed` comes with a `kind` (schema.py check_optimization)
            raise ConfigError(f"{key}._target_={node['_target_']!r} takes no argument {name!r}, which ringtrain passes "
                              f"it; point {key}._target_ at a {_public_name(kind)}")
    unknown_provided = provided is None
    provided, reserved = set(provided or ()), set(reserved)
    arguments = {k: v for k, v in node.items() if k not in HYDRA_KEYS and k not in reserved}
    named = {n: p for n, p in parameters.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    unnamed = [name for name in arguments if name not in named]
    for name in unnamed:
        _check_unnamed(node, key, target, name, named, takes_any, provided, unnamed)
    positional = len(node.get("_args_") or ())
    for index, (name, parameter) in enumerate(named.items()):
        required = parameter.default is inspect.Parameter.empty
        if required and index >= positional and name not in arguments and name not in provided and not unknown_provided:
            source = f"{provided_by} does not give it and " if provided_by else ""
            raise ConfigError(f"{key}.{name} is required by {node['_target_']}, {source}the config does not set it; "
                              f"add +{key}.{name}=<value>{' or pick data that gives it' if provided_by else ''}")
    hints = _type_hints(target)
    for name, value in arguments.items():
        annotation = hints.get(name)
        if annotation is not None and not fits(value, annotation):
            shown = getattr(annotation, "__name__", None) if not typing.get_args(annotation) else str(annotation).replace("typing.", "")
            raise ConfigError(f"{key}.{name}={value!r} does not fit {node['_target_']}'s annotation "
                              f"{shown}; pass a value of that type")
    return target


def _check_kind(node: Mapping, key: str, target: Callable, kind: Any) -> None:
    """The kind a class target is, or a function target returns where it says so (it is not
    called to find out: calling may do anything)."""
    returns = None if kind is None or inspect.isclass(target) else _type_hints(target).get("return")
    if kind is not None and inspect.isclass(target) and not issubclass(target, kind):
        # The most general base the user would name: a Dataset's MRO ends in typing.Generic,
        # which says nothing about what the class is.
        bases = [b for b in target.__mro__[1:] if b not in (object, typing.Generic)]
        what = f"is a {target.__qualname__}" + (f" (a {_public_name(bases[-1])})" if bases else "")
    elif inspect.isclass(returns) and not issubclass(returns, kind):
        what = f"returns a {_public_name(returns)}"
    else:
        return
    raise ConfigError(f"{key}._target_={node['_target_']!r} {what}, not a {_public_name(kind)}; point {key}._target_ at one")


def _check_unnamed(node: Mapping, key: str, target: Callable, name: str, named: Mapping, takes_any: bool,
                   provided: set[str], unnamed: list[str]) -> None:
    """An argument the target does not name: refused, unless a **kwargs catch-all takes it
    (where a typo may still show against what the target builds). One a shipped preset of the
    group sets (`optimizer._target_=torch.optim.RMSprop` over sgd's nesterov) is the preset's
    leftover, not a typo: the fix removes it, with every other such leftover in one go."""
    if takes_any:
        _check_forwarded(node, key, target, name)
        return
    from ringtrain.conf import options_defining

    leftovers = [n for n in unnamed if options_defining(key, n)]
    close = difflib.get_close_matches(name, list(named), n=1)
    if name in leftovers:
        others = [n for n in leftovers if n != name]
        also, them = (f" (and {', '.join(others)})", "them") if others else ("", "it")
        hint = f"the {key} preset set it{also}: remove {them} with {' '.join(f'~{key}.{n}' for n in leftovers)}; "
    else:
        hint = f"did you mean {key}.{close[0]}? " if close else ""
    raise ConfigError(f"{key}.{name}: {node['_target_']} takes no argument {name!r}; {hint}"
                      f"its arguments are {', '.join(n for n in named if n not in provided) or 'none'}")


def _check_forwarded(node: Mapping, key: str, target: Callable, name: str) -> None:
    """A key a `**kwargs` catch-all takes: where the target says what it builds (a factory
    annotated `-> ResNet`, as torchvision's are) and that class names its arguments, a key close
    to one of them but not one (`num_clases`) is a typo, refused now. A key like no argument at
    all is left alone: the factory may use it itself."""
    built = None if inspect.isclass(target) else _type_hints(target).get("return")
    if not inspect.isclass(built):
        return
    parameters = parameters_of(built)
    if parameters is None or any(p.kind is p.VAR_KEYWORD for p in parameters.values()) or name in parameters:
        return
    close = difflib.get_close_matches(name, [n for n in parameters if n != "self"], n=1, cutoff=0.8)
    if close:
        raise ConfigError(
            f"{key}.{name}: {node['_target_']} passes it on to {built.__qualname__}, which takes no argument "
            f"{name!r}; did you mean {key}.{close[0]}?"
        )


def check_built(obj: Any, key: str, kind: type) -> Any:
    if not isinstance(obj, kind):
        raise ConfigError(
            f"{key}._target_ built a {type(obj).__name__}, not a {_public_name(kind)}; point {key}._target_ at one"
        )
    return obj


def build(node: Mapping, key: str, **filled: Any) -> Any:
    """`instantiate(node, **filled)` with plain lists and dicts; argument errors -> ConfigError.

    A node of plain arguments (no other key of Hydra's, no `_target_` nested in it: every stock
    option of the default job) is its target called with a copy of them, which is what
    instantiate does with it: Hydra's OmegaConf round trip costs ~2 ms a node, most of
    ringtrain's start-up above Hydra's own (benchmarks/bench_process.py)."""
    from hydra.errors import InstantiationException
    from hydra.utils import instantiate

    try:
        if not any(name in node for name in HYDRA_KEYS[1:]) and not _holds_a_node(list(node.values())):
            arguments = copy.deepcopy({name: value for name, value in node.items() if name != "_target_"})
            return locate(node["_target_"], key)(**arguments, **filled)
        return instantiate(dict(node), _convert_="all", **filled)
    except (InstantiationException, ValueError) as err:
        cause = err.__cause__ if isinstance(err, InstantiationException) else err
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, ValueError):  # the target's own check of its arguments
            message = " ".join(str(cause).split()) or type(cause).__name__
            if f"{key}." not in message:  # a message of torch's, say: name the node and the fix
                message = f"{key} ({node.get('_target_')}): {message}; fix the {key} arguments"
            raise ConfigError(message) from None
        raise


def _holds_a_node(value: Any) -> bool:
    if isinstance(value, Mapping):
        return "_target_" in value or _holds_a_node(list(value.values()))
    return isinstance(value, (list, tuple)) and any(_holds_a_node(item) for item in value)


def is_node(value: Any) -> bool:
    return isinstance(value, Mapping) and "_target_" in value


def parameters_of(target: Any) -> Mapping[str, inspect.Parameter] | None:
    try:
        return inspect.signature(target).parameters
    except (TypeError, ValueError):
        return None


def _type_hints(target: Any) -> dict[str, Any]:
    function = target.__init__ if inspect.isclass(target) else target
    try:
        return typing.get_type_hints(function)
    except Exception:  # annotations naming what cannot be imported here: nothing to check
        return {}


def fits(value: Any, annotation: Any) -> bool:
    """Whether a config value (plain data, or a nested `_target_` node) can be `annotation`."""
    if is_node(value) or annotation is Any or annotation is inspect.Parameter.empty:
        return True
    if isinstance(value, str) and value.startswith("${data.dims."):
        return True  # the data's size, filled when the model is built (config/builders.py)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(fits(value, a) for a in args)
    if origin is typing.Literal:
        return value in args
    if annotation is type(None):
        return value is None
    if annotation in (int, float) and isinstance(value, bool):
        return False  # True is an int to Python, not to a config
    if annotation is float:
        return isinstance(value, (int, float))
    if annotation in (bool, int, str):
        return isinstance(value, annotation)
    container = origin or annotation
    if container in (list, tuple, set, frozenset, Sequence, Iterable):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            return False
        if container is tuple and args and args[-1] is not Ellipsis:
            return len(args) == len(value) and all(fits(v, a) for v, a in zip(value, args))
        item = args[0] if args else Any
        return all(fits(v, item) for v in value)
    if container in (dict, Mapping):
        return isinstance(value, Mapping)
    if inspect.isclass(container) and value is not None and isinstance(value, (bool, int, float, str, list, dict)):
        # A plain value for a parameter annotated as another class (Tensor, Module...): only
        # an instance fits.
        try:
            return isinstance(value, container) or container is Callable
        except TypeError:
            return True
    return True


def _public_name(cls: type) -> str:
    """torch.nn.Module rather than torch.nn.modules.module.Module: the name users write (a
    module that merely imports the class, as torch.optim.lr_scheduler imports Tensor, is not it)."""
    for public in ("torch.nn", "torch.optim", "torch.optim.lr_scheduler", "torch.utils.data"):
        module = importlib.import_module(public)
        if getattr(module, cls.__name__, None) is cls and cls.__module__.startswith(public):
            return f"{public}.{cls.__name__}"
    return f"{cls.__module__}.{cls.__qualname__}"
