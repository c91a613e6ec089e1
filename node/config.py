"""Config dataclasses mapped 1:1 to CLI flags, a TOML file and ``ATOLL_`` variables.

Each frozen dataclass field becomes ``--field-name``; its one-line help is the string
literal written under the field. Precedence, lowest first: the dataclass default, the TOML
file (``--config``), the environment (``ATOLL_FIELD_NAME``), the command line.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import textwrap
import tomllib
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from atoll.protocol.errors import ConfigError

__all__ = ["ENV_PREFIX", "add_arguments", "build_config", "field_help", "load_toml"]

ENV_PREFIX = "ATOLL_"
T = TypeVar("T")


@functools.cache
def field_help(cls: type) -> dict[str, str]:
    """The string literal under each field of a dataclass, read from its source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
    out: dict[str, str] = {}
    for stmt, nxt in zip(body, [*body[1:], None], strict=True):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            out[stmt.target.id] = nxt.value.value.strip()
    return out


def _base_type(cls: type, name: str) -> type:
    hint = typing.get_type_hints(cls)[name]
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = args[0]
    if not isinstance(hint, type):
        raise TypeError(f"{cls.__name__}.{name}: unsupported type {hint!r}")
    return hint


def _convert(cls: type, name: str, value: Any, source: str) -> Any:
    kind = _base_type(cls, name)
    if value is None or (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        return value
    if isinstance(value, str):
        if kind is bool:
            low = value.strip().lower()
            if low in ("1", "true", "yes", "on"):
                return True
            if low in ("0", "false", "no", "off"):
                return False
        else:
            try:
                return kind(value)
            except ValueError:
                pass
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    raise ConfigError(f"{source}: {name} must be {kind.__name__}, got {value!r}")


def add_arguments(
    parser: argparse.ArgumentParser,
    cls: type,
    *,
    skip: tuple[str, ...] = (),
    help_from: type | None = None,
) -> None:
    """One ``--flag`` per field; defaults stay None so later layers can tell what was given.

    A field without a help line of its own takes that of the same field of ``help_from``
    (a dataclass whose settings ``cls`` repeats as flags).
    """
    helps = {**(field_help(help_from) if help_from is not None else {}), **field_help(cls)}
    for f in dataclasses.fields(cls):
        if f.name in skip or not f.init:
            continue
        flag = "--" + f.name.replace("_", "-")
        kind = _base_type(cls, f.name)
        default = f.default if f.default is not dataclasses.MISSING else None
        text = f"{helps.get(f.name, '')} (default: {default})".strip()
        if kind is bool:
            parser.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None, help=text
            )
        else:
            parser.add_argument(
                flag, dest=f.name, type=kind, default=None, help=text, metavar=kind.__name__.upper()
            )


def load_toml(path: str | os.PathLike[str], section: str | None = None) -> dict[str, Any]:
    """Read a TOML config file (optionally one table of it) with a clear error when broken."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {p}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None
    if section is not None:
        data = data.get(section, data)
    return {k.replace("-", "_"): v for k, v in data.items()}


def build_config(
    cls: type[T],
    args: argparse.Namespace | None = None,
    toml: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
) -> T:
    """Layer defaults < TOML < ``ATOLL_*`` environment < command line into ``cls``."""
    env = os.environ if env is None else env
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    for key, value in (toml or {}).items():
        if key not in names:
            raise ConfigError(f"config file: unknown setting {key!r}")
        values[key] = _convert(cls, key, value, "config file")
    for name in names:
        var = ENV_PREFIX + name.upper()
        if var in env:
            values[name] = _convert(cls, name, env[var], f"environment {var}")
    if args is not None:
        for name in names:
            value = getattr(args, name, None)
            if value is not None:
                values[name] = value
    return cls(**values)
