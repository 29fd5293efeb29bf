"""The one table of reasons: every code once, and what is derived from it."""

from __future__ import annotations

import re

import pytest

from gateway.errors import STATUS_BY_REASON, Rejection
from leases.reasons import LOST_REASONS, REASONS, RECORDED_REASONS, Family, Reason, title_of
from leases.writer import (
    BadWrite,
    DuplicateWrite,
    GatewayUnavailable,
    StaleWrite,
    rejection_from_response,
)

# SPEC 2 and 3, as written there: reason -> the status it is answered with.
CONTRACT_STATUS = {
    "unknown_destination": 404,
    "method_not_allowed": 405,
    "unauthorized": 401,
    "body_too_large": 413,
    "missing_fencing_token": 400,
    "invalid_fencing_token": 400,
    "missing_idempotency_key": 400,
    "invalid_idempotency_key": 400,
    "invalid_path": 400,
    "invalid_request": 400,
    "lease_not_held": 409,
    "stale_generation": 409,
    "unknown_generation": 409,
    "job_completed": 409,
    "lease_expired": 409,
    "owner_mismatch": 409,
    "lease_held": 409,
    "older_generation_in_flight": 409,
    "idempotency_key_reused": 422,
    "request_in_progress": 409,
    "outcome_unknown": 409,
    "upstream_unreachable": 502,
    "upstream_disconnected": 502,
    "upstream_timeout": 504,
    "store_unavailable": 503,
}


def test_every_reason_has_exactly_one_row_and_a_snake_case_code() -> None:
    assert set(REASONS) == set(Reason)
    assert all(re.fullmatch(r"[a-z]+(_[a-z]+)*", r.value) for r in Reason)


def test_the_status_table_is_derived_and_matches_the_contract() -> None:
    for reason, status in CONTRACT_STATUS.items():
        assert STATUS_BY_REASON[reason] == status, reason
    assert STATUS_BY_REASON["internal_error"] == 500  # was missing before the table


def test_a_rejection_takes_its_status_and_title_from_the_table() -> None:
    problem = Rejection(Reason.OLDER_GENERATION_IN_FLIGHT, "wait").problem()
    assert (problem["status"], problem["title"]) == (409, "Older generation in flight")
    assert title_of("store_unavailable") == "Store unavailable"


def test_lost_reasons_are_the_fence_refusals_in_the_contracts_order() -> None:
    assert [str(r) for r in LOST_REASONS] == [
        "lease_not_held",
        "stale_generation",
        "unknown_generation",
        "job_completed",
        "lease_expired",
        "owner_mismatch",
    ]
    assert all(REASONS[r].family is Family.FENCE for r in LOST_REASONS)


def test_recorded_reasons_are_steps_5_to_7_unauthorized_and_duplicate() -> None:
    recorded = {str(r) for r in RECORDED_REASONS}
    assert {"unauthorized", "duplicate", "stale_generation", "outcome_unknown"} <= recorded
    assert not recorded & {
        "unknown_destination",
        "method_not_allowed",
        "invalid_path",
        "body_too_large",  # step 4, as request_timeout: README "not logged"
        "request_timeout",
        "upstream_timeout",
    }


def _family(reason: str, status: int) -> type:
    body = f'{{"reason": "{reason}", "status": {status}}}'.encode()
    return type(rejection_from_response(status, {"Sinkgate-Rejected": reason}, body))


def test_the_writers_exception_families_follow_the_table() -> None:
    assert _family("stale_generation", 409) is StaleWrite
    assert _family("older_generation_in_flight", 409) is DuplicateWrite
    assert _family("outcome_unknown", 409) is DuplicateWrite
    assert _family("upstream_timeout", 504) is GatewayUnavailable
    assert _family("store_unavailable", 503) is GatewayUnavailable
    assert _family("invalid_path", 400) is BadWrite


def test_a_reason_to_retry_later_always_says_when() -> None:
    """Retry-After comes from the table's `retry_later`: 1 s unless the caller knows
    better (a lease's expiry, a reservation's deadline); no other reason has one."""
    for reason, info in REASONS.items():
        assert Rejection(reason, "x").retry_after == (1 if info.retry_later else None), reason
    assert Rejection(Reason.LEASE_HELD, "x", retry_after=7).retry_after == 7


@pytest.mark.parametrize(
    ("sent", "read"), [("3", 3.0), (" 2 ", 2.0), ("²", None), ("\u0661", None)]
)
def test_a_retry_after_is_read_in_ascii_digits_only(sent: str, read: float | None) -> None:
    """Both "²" and an Arabic-Indic digit are digits to `str.isdigit`: the first made the
    writer raise ValueError, the second was read as 1 s, where the TypeScript
    writer falls back to its own backoff for both."""
    headers = {"Sinkgate-Rejected": "request_in_progress", "Retry-After": sent}
    body = b'{"reason": "request_in_progress", "status": 409}'
    assert rejection_from_response(409, headers, body).retry_after == read
