"""`key=value` command lines for the small tools that use a trained model (sample, evaluate).

nanoGPT's habit (`python sample.py --start="ROMEO:" --num_samples=3`) without argparse: each
argument is `key=value` (a leading `--` is allowed and dropped). A key the tool does not
know, a value of the wrong type and a missing required key are each one ConfigError line
that lists the known keys, so `exit_on_user_error` turns them into `error: ...`, exit 2.
A tool that also takes config overrides (evaluate's `data.path=...`) names them with
`passthrough`: such arguments are returned untouched, in order.
"""
from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ringtrain.errors import ConfigError, exit_on_user_error

REQUIRED = object()  # the default of a key the user must give


@dataclass(frozen=True)
class Key:
    """One `key=value` setting: its type (str, int or float), default and a few words of help."""

    name: str
    kind: type
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    optional: bool = False  # `key=none` (or null) gives None

    def parse(self, raw: str) -> Any:
        if self.optional and raw.lower() in ("none", "null"):
            return None
        if self.choices and raw not in self.choices:
            raise ConfigError(f"{self.name}={raw!r} is not one of {', '.join(self.choices)}; pick one of them")
        try:
            return self.kind(raw)
        except ValueError:
            kind = {int: "an integer", float: "a number"}.get(self.kind, self.kind.__name__)
            example = self.default if self.default is not REQUIRED else "..."
            raise ConfigError(f"{self.name}={raw!r} is not {kind}; write e.g. {self.name}={example}") from None


def usage(program: str, keys: Sequence[Key], extra: str = "") -> str:
    """The help text: one line per key with its default."""
    lines = [f"usage: python -m {program} " + " ".join(
        f"{k.name}=<{k.kind.__name__}>" if k.default is REQUIRED else f"[{k.name}={_shown(k.default)}]" for k in keys
    ) + (f" {extra}" if extra else "")]
    for key in keys:
        default = "required" if key.default is REQUIRED else f"default {key.default!r}"
        lines.append(f"  {key.name:<16} {key.help} ({default})")
    return "\n".join(lines)


def _shown(default: Any) -> str:
    return repr(default) if isinstance(default, str) and (not default or default.strip() != default) else str(default)


def parse_key_values(
    argv: Sequence[str],
    keys: Sequence[Key],
    program: str,
    passthrough: Callable[[str], bool] | None = None,
    passthrough_hint: str = "",
) -> tuple[dict[str, Any], list[str]]:
    """The settings `argv` gives (defaults filled in), and the passthrough arguments."""
    known = {key.name: key for key in keys}
    values: dict[str, Any] = {}
    passed: list[str] = []
    for argument in argv:
        text = argument[2:] if argument.startswith("--") else argument
        name, separator, raw = text.partition("=")
        if passthrough is not None and passthrough(name):
            if not separator and not name.startswith("~"):
                raise ConfigError(f"{argument!r} needs a value; write {name}=<value>")
            passed.append(text)
            continue
        if not separator:
            raise ConfigError(
                f"{argument!r} is not key=value; write e.g. {keys[0].name}=<{keys[0].kind.__name__}> "
                f"(known keys: {', '.join(known)})"
            )
        if name not in known:
            also = f", or {passthrough_hint}" if passthrough_hint else ""
            raise ConfigError(f"{name} is not a setting of {program}; the settings are {', '.join(known)}{also}")
        if name in values:
            raise ConfigError(f"{name} is given twice; give it once")
        values[name] = known[name].parse(raw)
    for key in keys:
        if key.name not in values:
            if key.default is REQUIRED:
                raise ConfigError(f"{key.name} is required; add {key.name}=... ({key.help})")
            values[key.name] = key.default
    return values, passed


def wants_help(argv: Sequence[str]) -> bool:
    return any(argument in ("-h", "--help", "help") for argument in argv)


def run_tool(program: str, keys: Sequence[Key], action: Callable[..., Any], argv: Sequence[str] | None = None) -> Any:
    """A tool's whole command line: the usage for --help (returns None), else
    `action(**options)`'s result, with any mistake in the options or found by the action as
    one `error:` line and exit 2."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if wants_help(argv):
        print(usage(program, keys))
        return None
    with exit_on_user_error():
        options, _ = parse_key_values(argv, keys, program)
        return action(**options)
