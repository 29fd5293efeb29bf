"""A lease request's fields are read by the checks declared beside the bounds the
OpenAPI document states (gateway.http.models): each check holds exactly those."""

from __future__ import annotations

import re
import typing

import pytest

from gateway.http.leases import LEASE_REQUESTS
from gateway.http.schema import Meta, field_checks


def _metas(model: type) -> dict[str, Meta]:
    found: dict[str, Meta] = {}
    for name, tp in typing.get_type_hints(model, include_extras=True).items():
        for arg in (tp, *typing.get_args(tp)):
            if typing.get_origin(arg) is typing.Annotated:
                found[name] = next(m for m in typing.get_args(arg)[1:] if isinstance(m, Meta))
    return found


@pytest.mark.parametrize("model", sorted(set(LEASE_REQUESTS.values()), key=lambda m: m.__name__))
def test_every_field_is_checked_within_the_documented_bounds(model: type) -> None:
    checks, metas = field_checks(model), _metas(model)
    assert set(checks) == set(metas) == set(model.__dataclass_fields__)
    for name, meta in metas.items():
        check = checks[name]
        if meta.minimum is not None and meta.maximum is not None:
            low, high = meta.minimum, meta.maximum
            kind = int if isinstance(low, int) and isinstance(high, int) else float
            assert check(kind(low), name) == low and check(kind(high), name) == high
            below = low - 1 if kind is int else low / 2
            above = high + 1 if kind is int else high * 2
            for outside in (below, above):
                with pytest.raises(ValueError):
                    check(kind(outside), name)
        if meta.pattern is not None:
            assert re.search(meta.pattern, "worker-a") and check("worker-a", name)
            for bad in ("", "has space", "x" * 257):
                assert not re.search(meta.pattern, bad)
                with pytest.raises(ValueError):
                    check(bad, name)
