"""Typed JSON shapes: frozen dataclasses, their JSON Schema, and their JSON.

A model is a frozen dataclass whose fields are `int`, `float`, `str`, `bool`, a
`Literal`, an `Enum`, a nested model, `list[...]`, `dict[str, ...]` or one of
these `| None`; `Annotated[..., Meta(...)]` adds bounds, patterns, formats and
descriptions. `Components.add` walks a model into JSON Schema (nested models
become components referenced by `$ref`), and `to_json` turns an instance into
the dict a handler sends, so the document and the answer come from one
declaration. A field typed `Any` is sent as it is.

A field is required unless it has a default. A field declared with `absent()`
is left out of the JSON when it is None (documented as optional, never null);
any other `X | None` field is always sent, null or not. A model's own docstring
is its schema's description; its JSON has no property it does not declare
unless it sets `open_ended = True`.

Only the standard library: nothing here knows about HTTP.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Callable
from functools import cache
from typing import Any, Literal, Union

_ABSENT = "sinkgate.absent_if_none"
_REF_BASE = "#/components/schemas/"
_SCALARS: dict[type, str] = {bool: "boolean", int: "integer", float: "number", str: "string"}


@dataclasses.dataclass(frozen=True)
class Check:
    """How a request body's field is read, next to the `Meta` that documents it:
    `read(value, name)` returns the value or raises ValueError with the message
    the caller gets."""

    read: Callable[[Any, str], Any]


def field_checks(model: type) -> dict[str, Callable[[Any, str], Any]]:
    """Each field's `Check`, from its annotation (`X | None` included)."""
    found: dict[str, Callable[[Any, str], Any]] = {}
    for name, tp in _hints(model).items():
        check = _check_of(tp)
        if check is not None:
            found[name] = check.read
    return found


def _check_of(tp: Any) -> Check | None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return next((m for m in args[1:] if isinstance(m, Check)), None)
    if origin in (Union, types.UnionType):
        return next((c for c in map(_check_of, args) if c is not None), None)
    return None


@dataclasses.dataclass(frozen=True)
class Meta:
    """JSON Schema keywords for an `Annotated` type (None: not set)."""

    description: str | None = None
    pattern: str | None = None
    format: str | None = None
    minimum: float | None = None
    maximum: float | None = None
    min_length: int | None = None
    max_length: int | None = None
    min_items: int | None = None
    max_items: int | None = None
    enum: tuple[Any, ...] | None = None

    def keywords(self) -> dict[str, Any]:
        names = {
            "min_length": "minLength",
            "max_length": "maxLength",
            "min_items": "minItems",
            "max_items": "maxItems",
        }
        found = {
            names.get(f.name, f.name): getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
        if "enum" in found:
            found["enum"] = list(found["enum"])
        return found


def absent() -> Any:
    """A field's default: None, and left out of the JSON when it is None."""
    return dataclasses.field(default=None, metadata={_ABSENT: True})


def ref(model: type) -> dict[str, str]:
    """A `$ref` to `model`'s component."""
    return {"$ref": _REF_BASE + model.__name__}


# --- the schema walker -------------------------------------------------------------------


class Components:
    """The schemas of a document's `components`, by model name."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}
        self._models: dict[str, type] = {}

    def add(self, model: type) -> dict[str, str]:
        """Add `model` and every model it holds; returns the `$ref` to it."""
        name = model.__name__
        known = self._models.setdefault(name, model)
        if known is not model:
            raise TypeError(f"two models named {name}: {known!r} and {model!r}")
        if name not in self.schemas:
            self.schemas[name] = {}  # a placeholder: a model that holds itself terminates
            self.schemas[name] = _object_schema(model, self)
        return ref(model)

    def models(self) -> tuple[type, ...]:
        """Every model added, the ones held by others included."""
        return tuple(self._models.values())


def _object_schema(model: type, components: Components) -> dict[str, Any]:
    hints = _hints(model)
    properties: dict[str, Any] = {}
    required: list[str] = []
    for f in dataclasses.fields(model):
        absent_if_none = f.metadata.get(_ABSENT, False)
        properties[f.name] = _type_schema(hints[f.name], components, drop_none=absent_if_none)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
            required.append(f.name)
    schema: dict[str, Any] = {"type": "object"}
    description = _description(model)
    if description:
        schema["description"] = description
    schema["required"] = required
    if not getattr(model, "open_ended", False):
        schema["additionalProperties"] = False
    schema["properties"] = properties
    return schema


def _type_schema(tp: Any, components: Components, *, drop_none: bool = False) -> dict[str, Any]:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        inner = _type_schema(args[0], components, drop_none=drop_none)
        extra: dict[str, Any] = {}
        for meta in args[1:]:
            if isinstance(meta, Meta):
                extra.update(meta.keywords())
        return {**inner, **extra}
    if origin in (Union, types.UnionType):
        return _union_schema(args, components, drop_none=drop_none)
    if origin is Literal:
        return {"type": _SCALARS[type(args[0])], "enum": list(args)}
    if origin is list or origin is tuple:
        return {"type": "array", "items": _type_schema(args[0], components)}
    if origin is dict:
        return {"type": "object", "additionalProperties": _type_schema(args[1], components)}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        values = [m.value for m in tp]
        return {"type": _SCALARS[type(values[0])], "enum": values}
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        return components.add(tp)
    if tp in _SCALARS:
        return {"type": _SCALARS[tp]}
    if tp is Any:
        return {}
    raise TypeError(f"no JSON Schema for {tp!r}")


def _union_schema(
    args: tuple[Any, ...], components: Components, *, drop_none: bool
) -> dict[str, Any]:
    """`X | None`: X, nullable unless the field is left out when None."""
    options = [a for a in args if a is not type(None)]
    if len(options) != 1:
        raise TypeError(f"only `X | None` unions are supported, not {args!r}")
    inner = _type_schema(options[0], components)
    if drop_none or len(options) == len(args):
        return inner
    if isinstance(inner.get("type"), str) and "enum" not in inner:
        return {**inner, "type": [inner["type"], "null"]}
    return {"anyOf": [inner, {"type": "null"}]}


def _description(model: type) -> str | None:
    doc = model.__doc__ or ""
    if doc.startswith(model.__name__ + "("):  # the one dataclass writes itself
        return None
    return " ".join(doc.split("\n\n", 1)[0].split()) or None


@cache
def _hints(model: type) -> dict[str, Any]:
    return typing.get_type_hints(model, include_extras=True)


# --- the encoder ---------------------------------------------------------------------------

Convert = Callable[[Any], Any]


def to_json(instance: Any) -> dict[str, Any]:
    """`instance` (a model) as the dict its schema describes, fields in order."""
    model: type = type(instance)
    out: dict[str, Any] = {}
    for name, absent_if_none, convert in _plan(model):
        value = getattr(instance, name)
        if value is None:
            if absent_if_none:
                continue
        elif convert is not None:
            value = convert(value)
        out[name] = value
    return out


@cache
def _plan(model: type) -> tuple[tuple[str, bool, Convert | None], ...]:
    """Per field: its name, whether None leaves it out, and what turns its value
    into JSON (None: it already is JSON). Worked out once per model."""
    hints = _hints(model)
    return tuple(
        (f.name, bool(f.metadata.get(_ABSENT)), _converter(hints[f.name]))
        for f in dataclasses.fields(model)
    )


def _converter(tp: Any) -> Convert | None:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Annotated:
        return _converter(args[0])
    if origin in (Union, types.UnionType):  # None is passed by to_json itself
        return _converter(next(a for a in args if a is not type(None)))
    if origin is list or origin is tuple:
        item = _converter(args[0])
        return None if item is None else lambda values: [item(v) for v in values]
    if origin is dict:
        member = _converter(args[1])
        return None if member is None else lambda d: {k: member(v) for k, v in d.items()}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum_value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return to_json
    return None


def _enum_value(member: enum.Enum) -> Any:
    return member.value


def field_names(model: type) -> tuple[str, ...]:
    """The JSON member names of `model`, in order."""
    return tuple(f.name for f in dataclasses.fields(model))


def required_names(model: type) -> tuple[str, ...]:
    """The members `model` cannot do without (no default), in order."""
    return tuple(
        f.name
        for f in dataclasses.fields(model)
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    )
