"""`Prefer: wait=N` as RFC 7240 reads it, and the wait the gateway applies (SPEC 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.write.prefer import MAX_VALUE, applied_wait, preference_without, wait_preference
from leases.prefer import preferences, whole


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], None),
        (["wait=10"], 10),
        (["WAIT=3"], 3),
        (["wait = 7"], 7),
        (['wait="5"'], 5),
        (["respond-async, wait=10"], 10),
        (["return=minimal", "wait=4"], 4),
        (["wait=10;foo=bar, handling=lenient"], 10),
        (['foo="a, wait=9", wait=2'], 2),  # a comma inside quotes separates nothing
        (["wait=2, wait=9"], 2),  # the first one counts
        (["handling=strict"], None),
        (["wait=0"], None),  # zero: no wait
        (["wait=-1"], None),
        (["wait=1.5"], None),
        (["wait=abc"], None),
        (["wait"], None),
        (["wait="], None),
        (["waiting=5"], None),
        # Longer than any cap: read as the longest wait, then capped like any other.
        (["wait=99999999999999"], 10**12),
        (["wait=1000000000000"], 10**12),
        (["wait=999999999999"], 999_999_999_999),
        (["wait=" + "9" * 1000], 10**12),  # never turned into an int
        (["wait=" + "0" * 30 + "7"], 7),
        (["wait=0000"], None),
        # Empty list elements are skipped (RFC 9110 5.6.1), not the end of the list.
        ([", wait=5"], 5),
        (["respond-async,, wait=5"], 5),
        ([" , ,"], None),
        # An unmatched quote ends the list (read in one pass: the pattern is possessive).
        (["a" * 1000 + '"', "wait=4"], 4),
        (["a" + " " * 1000 + '"'], None),
        (['foo="' + "a" * 1000], None),
        # A value longer than MAX_VALUE is not read; the next one still is.
        (["wait=3, " + "x" * MAX_VALUE], None),
        (["x" * (MAX_VALUE + 1), "wait=6"], 6),
    ],
)
def test_wait_preference(values: list[str], expected: int | None) -> None:
    assert wait_preference(values) == expected


@pytest.mark.parametrize(
    ("preference", "max_wait", "expected"),
    [
        (None, 30.0, 0),
        (10, 30.0, 10),
        (60, 30.0, 30),
        (5, 0.0, 0),  # max_wait "0s": never waits
        (5, 1.5, 1),  # whole seconds only
        (5, 0.5, 0),  # (the config refuses such a max_wait)
        (10**12, 30.0, 30),
    ],
)
def test_applied_wait(preference: int | None, max_wait: float, expected: int) -> None:
    assert applied_wait(preference, max_wait) == expected


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ([], []),
        (["respond-async"], ["respond-async"]),  # no `wait`: not even parsed
        (["return=minimal, WAIT=7"], ["return=minimal"]),
        (["wait=7"], []),  # a value left empty is dropped
        (["wait=7", "respond-async"], ["respond-async"]),
        (["wait=7;x=1 ,  return=minimal"], ["return=minimal"]),
        # A comma inside quotes separates nothing: split on commas, this lost
        # `foo`'s value and kept a `wait` that was never one.
        (['foo="a,wait=1", wait=3'], ['foo="a,wait=1"']),
        (['foo="a, wait=1"'], ['foo="a, wait=1"']),
        (["waiting=2, wait=1"], ["waiting=2"]),
        # Where a value stops being a preference list, the rest is kept as it is
        # (an unbalanced quote: its `wait` is inside it), the part read before it
        # loses its `wait` all the same: one `wait` in the answer, the gateway's.
        (['foo="a, wait=1'], ['foo="a, wait=1']),
        (["wait=1, (x)"], ["(x)"]),
        (["a=1, wait=1,  (x) wait=2"], ["a=1, (x) wait=2"]),
        # any length: an answer's header, not a worker's Prefer
        (["wait=1, " + "x" * MAX_VALUE], ["x" * MAX_VALUE]),
    ],
)
def test_preference_without(values: list[str], expected: list[str]) -> None:
    assert preference_without(values, "wait") == expected


# The TypeScript writer's tests read the same table: both writers refuse a
# caller's `Prefer` with a `wait` in it exactly when the gateway would read one,
# and, under a wait of their own, one the gateway would not read to its end.
NAMES = json.loads((Path(__file__).parents[1] / "vectors" / "prefer_names.json").read_text())


@pytest.mark.parametrize("row", NAMES, ids=[row["value"][:40] for row in NAMES])
def test_the_shared_table_of_preference_names(row: dict[str, object]) -> None:
    assert [name for name, _ in preferences([str(row["value"])])] == row["names"]
    assert whole(str(row["value"])) is row["whole"]
