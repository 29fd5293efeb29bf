"""The write route: parse -> decide and reserve (one transaction) -> forward -> record.

`/to/{destination}/{path}` is dispatched by a middleware on the raw request
target, before aiohttp's router could normalise `..` segments away, so that
path checks see exactly what the worker sent.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple, NoReturn

import structlog
from aiohttp import web
from multidict import CIMultiDict

from gateway.config.model import Config, DestinationConfig
from gateway.config.reader import is_loopback
from gateway.errors import WORKER_CHALLENGE, Rejection
from gateway.http.auth import (
    NOT_LOOPBACK,
    authorization,
    bearer_matches,
    loopback_host,
    sent_for_a_page,
)
from gateway.http.bodies import BodyBudget, continue_if_expected, read_body
from gateway.http.problem import problem_response
from gateway.policy.decision import Forward, KeyRecord, Reject, Replay, WriteFacts
from gateway.policy.outcome import Answered, NotAnswered, not_sent
from gateway.policy.outcome import outcome as policy_outcome
from gateway.policy.records import Outcome, RejectionRecord, Verdict, WriteContext
from gateway.store.protocol import GroupDecisions, StartsDecisions, WriteStore
from gateway.telemetry import traces
from gateway.telemetry.logs import info_line
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.refusals import NAME_MAX, store_unavailable
from gateway.write.line import Checked, Decided, Sent, Written, line_fields, milliseconds
from gateway.write.prefer import (
    applied_wait,
    preference_without,
    wait_preference,
    whole_preferences,
)
from gateway.write.relay import close_stream as _close_stream
from gateway.write.relay import relay
from gateway.write.request import (
    Target,
    check_shape,
    checked_destination,
    raw_write_path,
    valid_fencing,
    write_facts,
)
from gateway.write.upstream import (
    ForwardFailed,
    SendFailure,
    TooLateToSend,
    UpstreamAnswer,
    Upstreams,
    forward_headers,
    upstream_url,
)
from gateway.write.waiting import Waiters, Woken
from gateway.write.woken import WokenDecisions
from leases.errors import StoreUnavailable
from leases.reasons import BEFORE_THE_FENCE, Reason

log = structlog.get_logger("gateway.write")

# Starts a woken write's decision, its verdict to be set on the future given.
StartWoken = Callable[[WriteFacts, WriteContext, Woken], object]

# What a worker whose keyed write timed out is told to expect (SPEC 2 step 8, SPEC 4).
UNKNOWN_UNTIL_RESOLVED = (
    "; the upstream may have acted on it, so the key's outcome is now unknown: a retry"
    " gets 409 outcome_unknown until an operator settles it (admin resolve)"
)


class WriteGateway:
    """Holds what the write route needs; one per app."""

    def __init__(
        self,
        config: Config,
        store: WriteStore,
        upstreams: Upstreams,
        metrics: Metrics,
        waiters: Waiters | None = None,
    ) -> None:
        self.config = config
        # A listener address is read at start only (a reload cannot change it).
        self._loopback_only = is_loopback(config.listen[0])
        self.store = store
        self.upstreams = upstreams
        self.metrics = metrics
        self.waiters = waiters or Waiters(limit=config.max_waiting, metrics=metrics)
        # Woken writes decided by key in groups, where the store can (SQLite; on
        # PostgreSQL every decision rides a batch already). `start_woken`: how the
        # wake of a held write starts its decision, where it can (`_Deciding`).
        self.woken = WokenDecisions(store) if isinstance(store, GroupDecisions) else None
        self.start_woken: StartWoken | None = None
        if self.woken is not None:
            self.start_woken = self.woken.decide
        elif isinstance(store, StartsDecisions):
            self.start_woken = store.start_decision
        # Writes on the wire to each destination, and to all; writes waiting for
        # their decision (neither counts the other).
        self.in_flight: dict[str, int] = {}
        self.in_flight_total = 0
        self.deciding = 0
        # Shared between workers, the gauge is counted in their files: `_admit` and
        # `_release` move it. Otherwise it reads `in_flight` when scraped.
        self._shared_gauge = metrics.shared_directory is not None
        # Forwards on the wire, with what they forward: one cut at shutdown is named
        # in the `forwards_abandoned` line (its key reads `unknown`).
        self.forwards: dict[asyncio.Task[Any], WriteFacts] = {}
        # Those of them settling a key they are known to have sent nothing under
        # (refused as too late, or no connection made): one cut at shutdown is
        # named as such. Kept out of the ordinary forward's path, which never
        # enters it.
        self.unsent: set[asyncio.Task[Any]] = set()
        # Those of them cut at shutdown while settling their key, by attempt: what
        # they were recording (a release), recorded as the gateway stops
        # (`record_cut`), and whether it counts among the upstream outcomes. One cut
        # on the wire is not among them: it may still be under way at its upstream,
        # so its key stays in flight, and its job's newer generations barred, until
        # its deadlines, as for a gateway that died.
        self.cut: dict[str, _Cut] = {}
        self.body_budget = BodyBudget(config.max_body_buffer)
        self.replays = Replays()
        for name in config.destinations:
            self.track(name)

    def track(self, name: str) -> None:
        """Count `name`'s writes in flight; the gauge reads the count when scraped,
        so a write pays no metric update for it (but with metrics shared between
        workers, where a scrape cannot call into the other workers). Its other
        series start at 0. Once per destination configured (at start, or added)."""
        self.metrics.destination(name)
        self.in_flight.setdefault(name, 0)  # a removed one's writes may still be out
        in_flight = self.in_flight
        gauge = self.metrics.in_flight.labels(name)
        if self._shared_gauge:
            return  # there at 0 all the same: the child is made
        gauge.set_function(lambda: in_flight[name])

    def _untrack(self, name: str) -> None:
        """A destination a reload removed: no gauge of its writes in flight any
        more (those still out are counted on, and settle as they would)."""
        self.metrics.destinations.discard(name)
        self.metrics.forget(self.metrics.in_flight, name)

    async def apply(self, config: Config) -> None:
        """A reload's config: pools for added and changed destinations, counts for
        new ones. A write already past its checks keeps the destination it had."""
        await self.upstreams.replace(config.destinations)
        running = self.config.destinations
        for name in running.keys() - config.destinations.keys():
            self._untrack(name)
        for name in config.destinations.keys() - running.keys():
            self.track(name)
        self.config = config

    async def handle(
        self, request: web.Request, target: Target, *, continued: bool = False
    ) -> web.StreamResponse:
        """The write's answer, by SPEC 2's steps. `continued`: an `Expect:
        100-continue` was already answered (by the application's router); otherwise
        it is answered here, only once steps 1-4 passed, so that a refused write's
        body is never sent."""
        started = time.perf_counter()
        facts: WriteFacts | None = None  # known once step 5 passed
        try:
            check_shape(request.headers)
            destination = checked_destination(request, target, self.config.destinations)
            await self._authorize(request, destination)
            checked = await self._checked(request, target, destination, continued)
            facts = checked.facts
            written = await self._write(request, destination, checked)
        except Rejection as rejection:
            written = self._refused(request, rejection, facts)
        if written.decision != "replayed":  # a replay's headers say it already
            _preference_applied(written.response, written.decided)
        total_ms = milliseconds(time.perf_counter() - started)
        self._log(request, target, facts, written, total_ms)
        return written.response

    def _refused(
        self, request: web.Request, rejection: Rejection, facts: WriteFacts | None
    ) -> Written:
        """The problem answer of a write refused outside the store's decision."""
        if facts is None:  # refused before its facts: what of the headers is valid
            job_id, generation, _, _ = valid_fencing(request.headers)
            # SPEC 2: the members "where known", as the rejection-log row has them
            for name, value in (("job_id", job_id), ("generation", generation)):
                if value is not None:
                    rejection.members.setdefault(name, value)
        self.metrics.tally.add(self.metrics.child(self.metrics.rejections, rejection.reason))
        rejection_id = rejection.members.get("rejection_id")
        return Written(
            problem_response(rejection),
            "rejected",
            rejection.reason,
            rejection_id,
            line_extra=rejection.line_extra,
        )

    def _log(
        self,
        request: web.Request,
        target: Target,
        facts: WriteFacts | None,
        written: Written,
        total_ms: float,
    ) -> None:
        """Count the write and write its one line (SPEC 10)."""
        who: tuple[str | None, int | None, str | None]
        if facts is not None:
            who = (facts.job_id, facts.generation, facts.key)
        else:
            job_id, generation, _, key = valid_fencing(request.headers)
            who = (job_id, generation, key)
        # Only configured names become label values: `/to/<anything>` must not
        # grow the metric series without bound; an unknown one is cut in the line
        # (and the span), as in write_refused.
        if target.destination in self.in_flight:
            label = shown = target.destination
        else:
            label, shown = "(unknown)", target.destination[:NAME_MAX]
        metrics = self.metrics
        metrics.tally.add(metrics.child(metrics.writes, label, written.decision))
        if (
            facts is None
            and written.rejection_id is None
            and written.reason in BEFORE_THE_FENCE  # not the store failing to log one
        ):
            # Refused before the fence and kept nowhere else (not a missing token
            # or fencing header, which the rejection log has): said with the address.
            self.metrics.refusals.note(
                written.reason, target.destination, request.method, request.remote
            )
        fields = line_fields(shown, request.method, *who, written, total_ms)
        if traces.TRACER is not None:
            traces.annotate(fields)  # the span gets the fields, the line the trace ids
        info_line(log, "write_decision", fields, owned=True)

    # --- steps 1-5: request shape, nothing stored unless recorded as a rejection ---------

    async def _authorize(self, request: web.Request, destination: DestinationConfig) -> None:
        tokens = destination.worker_tokens
        if tokens is None and self._loopback_only and not loopback_host(request.host):
            # No token to tell a worker from a rebound page (whose name it sends).
            rejection = Rejection(
                Reason.UNAUTHORIZED, NOT_LOOPBACK, status=403, destination=destination.name
            )
        elif sent_for_a_page(request.headers):
            # A page in a browser (a DNS rebinding makes it same-origin, custom
            # headers and all) writing with a lease it claimed or read.
            rejection = Rejection(
                Reason.UNAUTHORIZED,
                "a request a browser sends for a web page may not write through the gateway",
                status=403,
                destination=destination.name,
            )
        elif tokens is None or bearer_matches(authorization(request.headers), tokens):
            return
        else:
            rejection = Rejection(
                Reason.UNAUTHORIZED,
                "missing or wrong worker token",
                headers=WORKER_CHALLENGE,
                destination=destination.name,
            )
        await self._record(request, rejection, destination.name, None)
        raise rejection

    async def _checked(
        self,
        request: web.Request,
        target: Target,
        destination: DestinationConfig,
        continued: bool,
    ) -> Checked:
        """The body read (step 4's `100 Continue` sent first) and step 5's facts."""
        name = destination.name
        if not continued:
            await continue_if_expected(request, destination.max_body, destination=name)
        body = await read_body(
            request, destination.max_body, budget=self.body_budget, destination=name
        )
        body_digest = hashlib.sha256(body).digest()  # once: fingerprint and log
        context = WriteContext(
            remote=request.remote, body_sha256=body_digest.hex(), body_bytes=len(body)
        )
        try:
            facts = write_facts(request, target, destination, body_digest)
        except Rejection as rejection:
            await self._record(request, rejection, name, context)
            raise
        return Checked(facts, context, body)

    # --- steps 6-8 ----------------------------------------------------------------------

    async def _write(
        self, request: web.Request, destination: DestinationConfig, checked: Checked
    ) -> Written:
        """Decide (step 6), then answer the refusal or replay, or forward (7-8)."""
        facts = checked.facts
        if self._full(destination):  # refused before anything is reserved
            raise _overloaded(destination, "too many writes in flight")
        decided = await self._decide_or_wait(request, destination, checked)
        verdict = decided.verdict
        decision = verdict.decision
        if isinstance(decision, Reject):
            self.metrics.tally.add(self.metrics.child(self.metrics.rejections, decision.reason))
            rejection = _reject(decision, facts, verdict.rejection_id)
            return Written(
                problem_response(rejection),
                "rejected",
                decision.reason,
                verdict.rejection_id,
                decided=decided,
            )
        if isinstance(decision, Replay):
            self.metrics.tally.add(self.metrics.child(self.metrics.rejections, Reason.DUPLICATE))
            response = self.replays.response(decision, decided.prefer_wait)  # says the wait
            return Written(response, "replayed", Reason.DUPLICATE, decided=decided)
        assert isinstance(decision, Forward) and verdict.attempt is not None
        try:
            await self._admit(destination, facts, decided)
        except Rejection as rejection:  # the wire filled up
            return self._refused(request, rejection, facts)._replace(decided=decided)
        try:
            return await self._forward_shielded(request, destination, checked, decided)
        except _TooLate as rejection:
            # With its decision: the line has the store's time (a slow store is why
            # a verdict comes too late), the answer the wait applied.
            return self._refused(request, rejection, facts)._replace(decided=decided)
        finally:
            self._release(destination)

    async def _decide(
        self,
        destination: DestinationConfig,
        facts: WriteFacts,
        context: WriteContext,
        woken: bool = False,
    ) -> Decided:
        """Step 6 in the store, timed; an unreachable store is a rejection. Counted
        among the writes waiting for their decision (at most `[server]
        max_deciding`): they are not on the wire, so they take no place of
        `max_in_flight`, but their queue is bounded all the same. A write held
        under `Prefer: wait` is counted only while it is being decided. `woken`:
        a held write decided again, with the others of its key when it can be."""
        if self.deciding >= self.config.max_deciding:
            raise _overloaded(destination, "too many writes waiting for their decision")
        self.deciding += 1
        store_started = time.perf_counter()
        verdict: Verdict | None
        try:
            if woken and self.woken is not None:
                verdict = await self.woken.decide(facts, context)
            else:
                verdict = await self.store.decide_write(facts, context)
        except StoreUnavailable as exc:
            raise self._unavailable(facts, exc) from exc
        finally:
            store_ms = self._decided(store_started)
        assert verdict is not None  # None only for a dropped decision: cancelled here
        return Decided(verdict, store_ms, asked_at=store_started)

    def _decided(self, store_started: float) -> float:
        """A decision begun at `store_started` (perf_counter) is over: no longer
        counted among those being decided, timed. Its time in milliseconds."""
        self.deciding -= 1
        elapsed = time.perf_counter() - store_started
        metrics = self.metrics
        metrics.tally.observe(metrics.child(metrics.store_latency, "decide"), elapsed)
        return milliseconds(elapsed)

    def _unavailable(self, facts: WriteFacts, exc: StoreUnavailable) -> Rejection:
        """The refusal of a write the store could not decide: the driver's words in
        the log, for the operator, not in the answer (they name the database, its
        tables and columns, to anybody who can reach the write listener)."""
        self.metrics.store_errors.labels("decide").inc()
        store_unavailable("decide", str(exc), **_write_members(facts))
        return Rejection(Reason.STORE_UNAVAILABLE, STORE_DOWN_DETAIL, **_write_members(facts))

    async def _forward_shielded(
        self,
        request: web.Request,
        destination: DestinationConfig,
        checked: Checked,
        decided: Decided,
    ) -> Written:
        """Forward under a shield: a worker that goes away, or a handler cancelled at
        shutdown, cannot erase what the destination did. An answer too long to
        buffer is relayed once its outcome is recorded."""
        attempt = decided.verdict.attempt
        assert attempt is not None
        task = asyncio.ensure_future(self._forward(request, destination, checked, attempt, decided))
        self.forwards[task] = checked.facts
        task.add_done_callback(lambda done: self.forwards.pop(done, None))
        try:
            answer, reason, sent = await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(_close_stream)  # nobody will relay it
            raise
        if isinstance(answer, UpstreamAnswer):
            _preference_applied(answer, decided)  # the outcome is recorded: only relayed
            relayed = await relay(request, answer)
            answer = relayed.response
            sent = sent._replace(
                relayed_bytes=relayed.relayed_bytes, relay_error=relayed.relay_error
            )
        return Written(answer, "forwarded", reason, decided=decided, attempt=attempt, sent=sent)

    async def _decide_or_wait(
        self, request: web.Request, destination: DestinationConfig, checked: Checked
    ) -> Decided:
        """Step 6's decision; under `Prefer: wait`, a refusal for what is still in
        flight is held and decided again as it settles (`gateway.write.waiting`)."""
        facts, context = checked.facts, checked.context
        prefer = request.headers.get("Prefer")
        cap = (
            0
            if prefer is None
            else applied_wait(
                wait_preference(request.headers.getall("Prefer")), destination.max_wait
            )
        )
        if cap == 0:
            return await self._decide(destination, facts, context)
        deciding = _Deciding(self, destination, facts, context)
        try:
            waited = await self.waiters.decide(
                facts, cap, deciding, lambda: request.transport is None, starter=deciding
            )
        except Rejection as rejection:  # the store failed, or too many being decided
            _say_applied(rejection, cap)
            raise
        return Decided(
            waited.verdict,
            deciding.store_ms,
            prefer_wait=cap if waited.applied else None,
            wait=waited.result,
            waited_ms=None if waited.result is None else milliseconds(waited.seconds),
            asked_at=deciding.asked_at,
        )

    @contextmanager
    def _sending_nothing(
        self, facts: WriteFacts, decided: Decided, *, counted: bool = False
    ) -> Iterator[None]:
        """Within a forward's task, the key of a request known to have sent nothing
        being settled: a shutdown that cuts the forward here (`CancelledError`)
        leaves it in `unsent`, for the `forwards_abandoned` line to say so, and in
        `cut` with the outcome it was settling, to be recorded as the gateway stops
        (again, if the cut call had reached the store: the same outcome twice is
        once); `counted`: among the upstream outcomes."""
        task = asyncio.current_task()
        assert task is not None
        self.unsent.add(task)
        try:
            yield
        except asyncio.CancelledError:
            # Read by the line once the task is done, then forgotten with it.
            attempt = decided.verdict.attempt
            assert attempt is not None
            self.cut[attempt] = _Cut(facts, not_sent(_resends_unknown(decided)), counted)
            raise
        except BaseException:
            self.unsent.discard(task)
            raise
        self.unsent.discard(task)

    async def _not_sent(self, facts: WriteFacts, decided: Decided) -> None:
        """Settle the reservation of a forward verdict that will not be sent, and
        wake what waits on it."""
        attempt = decided.verdict.attempt
        assert attempt is not None
        await self._record_outcome(facts, attempt, not_sent(_resends_unknown(decided)))
        self.waiters.settled(facts.destination, facts.key, facts.job_id)

    async def _refuse_late(self, facts: WriteFacts, decided: Decided) -> NoReturn:
        """Refuse a write whose verdict came too late to be sent (`_send_by`)."""
        with self._sending_nothing(facts, decided):
            await self._not_sent(facts, decided)
        # Not `decide`: the store answered, only too slowly for this destination.
        self.metrics.store_errors.labels("decide_late").inc()
        store_unavailable(
            "decide",
            "the verdict came after the destination's timeout",
            **_write_members(facts),
            key=facts.key,  # its write_decision line's, to find the two together
        )
        late = _TooLate(Reason.STORE_UNAVAILABLE, TOO_LATE_DETAIL, **_write_members(facts))
        late.line_extra = {"too_late": True}
        raise late

    def _full(self, destination: DestinationConfig) -> bool:
        """Whether `max_in_flight` writes are on the wire already (to `destination`,
        or to all destinations)."""
        return (
            self.in_flight[destination.name] >= destination.max_in_flight
            or self.in_flight_total >= self.config.max_in_flight
        )

    async def _admit(
        self, destination: DestinationConfig, facts: WriteFacts, decided: Decided
    ) -> None:
        """Count a reserved write as on the wire; if the wire filled up while it was
        decided, settle its reservation (it was never sent) and refuse it."""
        if self._full(destination):
            await self._not_sent(facts, decided)
            raise _overloaded(destination, "too many writes in flight")
        name = destination.name
        self.in_flight[name] += 1
        self.in_flight_total += 1
        if self._shared_gauge:
            self.metrics.child(self.metrics.in_flight, name).inc()

    def _release(self, destination: DestinationConfig) -> None:
        self.in_flight[destination.name] -= 1
        self.in_flight_total -= 1
        if self._shared_gauge:
            self.metrics.child(self.metrics.in_flight, destination.name).dec()

    async def _forward(
        self,
        request: web.Request,
        destination: DestinationConfig,
        checked: Checked,
        attempt: str,
        decided: Decided,
    ) -> tuple[web.StreamResponse | UpstreamAnswer, str | None, Sent]:
        """Forward and record the outcome: the answer (one too long to buffer comes
        back as the `UpstreamAnswer` still to be relayed), the refusal's reason
        when the forward failed, and what was sent."""
        facts = checked.facts
        url = upstream_url(destination, facts.path, facts.query)
        headers = forward_headers(request.headers, destination)
        # Checked here, after the task's start, so as not to open a connection for
        # nothing; and again where the request's first byte reaches the socket
        # (`send_by`), which aiohttp does from a task of its own: a turn of a busy
        # loop, a pause or a connection still being made after this check could
        # still put the write on the wire past its barrier.
        send_by = _send_by(destination, decided)
        if time.perf_counter() >= send_by:
            await self._refuse_late(facts, decided)
        sent_at = time.perf_counter()
        result: Answered | NotAnswered
        unsent = False
        try:
            answer = await self.upstreams.send(
                destination,
                facts.method,
                url,
                headers,
                checked.body,
                destination.max_replay_body,
                until=decided.asked_at + destination.timeout,
                send_by=send_by,
            )
            result = Answered(
                answer.status, answer.headers.items(), answer.body, answer.rest is not None
            )
        except asyncio.CancelledError:
            # Cut at shutdown on the wire: its key ends `unknown`, at its deadline (it
            # may still be under way at its upstream, so nothing is recorded now).
            self.metrics.child(self.metrics.upstream_outcomes, destination.name, "unknown").inc()
            raise
        except TooLateToSend:
            await self._refuse_late(facts, decided)
        except ForwardFailed as failure:
            result = NotAnswered(failure.failure.maybe_sent)
            unsent = not failure.failure.maybe_sent
            detail = failure.detail
            if (
                failure.failure is SendFailure.TIMEOUT
                and facts.key
                and not facts.upstream_idempotent
            ):
                detail += UNKNOWN_UNTIL_RESOLVED
            rejection = Rejection(str(failure.failure), detail, **_write_members(facts))
        outcome = policy_outcome(result, destination, resends_unknown=_resends_unknown(decided))
        upstream_s = time.perf_counter() - sent_at
        metrics = self.metrics
        metrics.child(metrics.upstream_latency, destination.name).observe(upstream_s)
        stored: bool | None = None
        try:
            if unsent:
                with self._sending_nothing(facts, decided, counted=True):
                    stored = await self._record_outcome(facts, attempt, outcome)
            else:
                stored = await self._record_outcome(facts, attempt, outcome)
        finally:
            # Counted as the key ends: an outcome the store did not take leaves it to
            # read `unknown` (one in `cut` is counted as it is recorded again).
            if stored is not None:
                metrics.child(metrics.upstream_outcomes, destination.name, outcome.kind).inc()
            elif attempt not in self.cut:
                metrics.child(metrics.upstream_outcomes, destination.name, "unknown").inc()
        recorded = bool(stored)
        self.waiters.settled(facts.destination, facts.key, facts.job_id)
        upstream_ms = milliseconds(upstream_s)
        if isinstance(result, NotAnswered):
            sent = Sent(upstream_ms, outcome.kind, recorded)
            return problem_response(rejection), rejection.reason, sent
        sent = Sent(upstream_ms, outcome.kind, recorded, upstream_status=answer.status)
        if answer.rest is not None:
            return answer, None, sent
        return (
            web.Response(status=answer.status, body=answer.body, headers=answer.headers),
            None,
            sent,
        )

    async def record_cut(self, within: float) -> None:
        """Record what the forwards cut at shutdown while settling a key they sent
        nothing under were recording (`cut`): their keys released, so a retry is
        forwarded now, not after their reservations' deadlines (or, for a re-send
        of a key whose outcome was unknown already, `unknown` again). At most
        `within` seconds: a store that does not answer leaves them to their
        deadlines, as before (they read `unknown` then)."""
        cut, self.cut = self.cut, {}
        if not cut:
            return
        recording = {
            a: asyncio.ensure_future(self.store.record_outcome(c.facts, a, c.outcome))
            for a, c in cut.items()
        }
        _, late = await asyncio.wait(recording.values(), timeout=within)
        for task in late:
            task.cancel()
        metrics = self.metrics
        failed: list[tuple[_Cut, BaseException | None]] = []
        for attempt, task in recording.items():
            c = cut[attempt]
            # Taken: True or False (recorded, or already by the call the cut cut short).
            error = None if task in late or task.cancelled() else task.exception()
            taken = task.done() and not task.cancelled() and error is None
            if not taken:
                failed.append((c, error))
            if c.counted:  # not a verdict refused as too late: an upstream outcome
                kind = c.outcome.kind if taken else "unknown"
                metrics.child(metrics.upstream_outcomes, c.facts.destination, kind).inc()
        named = [named_write(c.facts, outcome=c.outcome.kind) for c, _ in failed]
        line = log.warning if failed else log.info
        line(
            "abandoned_recorded",
            count=len(cut),
            recorded=len(cut) - len(failed),
            not_recorded=len(failed),
            error=next((str(e) for _, e in failed if e is not None), None),
            writes=named[:ABANDONED_NAMED] or None,
        )

    async def _record_outcome(
        self, facts: WriteFacts, attempt: str, outcome: Outcome
    ) -> bool | None:
        """Whether `outcome` is now the key's: False when another attempt holds the
        reservation, None when the store failed."""
        try:
            held = await self.store.record_outcome(facts, attempt, outcome)
        except StoreUnavailable as exc:
            # The reservation stays in flight until its deadline, then reads as
            # `unknown`: safe, never a second forward.
            self.metrics.store_errors.labels("record").inc()
            log.error("outcome_not_recorded", job_id=facts.job_id, key=facts.key, error=str(exc))
            return None
        if not held:
            log.warning(
                "reservation_taken_over",
                job_id=facts.job_id,
                key=facts.key,
                attempt=attempt,
                outcome=outcome.kind,
            )
        return held

    async def _record(
        self,
        request: web.Request,
        rejection: Rejection,
        destination: str | None,
        context: WriteContext | None,
    ) -> None:
        """Log a rejection of steps 3 and 5 before its answer leaves."""
        job_id, generation, owner, key = valid_fencing(request.headers)
        record = RejectionRecord(
            reason=rejection.reason,
            detail=rejection.detail,
            destination=destination,
            method=request.method,
            path=raw_write_path(request.raw_path),
            job_id=job_id,
            generation=generation,
            owner=owner,
            idempotency_key=key,
            remote=request.remote,
            body_sha256=None if context is None else context.body_sha256,
            body_bytes=None if context is None else context.body_bytes,
        )
        try:
            rejection.members["rejection_id"] = await self.store.record_rejection(record)
        except StoreUnavailable as exc:
            self.metrics.store_errors.labels("record_rejection").inc()
            store_unavailable("record_rejection", str(exc))
            detail = "the store could not record this refusal; retry"
            raise Rejection(Reason.STORE_UNAVAILABLE, detail, destination=destination) from exc


# What a worker is told when the store could not decide its write.
STORE_DOWN_DETAIL = "the store could not decide this write; nothing was forwarded: retry"
# ... and when the verdict came too late to be sent within the destination's timeout.
TOO_LATE_DETAIL = (
    "the store's verdict came too late to send this write within the destination's "
    "timeout; nothing was forwarded: retry"
)
# A forward is sent only with at least this much of the destination's timeout left
# (half of a timeout shorter than twice this).
MIN_FORWARD_S = 0.05


class _TooLate(Rejection):
    """The refusal of a forward verdict that came too late to be sent (`_send_by`):
    raised out of the forward's task, answered with the write's decision."""


class _Deciding:
    """The decisions of one write under `Prefer: wait` (`Waiters.decide`). Called,
    it decides the write (the first time alone, then with the others of its key
    woken with it); as the waiter's `WokenStart`, the wake that woke it starts the
    decision (`start_woken`: in its key's group on SQLite, in the next batch on
    PostgreSQL), and the held write resumes once, with its verdict. Either way it is
    counted among the writes being decided (`max_deciding`; at the limit the wake
    does not start it, and the call refuses it as before). `store_ms`: the last
    decision's time, for the line."""

    __slots__ = (
        "_again",
        "_context",
        "_destination",
        "_facts",
        "_gateway",
        "_started_at",
        "asked_at",
        "store_ms",
    )

    def __init__(
        self,
        gateway: WriteGateway,
        destination: DestinationConfig,
        facts: WriteFacts,
        context: WriteContext,
    ) -> None:
        self._gateway = gateway
        self._destination = destination
        self._facts = facts
        self._context = context
        self._started_at = 0.0
        self._again = False  # decided once already: woken since
        self.store_ms = 0.0
        self.asked_at = 0.0  # the last decision's, as `Decided.asked_at`

    async def __call__(self) -> Verdict:
        decided = await self._gateway._decide(
            self._destination, self._facts, self._context, woken=self._again
        )
        self._again = True
        self.store_ms = decided.store_ms
        self.asked_at = decided.asked_at
        return decided.verdict

    def start(self, answer: Woken) -> bool:
        gateway = self._gateway
        start = gateway.start_woken
        if start is None or gateway.deciding >= gateway.config.max_deciding:
            return False
        self._started_at = self.asked_at = time.perf_counter()
        start(self._facts, self._context, answer)
        gateway.deciding += 1  # counted once started (`finish` or `abandon` counts it out)
        return True

    def finish(self, answer: Woken) -> Verdict:
        gateway = self._gateway
        try:
            verdict = answer.result()
        except StoreUnavailable as exc:
            raise gateway._unavailable(self._facts, exc) from exc
        finally:
            self.store_ms = gateway._decided(self._started_at)
        assert verdict is not None  # None only for a plain wake, or a dropped decision
        return verdict

    def abandon(self) -> None:
        self._gateway.deciding -= 1


# The writes a `forwards_abandoned` or `abandoned_recorded` line names at most (their
# count is always whole).
ABANDONED_NAMED = 100


def named_write(facts: WriteFacts, **extra: object) -> dict[str, object]:
    """A write as a shutdown's lines name it (`forwards_abandoned`,
    `abandoned_recorded`), with `extra`."""
    return {
        "destination": facts.destination,
        "job_id": facts.job_id,
        "generation": facts.generation,
        "key": facts.key,
        **extra,
    }


class _Cut(NamedTuple):
    """A forward cut at shutdown while settling a key it sent nothing under."""

    facts: WriteFacts
    outcome: Outcome
    counted: bool  # among the upstream outcomes (`sinkgate_upstream_outcomes_total`)


def _resends_unknown(decided: Decided) -> bool:
    """Whether the write re-sends a key whose earlier attempt's outcome is unknown
    (`upstream_idempotent`)."""
    decision = decided.verdict.decision
    return isinstance(decision, Forward) and decision.retry_of_unknown


def _send_by(destination: DestinationConfig, decided: Decided) -> float:
    """The latest `time.perf_counter` a forward verdict may be sent at: the barrier
    it set (and its reservation's deadline) count the destination's `timeout` from
    the store's clock when it decided, and a forward begun later could still be on
    the wire when a newer generation is let through (a slow or lost answer from
    the store, a paused process)."""
    timeout = destination.timeout
    return decided.asked_at + timeout - min(MIN_FORWARD_S, timeout / 2)


def _preference_applied(
    answer: web.StreamResponse | UpstreamAnswer, decided: Decided | None
) -> None:
    """SPEC 2: every answer to a write whose `Prefer: wait` was honoured says so,
    with whatever preferences the destination said it applied (a relayed or
    replayed answer may carry its own `Preference-Applied`): see `_add_applied`."""
    cap = None if decided is None else decided.prefer_wait
    if cap is not None and not (isinstance(answer, web.StreamResponse) and answer.prepared):
        _add_applied(answer.headers, cap)


def _say_applied(rejection: Rejection, cap: int) -> None:
    """A refusal raised after the wait was honoured (from the fence check on) says
    so, as every other answer of the write does (SPEC 2), and so does its line. A
    copy: `headers` may be a constant shared by rejections."""
    rejection.headers = {**rejection.headers, "Preference-Applied": f"wait={cap}"}
    rejection.line_extra = {"prefer_wait": cap, **(rejection.line_extra or {})}


def _add_applied(headers: CIMultiDict[str], cap: int) -> None:
    """The gateway's `wait=M` after the answer's own applied preferences, in place
    of a `wait` the upstream applied (it is sent `Prefer` as it came): one `wait`,
    the one this answer's worker waited by. A quoted value is one element, commas
    and all (`foo="a,wait=1"` is kept whole). Where theirs stops being a
    preference list, ours goes first: after it, no reader would find it."""
    theirs = preference_without(headers.getall("Preference-Applied", []), "wait")
    ours = f"wait={cap}"
    if all(whole_preferences(value, None) for value in theirs):
        headers["Preference-Applied"] = ", ".join([*theirs, ours])
    else:
        headers["Preference-Applied"] = ", ".join([ours, *theirs])


def _overloaded(destination: DestinationConfig, detail: str) -> Rejection:
    return Rejection(Reason.OVERLOADED, detail, destination=destination.name)


def _write_members(facts: WriteFacts) -> dict[str, Any]:
    return {
        "destination": facts.destination,
        "job_id": facts.job_id,
        "generation": facts.generation,
    }


def _reject(decision: Reject, facts: WriteFacts, rejection_id: int | None) -> Rejection:
    return Rejection(
        decision.reason,
        decision.detail,
        retry_after=decision.retry_after,
        current_generation=decision.current_generation,
        highest_generation=decision.highest_generation,
        rejection_id=rejection_id,
        **_write_members(facts),
    )


class Replays:
    """Replays of stored answers. The woken writes of one key replay the same
    stored record (one read for the group), each with the wait it was granted:
    the answer's headers are built once for that pair and copied for each."""

    __slots__ = ("_cap", "_headers", "_record")

    def __init__(self) -> None:
        self._record: KeyRecord | None = None
        self._cap: int | None = None
        self._headers: CIMultiDict[str] = CIMultiDict()

    def response(self, decision: Replay, prefer_wait: int | None) -> web.Response:
        """The replay of `decision`'s record; `prefer_wait`: the wait honoured,
        said in `Preference-Applied` with the record's own (`_add_applied`)."""
        record = decision.record
        if record is not self._record or prefer_wait != self._cap:
            self._headers = replay_headers(record, prefer_wait)
            self._record, self._cap = record, prefer_wait
        assert record.status is not None
        return web.Response(status=record.status, body=record.body, headers=self._headers)


def replay_headers(record: KeyRecord, prefer_wait: int | None) -> CIMultiDict[str]:
    """A replay's headers: the stored ones, marked, and the wait honoured."""
    headers: CIMultiDict[str] = CIMultiDict(record.headers)
    headers["Idempotent-Replayed"] = "true"
    if record.body_omitted:
        headers["Sinkgate-Replay-Body"] = "omitted"
    if prefer_wait is not None:
        _add_applied(headers, prefer_wait)
    return headers
