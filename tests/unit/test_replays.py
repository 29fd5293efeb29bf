"""`Replays`: a replay's answer from the stored record, its headers built once per
record and honoured wait and copied for each write that replays it."""

from __future__ import annotations

import dataclasses

from gateway.policy.decision import KeyRecord, KeyState, Replay
from gateway.write.route import Replays

RECORD = KeyRecord(
    destination="pay",
    key="k",
    state=KeyState.COMPLETED,
    fingerprint="fp",
    attempt="a1",
    attempts=1,
    job_id="job-1",
    generation=1,
    owner=None,
    created_at=1.0,
    updated_at=2.0,
    deadline=3.0,
    completed_at=2.0,
    status=201,
    headers=(("Content-Type", "application/json"), ("Preference-Applied", "respond-async")),
    body=b'{"ok":true}',
)


def test_a_replay_says_it_replays_then_the_wait_after_the_records_own_preferences() -> None:
    response = Replays().response(Replay(RECORD), 30)
    assert (response.status, response.body) == (201, b'{"ok":true}')
    assert list(response.headers.items()) == [
        ("Content-Type", "application/json"),
        ("Preference-Applied", "respond-async, wait=30"),
        ("Idempotent-Replayed", "true"),
    ]


def test_each_write_gets_its_own_headers_and_a_new_record_or_wait_new_ones() -> None:
    replays = Replays()
    first = replays.response(Replay(RECORD), 30)
    first.headers["X-Changed"] = "by the first answer"  # as aiohttp adds its own
    again = replays.response(Replay(RECORD), 30)
    assert "X-Changed" not in again.headers
    other_wait = replays.response(Replay(RECORD), 5)
    assert other_wait.headers["Preference-Applied"] == "respond-async, wait=5"
    omitted = dataclasses.replace(RECORD, headers=(), body=b"", body_omitted=True)
    without = replays.response(Replay(omitted), None)
    assert list(without.headers.items()) == [
        ("Idempotent-Replayed", "true"),
        ("Sinkgate-Replay-Body", "omitted"),
    ]


def test_the_records_own_wait_gives_way_but_a_quoted_comma_is_one_element() -> None:
    record = dataclasses.replace(
        RECORD, headers=(("Preference-Applied", 'foo="a,wait=1", Wait=7;x=1, respond-async'),)
    )
    response = Replays().response(Replay(record), 30)
    assert response.headers["Preference-Applied"] == 'foo="a,wait=1", respond-async, wait=30'


def test_the_gateways_wait_goes_first_where_the_records_own_cannot_be_read_past() -> None:
    """After `(x)` no reader of RFC 7240 reaches a `wait`: the answer named none."""
    from leases.prefer import preferences

    for applied in ("wait=1, (x)", 'foo="a, wait=1'):
        record = dataclasses.replace(RECORD, headers=(("Preference-Applied", applied),))
        value = Replays().response(Replay(record), 30).headers["Preference-Applied"]
        assert [p for p in preferences([value]) if p[0] == "wait"] == [("wait", "30")], value
