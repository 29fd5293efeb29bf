"""A store URL may carry a password: no entry point that opens one quotes it in
an error, urllib's own words included (they quote the netloc for a character
NFKC turns into a delimiter)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from gateway.store import open_store as open_gateway_store
from leases import open_store as open_lease_store
from leases.fence import Fence
from leases.fence.database import FenceDatabase
from leases.postgres import PostgresLeaseStore

UNREADABLE = "postgresql://u:s3cret\uff03x@db.internal/x"  # a full-width number sign
WRONG_SCHEME = "postgresq://u:s3cret@db.internal/x"


async def fence(url: str) -> Any:
    return FenceDatabase(Fence(), url)


OPENERS: list[Callable[[str], Awaitable[Any]]] = [
    open_gateway_store,
    open_lease_store,
    PostgresLeaseStore.open,
    fence,
]


@pytest.mark.parametrize("opener", OPENERS, ids=lambda o: o.__qualname__)
@pytest.mark.parametrize("url", [UNREADABLE, WRONG_SCHEME])
async def test_no_opener_quotes_the_password(
    opener: Callable[[str], Awaitable[Any]], url: str
) -> None:
    with pytest.raises(ValueError) as info:
        await opener(url)
    assert "s3cret" not in str(info.value)
    if url == UNREADABLE:
        assert "reads as a URL delimiter" in str(info.value)
