"""The one way an artifact's JSON becomes frozen dataclasses and back, key for key.

A ``Record`` subclass is a frozen dataclass whose fields are the JSON object's keys: ``from_dict`` reads one
(nested records, tuples for lists, dicts of either, by the type hints) and refuses a key it does not know or
a required key missing; ``as_dict`` gives the same keys back, so that a file read and written again keeps
its bytes. ``ABSENT`` names the fields the file omits (rather than writing null) when they are None, ``KEYS``
the fields whose JSON key is not a Python name (``from``, ``to``).
"""

from __future__ import annotations

import functools
import types
import typing
from dataclasses import fields, is_dataclass
from typing import ClassVar

from pipeline.errors import UserError


class Record:
    ABSENT: ClassVar[tuple[str, ...]] = ()
    KEYS: ClassVar[dict[str, str]] = {}

    @classmethod
    def from_dict(cls, d: dict):
        """Raises: ValueError on a key the record does not know, or a required key missing."""
        names = {cls.KEYS.get(f.name, f.name): f.name for f in fields(cls)}
        unknown = sorted(set(d) - set(names))
        missing = sorted(k for k, n in names.items() if k not in d and n not in cls.ABSENT)
        if unknown or missing:
            raise ValueError(f"{cls.__name__}: unknown key(s) {unknown}, missing key(s) {missing}")
        hints = _hints(cls)
        absent = {n: None for k, n in names.items() if k not in d}  # only ABSENT fields can be (checked above)
        return cls(**absent, **{names[k]: _load(hints[names[k]], v) for k, v in d.items()})

    @classmethod
    def parse(cls, d, refused: typing.Callable[[Exception], str]):
        """``from_dict`` for a file a stage wrote: one of another version (a key unknown or missing, a value of
        another type) is the one line ``refused(why)``, naming the file and the stage that rebuilds it."""
        try:
            return cls.from_dict(d)
        except (ValueError, TypeError, AttributeError) as exc:
            raise UserError(refused(exc)) from None

    def as_dict(self) -> dict:
        return {
            self.KEYS.get(f.name, f.name): dump(v)
            for f in fields(self)
            if not ((v := getattr(self, f.name)) is None and f.name in self.ABSENT)
        }


@functools.cache
def _hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _load(hint, value):
    """``value`` (plain JSON) as ``hint`` says: records, tuples for lists, dicts of either; scalars as they are."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if value is None:
        return None
    if origin in (typing.Union, types.UnionType):
        return _load(next(a for a in args if a is not type(None)), value)
    if isinstance(hint, type) and is_dataclass(hint):
        return hint.from_dict(value)
    if origin is dict:
        return {k: _load(args[1], v) for k, v in value.items()}
    if origin is tuple:
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_load(args[0], v) for v in value)
        return tuple(_load(a, v) for a, v in zip(args, value, strict=True))
    return value


def dump(value):
    """Plain JSON of a record, or of dicts, tuples and lists of records."""
    if isinstance(value, Record):
        return value.as_dict()
    if isinstance(value, dict):
        return {k: dump(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [dump(v) for v in value]
    return value
