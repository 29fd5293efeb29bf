"""Which `Host` values name this machine's loopback (a listener on loopback only,
without a token, serves these alone: a rebound page sends its own name)."""

from __future__ import annotations

import pytest

from gateway.http.auth import loopback_host


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1:8480",
        "127.0.0.2",
        "localhost",
        "LOCALHOST:8480",
        "localhost.",  # a fully qualified name
        "app.localhost:1",
        "[::1]:8480",
        "[::ffff:127.0.0.1]:8480",  # IPv4 in IPv6: a real client of a 127.0.0.1 listener
        "0.0.0.0:8480",  # a client may connect to it, and a rebound page sends a name
        "[::]:8480",
    ],
)
def test_loopbacks_own_names(host: str) -> None:
    assert loopback_host(host)


@pytest.mark.parametrize(
    "host",
    [
        "evil.example",
        "evil.example:8480",
        "10.0.0.1",
        "[::ffff:10.0.0.1]",
        "",
        "localhost.evil",
        "127.0.0.1:8480@evil.example",  # not a port: the name is not loopback's
        "[::1]:8480@evil.example",
        "[::1]x",
    ],
)
def test_other_names(host: str) -> None:
    assert not loopback_host(host)
