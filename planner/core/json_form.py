"""The JSON form the plan's records share: a field per key, tuples as lists, a None field left out."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any, TypeVar

R = TypeVar("R")


def json_value(value: Any) -> Any:
    """A field's JSON value: a record by its own `to_json`, a tuple (a named one too) as a list."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return value.to_json()
    if isinstance(value, tuple):
        return [json_value(v) for v in value]
    return value


def fields_json(record: Any, keep_none: Collection[str] = (), skip: Collection[str] = ()) -> dict:
    """`record`'s fields (but `skip`) as JSON keys in field order; a None field's key is absent
    unless it is one of `keep_none` (a fact written even when unknown)."""
    out = {}
    for f in dataclasses.fields(record):
        value = getattr(record, f.name)
        if f.name not in skip and (value is not None or f.name in keep_none):
            out[f.name] = json_value(value)
    return out


def frozen(value: Any) -> Any:
    """A JSON value with its lists as tuples, nested ones too (the records keep tuples)."""
    if isinstance(value, list):
        return tuple(frozen(v) for v in value)
    return value


def from_fields(cls: type[R], data: Mapping[str, Any], skip: Collection[str] = (),
                **convert: Callable[[Any], Any]) -> R:
    """`cls` from the keys of `data` that name its fields (others are ignored: facts an older
    planner wrote), lists as tuples, `convert[name]` reading a field's non-None value where given."""
    values = {}
    for f in dataclasses.fields(cls):
        if f.name in data and f.name not in skip:
            v = data[f.name]
            values[f.name] = convert[f.name](v) if f.name in convert and v is not None else frozen(v)
    return cls(**values)


class JsonRecord:
    """A frozen record whose JSON form is its fields (`fields_json`, `from_fields`); a record with
    nested records or facts written even when unknown overrides `to_json` / `from_json`."""

    __slots__ = ()

    def to_json(self) -> dict:
        return fields_json(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]):
        return from_fields(cls, d)
