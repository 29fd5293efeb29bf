"""The schema walker and the encoder of `gateway.http.schema`, on small models."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import pytest

from gateway.http.schema import Components, Meta, absent, field_names, required_names, to_json


class Colour(enum.StrEnum):
    RED = "red"
    BLUE = "blue"


@dataclass(frozen=True)
class Inner:
    """An inner model.

    Only the first paragraph is its description."""

    at: Annotated[str, Meta(format="date-time")]


@dataclass(frozen=True)
class Outer:
    name: Annotated[str, Meta(pattern="^a+$", min_length=1, max_length=9)]
    count: Annotated[int, Meta(minimum=0, maximum=10)]
    ratio: float
    flag: bool
    kind: Literal["x", "y"]
    colour: Colour
    inner: Inner
    maybe_inner: Inner | None
    items: Annotated[list[Inner], Meta(max_items=3)]
    counts: dict[str, int]
    nullable: int | None
    anything: Any
    defaulted: str = "d"
    left_out: int | None = absent()


def _document() -> dict[str, Any]:
    found = Components()
    assert found.add(Outer) == {"$ref": "#/components/schemas/Outer"}
    return found.schemas


def test_a_model_walks_into_an_object_schema_with_its_nested_models_as_components() -> None:
    schemas = _document()
    assert set(schemas) == {"Outer", "Inner"}
    outer = schemas["Outer"]
    assert outer["type"] == "object"
    assert outer["additionalProperties"] is False
    assert "description" not in outer  # the one dataclass writes itself is not used
    assert schemas["Inner"]["description"] == "An inner model."
    props = outer["properties"]
    assert props["name"] == {"type": "string", "pattern": "^a+$", "minLength": 1, "maxLength": 9}
    assert props["count"] == {"type": "integer", "minimum": 0, "maximum": 10}
    assert props["ratio"] == {"type": "number"}
    assert props["flag"] == {"type": "boolean"}
    assert props["kind"] == {"type": "string", "enum": ["x", "y"]}
    assert props["colour"] == {"type": "string", "enum": ["red", "blue"]}
    assert props["inner"] == {"$ref": "#/components/schemas/Inner"}
    assert props["maybe_inner"] == {
        "anyOf": [{"$ref": "#/components/schemas/Inner"}, {"type": "null"}]
    }
    assert props["items"] == {
        "type": "array",
        "items": {"$ref": "#/components/schemas/Inner"},
        "maxItems": 3,
    }
    assert props["counts"] == {"type": "object", "additionalProperties": {"type": "integer"}}
    assert props["nullable"] == {"type": ["integer", "null"]}
    assert props["anything"] == {}
    assert props["left_out"] == {"type": "integer"}  # absent when None: never null


def test_a_field_is_required_unless_it_has_a_default() -> None:
    outer = _document()["Outer"]
    assert "defaulted" not in outer["required"] and "left_out" not in outer["required"]
    assert outer["required"] == list(required_names(Outer))
    assert list(outer["properties"]) == list(field_names(Outer))


def test_to_json_follows_the_declaration() -> None:
    value = Outer(
        name="aa",
        count=1,
        ratio=0.5,
        flag=True,
        kind="x",
        colour=Colour.BLUE,
        inner=Inner("t"),
        maybe_inner=None,
        items=[Inner("u")],
        counts={"a": 1},
        nullable=None,
        anything=[1],
    )
    body = to_json(value)
    assert list(body) == [n for n in field_names(Outer) if n != "left_out"]
    assert body["colour"] == "blue" and type(body["colour"]) is str
    assert body["inner"] == {"at": "t"}
    assert body["items"] == [{"at": "u"}]
    assert body["maybe_inner"] is None and body["nullable"] is None  # sent as null
    assert to_json(Outer(**{**value.__dict__, "left_out": 3}))["left_out"] == 3


def test_two_models_with_one_name_are_refused() -> None:
    @dataclass(frozen=True)
    class Other:
        x: int

    Other.__name__ = "Inner"  # as a model of another module may be named
    found = Components()
    found.add(Inner)
    with pytest.raises(TypeError, match="two models named Inner"):
        found.add(Other)


def test_a_union_other_than_optional_is_refused() -> None:
    @dataclass(frozen=True)
    class Either:
        value: int | str

    with pytest.raises(TypeError, match="unions"):
        Components().add(Either)
