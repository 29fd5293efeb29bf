"""The headers a forwarded write carries (SPEC 2): what is dropped, what is kept
whatever the worker's `Connection` header lists, and empty values."""

from __future__ import annotations

from multidict import CIMultiDict, CIMultiDictProxy

from gateway.write.upstream import forward_headers
from tests.harness import destination

DEST = destination("pay", "http://upstream.invalid")


def forwarded(*pairs: tuple[str, str], **overrides: object) -> CIMultiDict[str]:
    incoming = CIMultiDictProxy(CIMultiDict(pairs))
    dest = destination("pay", "http://upstream.invalid", **overrides) if overrides else DEST
    return forward_headers(incoming, dest)


def test_empty_fencing_headers_and_key_count_as_missing_and_are_not_sent() -> None:
    out = forwarded(
        ("Fencing-Job", "job-1"),
        ("Fencing-Token", "3"),
        ("Fencing-Owner", ""),
        ("Idempotency-Key", " "),
        ("X-Empty", ""),
    )
    assert "Fencing-Owner" not in out and "Idempotency-Key" not in out
    assert out["X-Empty"] == ""  # any other empty header is the worker's business
    assert (out["Fencing-Job"], out["Fencing-Token"]) == ("job-1", "3")


def test_connection_tokens_drop_other_headers_but_not_the_checked_ones() -> None:
    out = forwarded(
        ("Connection", "keep-alive, X-Hop, Idempotency-Key, Content-Type, Content-Encoding"),
        ("X-Hop", "1"),
        ("Idempotency-Key", "k1"),
        ("Content-Type", "application/json"),
        ("Content-Encoding", "gzip"),  # the body goes on coded: so does what says it
    )
    assert "X-Hop" not in out and "Connection" not in out
    assert (out["Idempotency-Key"], out["Content-Type"]) == ("k1", "application/json")
    assert out["Content-Encoding"] == "gzip"


def test_switched_off_fencing_headers_stay_off_even_when_listed_in_connection() -> None:
    out = forwarded(
        ("Connection", "Fencing-Job"),
        ("Fencing-Job", "job-1"),
        ("Fencing-Token", "3"),
        forward_fencing_headers=False,
    )
    assert "Fencing-Job" not in out and "Fencing-Token" not in out
