"""The outcome policy (SPEC 2 step 8) as a table: what a forward's result makes of its key."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from gateway.policy.outcome import Answered, NotAnswered, outcome
from gateway.policy.records import Outcome, OutcomeKind


@dataclass(frozen=True)
class Rules:
    retryable_statuses: frozenset[int] = frozenset({429, 502, 503, 504})
    replay_headers: tuple[str, ...] = ("Location", "ETag")
    max_replay_body: int = 8


RULES = Rules()
HEADERS = (
    ("Content-Type", "application/json"),
    ("Content-Encoding", "gzip"),
    ("location", "/orders/1"),
    ("Set-Cookie", "s=1"),
    ("X-Trace", "t"),
)
KEPT_WITH_BODY = (
    ("Content-Type", "application/json"),
    ("Content-Encoding", "gzip"),
    ("location", "/orders/1"),
)
KEPT_WITHOUT_BODY = (("Content-Type", "application/json"), ("location", "/orders/1"))


@pytest.mark.parametrize(
    ("result", "expected"),
    [
        # a failure: released when it cannot have been sent, unknown when it may have
        (NotAnswered(maybe_sent=False), Outcome(OutcomeKind.RELEASED)),
        (NotAnswered(maybe_sent=True), Outcome(OutcomeKind.UNKNOWN)),
        # a retryable status frees the key, whatever came with it
        (Answered(503, HEADERS, b"busy"), Outcome(OutcomeKind.RELEASED)),
        (Answered(429, HEADERS, b"x" * 100, streamed=True), Outcome(OutcomeKind.RELEASED)),
        # any other answer is the key's: listed headers, Content-Type, and with a
        # stored body its Content-Encoding
        (
            Answered(201, HEADERS, b"{}"),
            Outcome(OutcomeKind.COMPLETED, 201, KEPT_WITH_BODY, b"{}"),
        ),
        (
            Answered(500, HEADERS, b"oops"),
            Outcome(OutcomeKind.COMPLETED, 500, KEPT_WITH_BODY, b"oops"),
        ),
        # a body over max_replay_body, or streamed, is not stored: nor its encoding
        (
            Answered(200, HEADERS, b"x" * 9),
            Outcome(OutcomeKind.COMPLETED, 200, KEPT_WITHOUT_BODY, b"", body_omitted=True),
        ),
        (
            Answered(200, HEADERS, b"x" * 8),
            Outcome(OutcomeKind.COMPLETED, 200, KEPT_WITH_BODY, b"x" * 8),
        ),
        (
            Answered(200, HEADERS, b"xx", streamed=True),
            Outcome(OutcomeKind.COMPLETED, 200, KEPT_WITHOUT_BODY, b"", body_omitted=True),
        ),
    ],
)
def test_outcome_table(result: Answered | NotAnswered, expected: Outcome) -> None:
    assert outcome(result, RULES) == expected


def test_content_type_is_kept_even_when_the_destination_lists_no_header() -> None:
    rules = Rules(replay_headers=())
    got = outcome(Answered(200, HEADERS, b""), rules)
    assert got.headers == (("Content-Type", "application/json"), ("Content-Encoding", "gzip"))


def test_outcome_kinds_are_the_strings_the_stores_keep() -> None:
    assert [k.value for k in OutcomeKind] == ["completed", "released", "unknown"]
    assert OutcomeKind.UNKNOWN == "unknown"
