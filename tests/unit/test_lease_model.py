"""Plain tables for the pure lease policy in `leases.model` (no I/O, no clock)."""

from __future__ import annotations

import dataclasses
import math
import os
import re
from datetime import UTC, datetime, timedelta

import pytest

from leases import model
from leases.model import Lease, LeaseRow, Reason, State

NOW = 1_000.0


def row(
    state: State = State.ACTIVE,
    generation: int = 5,
    owner: str = "worker-a",
    lease_until: float = NOW + 10,
) -> LeaseRow:
    return LeaseRow("job-1", owner, generation, state, lease_until, 30.0)


# --- claim_refusal -------------------------------------------------------------------

CLAIM_TABLE = [
    pytest.param(None, None, id="never-seen-job-is-claimable"),
    pytest.param(row(State.FREE), None, id="free-job-is-claimable"),
    pytest.param(row(State.FREE, lease_until=NOW + 99), None, id="free-ignores-lease-until"),
    pytest.param(row(State.ACTIVE), Reason.LEASE_HELD, id="unexpired-active-is-held"),
    pytest.param(row(lease_until=NOW + 1e-6), Reason.LEASE_HELD, id="held-until-last-instant"),
    pytest.param(row(lease_until=NOW), None, id="expired-exactly-at-lease-until"),
    pytest.param(row(lease_until=NOW - 5), None, id="expired-active-is-claimable"),
    pytest.param(row(State.DONE), Reason.JOB_COMPLETED, id="done-is-never-claimable"),
    pytest.param(row(State.DONE, lease_until=NOW - 5), Reason.JOB_COMPLETED, id="done-expired"),
]


@pytest.mark.parametrize(("current", "expected"), CLAIM_TABLE)
def test_claim_refusal_table(current: LeaseRow | None, expected: Reason | None) -> None:
    """A claim succeeds on never-seen, free or expired jobs; done jobs never."""
    assert model.claim_refusal(current, NOW) == expected


# --- hold_refusal, in the contract order (SPEC 2 step 6) -------------------------------
# Each row is built so that every *later* reason would also apply: the table then
# proves the first applicable reason wins.

HOLD_TABLE = [
    pytest.param(None, 5, "worker-a", Reason.LEASE_NOT_HELD, id="1-never-claimed"),
    pytest.param(
        row(State.DONE, lease_until=NOW - 1, owner="other"),
        4,
        "worker-a",
        Reason.STALE_GENERATION,
        id="2-stale-before-done-expired-owner",
    ),
    pytest.param(
        row(State.DONE, lease_until=NOW - 1, owner="other"),
        6,
        "worker-a",
        Reason.UNKNOWN_GENERATION,
        id="3-unknown-before-done-expired-owner",
    ),
    pytest.param(
        row(State.DONE, lease_until=NOW - 1, owner="other"),
        5,
        "worker-a",
        Reason.JOB_COMPLETED,
        id="4-completed-before-expired-owner",
    ),
    pytest.param(
        row(State.FREE, lease_until=NOW - 1, owner="other"),
        5,
        "worker-a",
        Reason.LEASE_NOT_HELD,
        id="5-free-before-expired-owner",
    ),
    pytest.param(
        row(State.ACTIVE, lease_until=NOW - 1, owner="other"),
        5,
        "worker-a",
        Reason.LEASE_EXPIRED,
        id="6-expired-before-owner",
    ),
    pytest.param(
        row(State.ACTIVE, lease_until=NOW, owner="worker-a"),
        5,
        "worker-a",
        Reason.LEASE_EXPIRED,
        id="6-expired-exactly-at-lease-until",
    ),
    pytest.param(
        row(State.ACTIVE, owner="other"), 5, "worker-a", Reason.OWNER_MISMATCH, id="7-owner"
    ),
    pytest.param(row(State.ACTIVE), 5, "worker-a", None, id="held"),
    pytest.param(row(State.ACTIVE, owner="other"), 5, None, None, id="owner-none-skips-check"),
    pytest.param(
        row(State.ACTIVE, lease_until=NOW - 1), 5, None, Reason.LEASE_EXPIRED, id="none-expired"
    ),
]


@pytest.mark.parametrize(("current", "generation", "owner", "expected"), HOLD_TABLE)
def test_hold_refusal_table_follows_contract_order(
    current: LeaseRow | None, generation: int, owner: str | None, expected: Reason | None
) -> None:
    """The first reason that applies, in SPEC 2 step 6 order, decides."""
    assert model.hold_refusal(current, generation, owner, NOW) == expected


def test_the_lease_reason_codes_are_the_contract_strings() -> None:
    """The lease protocol's reason values are the exact wire strings of SPEC 2 and 3."""
    assert {str(r) for r in Reason} >= {
        "lease_held",
        "lease_not_held",
        "stale_generation",
        "unknown_generation",
        "job_completed",
        "lease_expired",
        "owner_mismatch",
    }


# --- transitions --------------------------------------------------------------------


def test_claimed_starts_at_generation_one_and_bumps_by_one() -> None:
    """A first claim is generation 1; every later claim is the previous plus one."""
    first = model.claimed(None, "job-1", "a", 30.0, NOW)
    assert (first.generation, first.state, first.lease_until) == (1, State.ACTIVE, NOW + 30)
    for current in (row(State.FREE), row(lease_until=NOW - 1)):
        assert model.claimed(current, "job-1", "b", 5.0, NOW).generation == 6
        assert model.claimed(current, "job-1", "b", 5.0, NOW).owner == "b"


def test_renew_complete_release_keep_the_generation() -> None:
    """Only a claim changes the generation; the other transitions keep it."""
    current = row()
    renewed = model.renewed(current, 7.0, NOW)
    assert (renewed.generation, renewed.state, renewed.lease_until) == (5, State.ACTIVE, NOW + 7)
    assert model.completed(current, NOW).state is State.DONE
    assert model.released(current, NOW).state is State.FREE
    assert {model.completed(current, NOW).generation, model.released(current, NOW).generation} == {
        5
    }


def test_lease_from_row_is_immutable_and_utc() -> None:
    """A Lease is frozen, with an aware UTC `lease_until` and expires_in by `now`."""
    lease = Lease.from_row(row(lease_until=NOW + 2.5), NOW)
    assert lease.lease_until == datetime.fromtimestamp(NOW + 2.5, UTC)
    assert lease.lease_until.utcoffset() == timedelta(0)
    assert lease.expires_in == 2.5
    assert lease.state == "active"
    with pytest.raises(dataclasses.FrozenInstanceError):
        lease.generation = 9  # type: ignore[misc]


@pytest.mark.parametrize(
    ("current", "expected"),
    [
        (row(lease_until=NOW + 3), 3.0),
        (row(lease_until=NOW - 3), 0.0),
        (row(State.DONE, lease_until=NOW + 3), 0.0),
        (row(State.FREE, lease_until=NOW + 3), 0.0),
    ],
)
def test_expires_in_is_zero_once_expired_or_not_active(current: LeaseRow, expected: float) -> None:
    assert model.expires_in(current, NOW) == expected


# --- argument validation --------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    ["a", "job-42", "x" * 256, "!", "~", "".join(chr(c) for c in range(0x21, 0x7F))],
    ids=["one-char", "plain", "256-chars", "0x21", "0x7e", "whole-alphabet"],
)
def test_validate_ident_accepts_visible_ascii(value: str) -> None:
    assert model.validate_ident(value, "job_id") == value


@pytest.mark.parametrize(
    "value",
    ["", "x" * 257, "jöb", "job 42", "job\t1", "job\n", "\x7f", "\x20", None, 42, b"job"],
    ids=[
        "empty",
        "257-chars",
        "non-ascii",
        "space",
        "tab",
        "trailing-newline",
        "del",
        "only-space",
        "none",
        "int",
        "bytes",
    ],
)
def test_validate_ident_refuses(value: object) -> None:
    with pytest.raises(ValueError, match="job_id"):
        model.validate_ident(value, "job_id")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(0.05, 0.05), (86400, 86400.0), (86400.0, 86400.0), (1, 1.0), (30.5, 30.5)],
)
def test_validate_ttl_accepts_range_bounds(value: object, expected: float) -> None:
    result = model.validate_ttl(value)
    assert result == expected and type(result) is float


@pytest.mark.parametrize(
    "value",
    [True, False, math.nan, math.inf, -math.inf, 0, 0.049, 86400.1, -1, 10**400, "30", None],
    ids=[
        *("true", "false", "nan", "inf", "-inf", "zero", "0.049", "86400.1", "neg"),
        *("past-floats", "str", "none"),
    ],
)
def test_validate_ttl_refuses(value: object) -> None:
    with pytest.raises(ValueError, match="ttl"):
        model.validate_ttl(value)


@pytest.mark.parametrize("value", [1, 7, 2**63 - 1])
def test_validate_generation_accepts(value: int) -> None:
    assert model.validate_generation(value) == value


@pytest.mark.parametrize(
    "value",
    [0, -1, 2**63, True, 1.0, "1", None],
    ids=["0", "-1", "2^63", "bool", "float", "str", "none"],
)
def test_validate_generation_refuses(value: object) -> None:
    with pytest.raises(ValueError, match="generation"):
        model.validate_generation(value)


# --- default_owner ---------------------------------------------------------------------


def test_default_owner_is_a_valid_ident_with_this_pid() -> None:
    """host:pid:random, within the id alphabet and length."""
    owner = model.default_owner()
    assert model.validate_ident(owner, "owner") == owner
    host, pid, random_part = owner.rsplit(":", 2)
    assert host and int(pid) == os.getpid()
    assert re.fullmatch(r"[0-9a-f]{8}", random_part)


def test_default_owner_is_unique_per_call() -> None:
    """A restarted (or second) worker in the same process gets a new owner id."""
    owners = {model.default_owner() for _ in range(1000)}
    assert len(owners) == 1000


def test_default_owner_sanitises_an_odd_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    """A host name with spaces or non-ASCII still yields a valid owner id."""
    monkeypatch.setattr(model.socket, "gethostname", lambda: "my höst " + "x" * 300)
    owner = model.default_owner()
    assert model.validate_ident(owner, "owner") == owner
    assert owner.startswith("my_h_st_")
