"""One configuration layer for every Cleave command: flags, then ``CLEAVE_*`` variables, then defaults.

Every long flag ``--some-flag`` of a parser that goes through :func:`parse_args`
can be set with ``CLEAVE_SOME_FLAG``; a flag on the command line wins. Values are
parsed exactly like the flag's own value (its ``type`` and ``choices``), so a bad
variable fails at start with the variable's name in the message. Special forms:

- on/off flags (``store_true``/``store_false``) take ``1``/``true``/``yes``/``on``
  or ``0``/``false``/``no``/``off`` (empty is off), so ``CLEAVE_NO_PREFIX_CACHING=0``
  leaves prefix caching on;
- repeatable flags (``action="append"``) take a comma-separated list, e.g.
  ``CLEAVE_DECODE_WORKER=10.0.0.5:50051,10.0.0.6:50051``; flags replace the list.

Flag definitions stay where they are; this module only reads the environment.
It imports nothing heavy (the router imports it).
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Mapping, Sequence

ENV_PREFIX = "CLEAVE_"
TRUE_WORDS = frozenset({"1", "true", "yes", "on"})
FALSE_WORDS = frozenset({"0", "false", "no", "off", ""})


def env_name(flag: str) -> str:
    """``--kv-cache-memory`` -> ``CLEAVE_KV_CACHE_MEMORY``."""
    return ENV_PREFIX + flag.lstrip("-").replace("-", "_").upper()


def parse_bool(text: str) -> bool:
    word = text.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ValueError("is not a boolean; use 1/0, true/false, yes/no or on/off")


def parse_non_negative(text: str) -> float:
    """A finite number >= 0 (a ratio, a duration)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0.0:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number >= 0")
    return value


def parse_cpu_list(text: str) -> frozenset[int]:
    """``"0,2-3"`` -> ``{0, 2, 3}`` (the kernel's CPU list format); an argparse ``type``."""
    cpus: set[int] = set()
    for part in text.split(","):
        match = re.fullmatch(r"\s*(\d+)(?:-(\d+))?\s*", part)
        if match is None:
            raise argparse.ArgumentTypeError(f"{text!r} is not a CPU list like 0,2-3")
        first = int(match[1])
        cpus.update(range(first, int(match[2] or first) + 1))
    if not cpus:
        raise argparse.ArgumentTypeError(f"{text!r} names no CPU (a list like 0,2-3)")
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))


def _long_flag(action: argparse.Action) -> str | None:
    return next((o for o in action.option_strings if o.startswith("--")), None)


def _convert_one(action: argparse.Action, text: str):
    value = action.type(text) if callable(action.type) else text
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"must be one of {', '.join(map(str, action.choices))}")
    return value


def _env_value(action: argparse.Action, text: str):
    if isinstance(action, argparse._StoreTrueAction):
        return parse_bool(text)
    if isinstance(action, argparse._StoreFalseAction):
        return not parse_bool(text)
    if isinstance(action, argparse._AppendAction):
        return [_convert_one(action, part.strip()) for part in text.split(",") if part.strip()]
    return _convert_one(action, text)


def env_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """``CLEAVE_*`` name -> the option it sets, for every long option of ``parser``."""
    out = {}
    for action in parser._actions:
        flag = _long_flag(action)
        if flag and action.dest != argparse.SUPPRESS and not isinstance(action, argparse._HelpAction):
            out[env_name(flag)] = action
    return out


def apply_env(parser: argparse.ArgumentParser, env: Mapping[str, str] | None = None) -> dict[str, list]:
    """Make ``CLEAVE_*`` values the defaults of ``parser``; name each variable in ``--help``.

    Returns the values of repeatable flags, which :func:`parse_args` applies after
    parsing (argparse would otherwise append the command line to them).
    """
    env = os.environ if env is None else env
    appended: dict[str, list] = {}
    for name, action in env_actions(parser).items():
        if action.help and action.help != argparse.SUPPRESS and name not in action.help:
            action.help = f"{action.help} [{name}]"
        elif not action.help:
            action.help = f"[{name}]"
        if name not in env:
            continue
        try:
            value = _env_value(action, env[name])
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            parser.error(f"{name}={env[name]!r}: {e}")
        action.required = False
        if isinstance(action, argparse._AppendAction):
            appended[action.dest] = value
        else:
            action.default = value
    return appended


def parse_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> argparse.Namespace:
    """``parser.parse_args`` with ``CLEAVE_*`` variables as defaults (see the module docstring)."""
    appended = apply_env(parser, env)
    args = parser.parse_args(argv)
    for dest, values in appended.items():
        if not getattr(args, dest, None):
            setattr(args, dest, values)
    return args


def parse_known_args(
    parser: argparse.ArgumentParser, argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None
) -> tuple[argparse.Namespace, list[str]]:
    """Like :func:`parse_args` for parsers that pass unknown flags on."""
    appended = apply_env(parser, env)
    args, rest = parser.parse_known_args(argv)
    for dest, values in appended.items():
        if not getattr(args, dest, None):
            setattr(args, dest, values)
    return args, rest
