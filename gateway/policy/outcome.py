"""PURE: what a forward's result makes of its key (SPEC 2 step 8).

An answer whose status the destination lists as retryable frees the key
(`released`); any other answer is the key's (`completed`), with the headers and
body a replay will give; a forward that failed frees the key when the request
cannot have been sent and leaves it `unknown` when it may have been.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from gateway.policy.records import Outcome, OutcomeKind


class ReplayRules(Protocol):
    """A destination's rules for what its answers leave (a `DestinationConfig`)."""

    @property
    def retryable_statuses(self) -> frozenset[int]: ...
    @property
    def replay_headers(self) -> tuple[str, ...]: ...
    @property
    def max_replay_body(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Answered:
    """The upstream answered: its status, headers and the body read so far;
    `streamed` when the body is longer than could be buffered (relayed, not stored)."""

    status: int
    headers: Iterable[tuple[str, str]]
    body: bytes
    streamed: bool = False


@dataclass(frozen=True, slots=True)
class NotAnswered:
    """The forward failed; `maybe_sent`: (part of) the request may have reached
    the upstream, so it may have acted on it."""

    maybe_sent: bool


RELEASED = Outcome(OutcomeKind.RELEASED)
UNKNOWN = Outcome(OutcomeKind.UNKNOWN)


def not_sent(resends_unknown: bool) -> Outcome:
    """The outcome of an attempt that was not sent (or answered with a retryable
    status): the key freed; but a re-send of a key whose earlier attempt's outcome
    is unknown (`upstream_idempotent`) settles nothing about it, so it stays
    unknown, for an operator."""
    return UNKNOWN if resends_unknown else RELEASED


def outcome(
    result: Answered | NotAnswered, rules: ReplayRules, *, resends_unknown: bool = False
) -> Outcome:
    """The outcome recorded with the key for `result` under the destination's
    `rules`; `resends_unknown`: see `not_sent`."""
    if isinstance(result, NotAnswered):
        return UNKNOWN if result.maybe_sent else not_sent(resends_unknown)
    if result.status in rules.retryable_statuses:
        return not_sent(resends_unknown)
    omitted = result.streamed or len(result.body) > rules.max_replay_body
    kept = replay_header_names(rules.replay_headers, not omitted)
    return Outcome(
        OutcomeKind.COMPLETED,
        status=result.status,
        headers=tuple((n, v) for n, v in result.headers if n.lower() in kept),
        body=b"" if omitted else result.body,
        body_omitted=omitted,
    )


@functools.lru_cache(maxsize=256)
def replay_header_names(replay_headers: tuple[str, ...], body_kept: bool) -> frozenset[str]:
    """The answer headers kept for replays, lower-cased: `replay_headers`, always
    the `Content-Type` (SPEC 2: a replay has the answer's content type, whatever
    the destination lists), and with a stored body its `Content-Encoding`, without
    which a gzip body cannot be read (an omitted body is replayed empty, so
    without it)."""
    names = frozenset(name.lower() for name in replay_headers) | {"content-type"}
    return (names | {"content-encoding"}) if body_kept else (names - {"content-encoding"})
