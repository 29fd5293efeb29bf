"""What each step of a write returns, and the one log line made of it (SPEC 10).

The steps of `WriteGateway.handle` return these immutable values; the line is
assembled once, at the end, from what they returned. Named tuples rather than
frozen dataclasses: a frozen dataclass sets each field through
`object.__setattr__`, about 1,300 instructions a field, and a woken write makes
three of these (17 fields) on the event loop, against a third of that here.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from aiohttp import web

from gateway.policy.decision import WriteFacts
from gateway.policy.records import OutcomeKind, Verdict, WriteContext


def milliseconds(seconds: float) -> float:
    """`seconds` (a finite duration, not negative) in milliseconds to the
    microsecond, for the line: `round(seconds * 1000, 3)` but that an exact
    binary tie rounds half up (6.25e-05 s: 0.063, not 0.062), at a tenth of its
    cost (`round` to a number of digits goes through a decimal conversion)."""
    return int(seconds * 1_000_000 + 0.5) / 1000


class Checked(NamedTuple):
    """A write past steps 1-5: its facts, what is recorded with a rejection, its body."""

    facts: WriteFacts
    context: WriteContext
    body: bytes


class Decided(NamedTuple):
    """Step 6: the store's verdict, and how long the store took (its last call).
    Under `Prefer: wait`: the wait honoured (`prefer_wait`, seconds), and how the
    wait ended (`wait`) after how long, if the write had to wait."""

    verdict: Verdict
    store_ms: float
    prefer_wait: int | None = None
    wait: str | None = None
    waited_ms: float | None = None
    # When the verdict was asked for (`time.perf_counter`): the store read its clock
    # after it, so a forward ended by `asked_at + timeout` ends before the barrier
    # and the reservation's deadline, however late the verdict arrived.
    asked_at: float = 0.0


class Sent(NamedTuple):
    """Steps 7-8: what forwarding a write did."""

    upstream_ms: float
    outcome: OutcomeKind
    outcome_recorded: bool
    upstream_status: int | None = None
    relayed_bytes: int | None = None
    relay_error: str | None = None


class Written(NamedTuple):
    """A write's answer, and how it was decided: `forwarded`, `replayed` or `rejected`."""

    response: web.StreamResponse
    decision: str
    reason: str | None = None
    rejection_id: int | None = None
    decided: Decided | None = None  # None: refused before the store decided
    attempt: str | None = None
    sent: Sent | None = None
    # What a refusal adds to the line (`Rejection.line_extra`).
    line_extra: dict[str, Any] | None = None


def line_fields(
    destination: str,
    method: str,
    job_id: str | None,
    generation: int | None,
    key: str | None,
    written: Written,
    total_ms: float,
) -> dict[str, Any]:
    """The `write_decision` line's fields, in the order they are read: who wrote
    (null until known), and what was done; a step that did not run leaves its
    fields out."""
    fields: dict[str, Any] = {
        "destination": destination,
        "method": method,
        "job_id": job_id,
        "generation": generation,
        "key": key,
    }
    decided = written.decided
    if decided is not None:
        fields["store_ms"] = decided.store_ms
        if decided.prefer_wait is not None:
            fields["prefer_wait"] = decided.prefer_wait
        if decided.wait is not None:
            fields["wait"] = decided.wait
        if decided.waited_ms is not None:
            fields["waited_ms"] = decided.waited_ms
    if written.line_extra is not None:
        fields.update(written.line_extra)
    fields["decision"] = written.decision
    fields["reason"] = written.reason
    if written.decision == "rejected":
        fields["rejection_id"] = written.rejection_id
    if written.attempt is not None:
        fields["attempt"] = written.attempt
    sent = written.sent
    if sent is not None:
        fields["upstream_ms"] = sent.upstream_ms
        fields["outcome"] = sent.outcome
        fields["outcome_recorded"] = sent.outcome_recorded
        if sent.upstream_status is not None:
            fields["upstream_status"] = sent.upstream_status
        if sent.relayed_bytes is not None:
            fields["relayed_bytes"] = sent.relayed_bytes
        if sent.relay_error is not None:
            fields["relay_error"] = sent.relay_error
    fields["status"] = written.response.status
    fields["total_ms"] = total_ms
    return fields
