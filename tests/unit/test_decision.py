"""gateway.policy.decision.decide as plain tables: (facts, stored state, now) -> verdict."""

from __future__ import annotations

import hashlib
from dataclasses import replace

import pytest

from gateway.policy.decision import (
    RESERVATION_GRACE_S,
    Fencing,
    Forward,
    KeyRecord,
    KeyState,
    Reject,
    Replay,
    StoredState,
    WriteFacts,
    decide,
    fingerprint,
    reservation_deadline,
    retry_after,
)
from leases.model import LeaseRow, State

NOW = 1000.0
FP = fingerprint("POST", "/x", "", "application/json", b"{}")
FACTS = WriteFacts(
    destination="pay",
    method="POST",
    path="/x",
    query="",
    job_id="job",
    generation=7,
    owner=None,
    key="k",
    fingerprint=FP,
    fencing=Fencing.LEASE,
    upstream_idempotent=False,
    timeout=10.0,
)
ACTIVE = LeaseRow("job", "a", 7, State.ACTIVE, NOW + 5, 10.0)


def record(state: KeyState, *, fp: str = FP, deadline: float = NOW + 10) -> KeyRecord:
    return KeyRecord(
        destination="pay",
        key="k",
        state=state,
        fingerprint=fp,
        attempt="att",
        attempts=1,
        job_id="job",
        generation=7,
        owner=None,
        created_at=NOW - 1,
        updated_at=NOW - 1,
        deadline=deadline,
        status=201 if state is KeyState.COMPLETED else None,
    )


def state(
    lease: LeaseRow | None = ACTIVE,
    mark: int | None = None,
    older: float | None = None,
    rec: KeyRecord | None = None,
) -> StoredState:
    return StoredState(lease, mark, older, rec)


@pytest.mark.parametrize(
    ("facts", "stored", "expected"),
    [
        # lease-mode fence, in the contract's order
        (FACTS, state(lease=None), "lease_not_held"),
        (FACTS, state(lease=replace(ACTIVE, generation=8)), "stale_generation"),
        (FACTS, state(lease=replace(ACTIVE, generation=6)), "unknown_generation"),
        (FACTS, state(lease=replace(ACTIVE, state=State.DONE)), "job_completed"),
        (FACTS, state(lease=replace(ACTIVE, state=State.FREE)), "lease_not_held"),
        (FACTS, state(lease=replace(ACTIVE, lease_until=NOW)), "lease_expired"),
        (replace(FACTS, owner="b"), state(), "owner_mismatch"),
        (replace(FACTS, owner="a"), state(), "forward"),
        # a mark raised through a monotonic destination also binds lease mode
        (FACTS, state(mark=9), "stale_generation"),
        (FACTS, state(mark=7), "forward"),
        # monotonic mode looks at the mark only
        (replace(FACTS, fencing=Fencing.MONOTONIC), state(lease=None), "forward"),
        (replace(FACTS, fencing=Fencing.MONOTONIC), state(lease=None, mark=8), "stale_generation"),
        (replace(FACTS, fencing=Fencing.MONOTONIC), state(lease=None, mark=7), "forward"),
        # the generation barrier: after the fence, before the key
        (FACTS, state(older=NOW + 3), "older_generation_in_flight"),
        (FACTS, state(older=NOW), "forward"),
        (FACTS, state(older=NOW + 3, lease=None), "lease_not_held"),
        (FACTS, state(older=NOW + 3, rec=record(KeyState.COMPLETED)), "older_generation_in_flight"),
        # idempotency
        (FACTS, state(rec=record(KeyState.COMPLETED)), "replay"),
        (FACTS, state(rec=record(KeyState.COMPLETED, fp="other")), "idempotency_key_reused"),
        (FACTS, state(rec=record(KeyState.IN_FLIGHT, fp="other")), "idempotency_key_reused"),
        (FACTS, state(rec=record(KeyState.IN_FLIGHT)), "request_in_progress"),
        (FACTS, state(rec=record(KeyState.IN_FLIGHT, deadline=NOW)), "outcome_unknown"),
        (FACTS, state(rec=record(KeyState.UNKNOWN)), "outcome_unknown"),
        (replace(FACTS, upstream_idempotent=True), state(rec=record(KeyState.UNKNOWN)), "forward"),
        (
            replace(FACTS, upstream_idempotent=True),
            state(rec=record(KeyState.IN_FLIGHT)),
            "request_in_progress",
        ),
        (replace(FACTS, key=None), state(rec=None), "forward"),
        # a stale writer never gets the stored answer: the fence comes first
        (
            FACTS,
            state(lease=replace(ACTIVE, generation=8), rec=record(KeyState.COMPLETED)),
            "stale_generation",
        ),
    ],
)
def test_decide_table(facts: WriteFacts, stored: StoredState, expected: str) -> None:
    verdict = decide(facts, stored, NOW)
    if expected == "forward":
        assert isinstance(verdict, Forward)
    elif expected == "replay":
        assert isinstance(verdict, Replay) and verdict.record is stored.record
    else:
        assert isinstance(verdict, Reject) and verdict.reason == expected


def test_stale_rejection_carries_the_generations() -> None:
    verdict = decide(FACTS, state(lease=replace(ACTIVE, generation=8), mark=8), NOW)
    assert isinstance(verdict, Reject)
    assert (verdict.current_generation, verdict.highest_generation) == (8, 8)


def test_retry_after_counts_whole_seconds_and_at_least_one() -> None:
    assert [retry_after(s) for s in (0.0, 0.2, 1.0, 1.01, 9.5)] == [1, 1, 1, 2, 10]
    verdict = decide(FACTS, state(rec=record(KeyState.IN_FLIGHT, deadline=NOW + 4.2)), NOW)
    assert isinstance(verdict, Reject) and verdict.retry_after == 5


def test_unknown_retry_is_marked_as_such() -> None:
    verdict = decide(
        replace(FACTS, upstream_idempotent=True), state(rec=record(KeyState.UNKNOWN)), NOW
    )
    assert verdict == Forward(retry_of_unknown=True)


def test_reservation_outlives_the_forward_timeout_by_the_grace() -> None:
    assert reservation_deadline(FACTS, NOW) == NOW + FACTS.timeout + RESERVATION_GRACE_S


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (("POST", "/x", "", "t", b"1"), ("PUT", "/x", "", "t", b"1")),
        (("POST", "/x", "", "t", b"1"), ("POST", "/y", "", "t", b"1")),
        (("POST", "/x", "a=1", "t", b"1"), ("POST", "/x", "a=2", "t", b"1")),
        (("POST", "/x", "", "t", b"1"), ("POST", "/x", "", "u", b"1")),
        (("POST", "/x", "", "t", b"1"), ("POST", "/x", "", "t", b"2")),
        # length-prefixed: moving bytes between fields changes the hash
        (("POST", "/xa", "", "t", b""), ("POST", "/x", "a", "t", b"")),
    ],
)
def test_fingerprint_differs_when_the_request_differs(a: tuple, b: tuple) -> None:
    assert fingerprint(*a) != fingerprint(*b)
    assert fingerprint(*a) == fingerprint(*a)


def test_fingerprint_ignores_the_media_types_case_only() -> None:
    base = fingerprint("POST", "/x", "", "text/plain; charset=utf-8", b"1")
    assert fingerprint("POST", "/x", "", "Text/PLAIN; charset=utf-8", b"1") == base
    assert fingerprint("POST", "/x", "", "text/plain; charset=UTF-8", b"1") != base
    assert fingerprint("POST", "/x", "", "text/html; charset=utf-8", b"1") != base


def test_fingerprint_of_a_lower_case_media_type_is_what_it_always_was() -> None:
    """Keys stored before the media type was case-folded must still match."""
    digest = hashlib.sha256()
    for part in (b"POST", b"/x", b"", b"application/json; charset=utf-8", b"1"):
        digest.update(len(part).to_bytes(8, "big"))
        digest.update(part)
    assert fingerprint("POST", "/x", "", "application/json; charset=utf-8", b"1") == (
        digest.hexdigest()
    )
