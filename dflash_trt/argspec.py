"""Dataclass fields as command-line flags: a settings class declares each setting once, as a
field with :func:`arg` metadata (help text, flags, argparse extras), and every command that
takes it gets its flag from there (:func:`add_arguments`), so no flag is written twice."""

from __future__ import annotations

import argparse
import types
import typing
from dataclasses import MISSING, field, fields

from .errors import DFlashError


def arg(help: str, *flags: str, default=None, default_factory=MISSING, **extra):
    """A dataclass field with its command-line form: ``flags`` (default ``--field-name``),
    ``help``, and argparse extras (``choices``, ``metavar``)."""
    meta = {"help": help, "flags": flags, **extra}
    if default_factory is not MISSING:
        return field(default_factory=default_factory, metadata=meta)
    return field(default=default, metadata=meta)


def flag_of(cls, name: str) -> str:
    """The command-line flag of ``cls``'s field ``name`` (its first flag), or ``name`` as a flag
    (``max_new_tokens`` -> ``--max-new-tokens``) when ``cls`` has no such field."""
    f = cls.__dataclass_fields__.get(name)
    default = f"--{name.replace('_', '-')}"
    if f is None or "flags" not in f.metadata:
        return default
    return (f.metadata["flags"] or (default,))[0]


def add_arguments(
    parser,
    cls,
    only: tuple[str, ...] | None = None,
    defaults: dict | None = None,
    helps: dict | None = None,
):
    """Add a flag per field of the dataclass ``cls`` that has :func:`arg` metadata (``only``:
    just these fields, in this order) to ``parser``. ``defaults`` and ``helps`` override a field's
    default and help text for this command. Booleans whose default is False become ``--flag``,
    the others ``--flag/--no-flag``; ``X | None`` fields take an X. Returns ``parser``.

    Raises:
        DFlashError: a field of a type with no command-line form, or an unknown name in ``only``.
    """
    defaults, helps = defaults or {}, helps or {}
    hints = typing.get_type_hints(cls)
    by_name = {f.name: f for f in fields(cls) if "help" in f.metadata}
    names = list(by_name) if only is None else list(only)
    for name in names:
        if name not in by_name:
            raise DFlashError(f"{cls.__name__} has no command-line setting {name!r}")
        f = by_name[name]
        meta = f.metadata
        default = defaults.get(name, f.default if f.default is not MISSING else None)
        kw = {"dest": name, "default": default, "help": helps.get(name, meta["help"])}
        kind = _base_type(hints[name])
        if kind is bool:
            kw["action"] = argparse.BooleanOptionalAction if default is not False else "store_true"
        elif kind is tuple:
            kw["type"] = _int_tuple(flag_of(cls, name))
        else:
            kw["type"] = kind
        for extra in ("choices", "metavar", "required"):
            if extra in meta:
                kw[extra] = meta[extra]
        parser.add_argument(*(meta["flags"] or (flag_of(cls, name),)), **kw)
    return parser


def from_arguments(cls, args: argparse.Namespace, **extra):
    """``cls`` from the parsed flags of its fields present in ``args`` (a None left by a flag
    whose field has a non-None default keeps that default), plus ``extra`` keyword fields."""
    kw = {}
    for f in fields(cls):
        if not hasattr(args, f.name):
            continue
        value = getattr(args, f.name)
        if value is None and (f.default is not None or f.default_factory is not MISSING):
            continue
        kw[f.name] = value
    return cls(**(kw | extra))


def _base_type(t) -> type:
    """``int | None`` -> int; ``tuple[int, ...]`` -> tuple; ``bool`` -> bool."""
    if isinstance(t, types.UnionType):
        t = next(a for a in t.__args__ if a is not type(None))
    if typing.get_origin(t) is tuple:
        return tuple
    if t not in (bool, int, float, str):
        raise DFlashError(f"a setting of type {t!r} has no command-line form")
    return t


def _int_tuple(flag: str):
    """argparse type: ``"1,8,29"`` -> ``(1, 8, 29)``."""

    def parse(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"{flag} takes comma-separated integers, got {text!r}") from None

    return parse
