"""A store URL may carry a password: no entry point that opens one quotes it in
an error, urllib's own words included (they quote the netloc for a character
NFKC turns into a delimiter)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from gateway.config.model import load_config
from gateway.errors import ConfigError
from gateway.store import open_store as open_gateway_store
from leases import open_store as open_lease_store
from leases.fence import Fence
from leases.fence.database import FenceDatabase
from leases.http import HTTPLeaseStore
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


# asyncpg takes the user and password up to the first `@` and reads the query
# strictly; its errors for these quoted the rest ('et@127.0.0.1', 'et').
AT_IN_PASSWORD = "postgresql://u:s3cr@et@127.0.0.1/db"
LOOSE_QUERY = "postgresql://u@127.0.0.1/db?password=s3cr&et"
NO_SCHEME = "host=db user=u password=s3cret"  # a libpq setting string
USER_AND_PASSWORD = "u:s3cret@db.internal"

CASES = [UNREADABLE, WRONG_SCHEME, AT_IN_PASSWORD, LOOSE_QUERY, NO_SCHEME, USER_AND_PASSWORD]


@pytest.mark.parametrize("opener", OPENERS, ids=lambda o: o.__qualname__)
@pytest.mark.parametrize("url", CASES)
async def test_no_opener_quotes_the_password(
    opener: Callable[[str], Awaitable[Any]], url: str
) -> None:
    with pytest.raises(ValueError) as info:
        await opener(url)
    message = str(info.value)
    assert "s3cr" not in message and "et@" not in message and "password=" not in message
    if url == UNREADABLE:
        assert "reads as a URL delimiter" in message
    if url == AT_IN_PASSWORD:
        assert "must be percent-encoded (%40)" in message
    if url == LOOSE_QUERY:
        assert "its query is not name=value pairs" in message


@pytest.mark.parametrize("url", CASES)
def test_the_config_check_quotes_no_password(tmp_path: Path, url: str) -> None:
    path = tmp_path / "gateway.toml"
    path.write_text(f'[store]\nurl = "{url}"\n')
    (tmp_path / "destinations").mkdir()
    with pytest.raises(ConfigError) as info:
        load_config(path, environ={})
    assert "s3cr" not in str(info.value)


async def test_the_http_lease_stores_repr_and_errors_hide_the_password() -> None:
    async with await HTTPLeaseStore.open("https://u:s3cret@gw.internal/x") as store:
        assert repr(store) == "HTTPLeaseStore('https://u:***@gw.internal/x')"
    for url in ("https://u:s3cret@gw.internal/x?q=1", "ftp://u:s3cret@gw.internal/"):
        with pytest.raises(ValueError) as info:
            await HTTPLeaseStore.open(url)
        assert "s3cret" not in str(info.value)
