"""Reload without a restart (SPEC 5): SIGHUP or `POST /admin/reload` re-reads the
destination files and `[retention]`.

One `Reloader` per gateway process, so a parent running several processes only
has to pass the signal on. A reload validates every file first and changes
nothing if one is broken, logging each error exactly as `check-config` prints
it. Changes to `[server]`, `[store]` and `[admin]` need a restart: they are
logged as `reload_refused` and the rest goes ahead, also when one of their keys
fails only for this process's variables (refused with its error; a file error
there fails the reload as anywhere else). A write already past its
checks holds its destination as it was and finishes under it (see
`Upstreams.replace`); new writes see the new files.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

import structlog
from aiohttp import web

from gateway.admin.models import ReloadAnswer
from gateway.admin.query import only_params
from gateway.admin.session import operator_of
from gateway.config.keys import RELOADED, RESTART_ONLY
from gateway.config.model import (
    Config,
    DestinationConfig,
    Reread,
    operator_key,
    reread_config,
)
from gateway.config.notices import config_warnings
from gateway.config.reader import format_duration
from gateway.errors import ConfigError, Rejection, StoreUnavailable
from gateway.http.problem import problem_response
from gateway.http.schema import to_json
from gateway.telemetry.metrics import Metrics
from gateway.telemetry.tasks import watched
from leases.reasons import Reason

if TYPE_CHECKING:
    from gateway.write.route import WriteGateway

log = structlog.get_logger("gateway.reload")

# How often a reload the store could not audit is tried again, until it is.
AUDIT_RETRY_S = 5.0

# The store's `record_audit` verb, as the reloader calls it.
Audit = Callable[..., Awaitable[int]]


@dataclass(frozen=True, slots=True)
class Reloaded:
    """What one applied reload did."""

    destinations: tuple[str, ...]
    added: tuple[str, ...]
    changed: tuple[str, ...]
    removed: tuple[str, ...]
    refused: tuple[str, ...]  # keys whose change needs a restart


@dataclass(frozen=True, slots=True)
class Plan:
    """What a reload applies, worked out before anything changes (`plan_reload`)."""

    config: Config  # the running config with what may change live changed
    result: Reloaded
    retention: tuple[str, ...]  # "audit_ttl 1d -> 7d", for the audit row
    reread: Reread


def plan_reload(old: Config) -> Plan:
    """What a reload of `old`'s files applies as they are now; `ConfigError` if they
    do not load. Pure: the parent of `--workers N` works out the same as each worker,
    so that a worker it starts again serves what the others do."""
    reread = reread_config(old)
    new = reread.config
    destinations = _keep_unchanged(old.destinations, new.destinations)
    applied = replace(
        old,
        destinations=MappingProxyType(destinations),
        unread_files=new.unread_files,
        **{name: getattr(new, name) for name in RELOADED},
    )
    retention = tuple(
        f"{name} {format_duration(getattr(old, name))} -> {format_duration(getattr(new, name))}"
        for name in ("idempotency_ttl", "rejections_ttl", "audit_ttl")
        if getattr(new, name) != getattr(old, name)
    )
    result = _difference(old.destinations, destinations, _refused(old, reread))
    return Plan(applied, result, retention, reread)


class Reloader:
    """Re-reads the config files of `config` and applies what may change live."""

    def __init__(self, config: Config, metrics: Metrics) -> None:
        self.config = config
        self._metrics = metrics
        self._writes: WriteGateway | None = None
        self._audit: Audit | None = None
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[Any]] = set()
        # Applied reloads whose audit row the store did not take yet, oldest first,
        # and the task writing them once it does.
        self._unaudited: list[dict[str, Any]] = []
        self._audit_lock = asyncio.Lock()
        self._auditing: asyncio.Task[None] | None = None
        self.audit_retry_s = AUDIT_RETRY_S

    def attach(self, writes: WriteGateway, audit: Audit | None = None) -> None:
        """The write route whose destinations and pools a reload swaps, and the
        store verb each applied reload is recorded with (`record_audit`)."""
        self._writes = writes
        self._audit = audit

    async def reload(
        self,
        trigger: str,
        *,
        remote: str | None = None,
        operator: str | None = None,
        record: bool = True,
    ) -> Reloaded:
        """Apply the files as they are now; `ConfigError` (logged) if they do not load.
        `remote` and `operator` are who asked (the admin route's client and the name
        its token has), for the audit log; `record=False`: another worker of this
        gateway writes the reload's audit row and counts it in
        `sinkgate_reloads_total` (`on_relayed`)."""
        async with self._lock:  # one at a time: each compares with the last applied
            try:
                plan = plan_reload(self.config)
            except ConfigError as exc:
                for line in exc.errors:
                    log.error("reload_failed", trigger=trigger, error=line)
                if record:  # as below: each worker fails a relayed reload, one counts it
                    self._metrics.reloads.labels("failed").inc()
                raise
            result = plan.result
            if plan.reread.unread:
                errors = [line for e in plan.reread.unread for line in e.errors]
                log.warning(
                    "reload_refused", trigger=trigger, keys=list(result.refused), errors=errors
                )
            elif result.refused:
                log.warning("reload_refused", trigger=trigger, keys=list(result.refused))
            if self._writes is not None:
                await self._writes.apply(plan.config)
            self.config = plan.config
            self._applied(trigger, plan, operator, warn=record)
            if record:  # with --workers N, one reload is one count, as it is one row
                self._metrics.reloads.labels("applied").inc()
                await self._record(trigger, result, (remote, operator), plan.retention)
            return result

    def _applied(
        self, trigger: str, plan: Plan, operator: str | None, *, warn: bool = True
    ) -> None:
        """Log an applied reload; `warn`: with the config's warnings (a file added
        as Refunds.TOML, say), by one worker of `--workers N`, as it is audited."""
        result, applied = plan.result, plan.config
        for warning in config_warnings(applied) if warn else ():
            log.warning("config_warning", trigger=trigger, warning=warning)
        log.info(
            "reload_applied",
            trigger=trigger,
            destinations=list(result.destinations),
            added=list(result.added),
            changed=list(result.changed),
            removed=list(result.removed),
            idempotency_ttl_s=applied.idempotency_ttl,
            rejections_ttl_s=applied.rejections_ttl,
            audit_ttl_s=applied.audit_ttl,
            operator=operator,
        )

    async def record_applied(self, trigger: str, plan: Plan) -> None:
        """Log, count and record a reload this process started with already applied:
        the parent of `--workers N` applied a SIGHUP that no worker was there to take,
        and hands its `plan` to the next worker it starts."""
        self._applied(trigger, plan, None)
        self._metrics.reloads.labels("applied").inc()
        await self._record(trigger, plan.result, (None, None), plan.retention)

    async def _record(
        self,
        trigger: str,
        result: Reloaded,
        who: tuple[str | None, str | None],
        retention: tuple[str, ...],
    ) -> None:
        if self._audit is None:
            return
        note = "; ".join(
            f"{what} {', '.join(names)}"
            for what, names in (
                ("added", result.added),
                ("changed", result.changed),
                ("removed", result.removed),
                ("retention", retention),
                ("refused", result.refused),
            )
            if names
        )
        text = f"{trigger}: {note or 'no change'}"
        remote, operator = who
        entry: dict[str, Any] = {
            "action": "reload",
            "note": text,
            "remote": remote,
            "operator": operator,
        }
        self._unaudited.append(entry)
        if await self._write_unaudited():
            return
        # Applied all the same (the files are what they are): the row is written once
        # the store takes it, saying when the reload was applied.
        applied = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        entry["note"] = f"{text} (applied {applied}, recorded once the store was back)"
        if self._auditing is None or self._auditing.done():
            self._auditing = watched(self._retry_audit(), "reload-audit")

    async def _write_unaudited(self) -> bool:
        """Write the audit rows not written yet, oldest first; False if the store
        still refuses (they are kept for the next try)."""
        assert self._audit is not None
        async with self._audit_lock:
            while self._unaudited:
                try:
                    await self._audit(**self._unaudited[0])
                except StoreUnavailable as exc:
                    log.error("reload_not_audited", error=str(exc), pending=len(self._unaudited))
                    return False
                self._unaudited.pop(0)
            return True

    async def _retry_audit(self) -> None:
        while True:
            await asyncio.sleep(self.audit_retry_s)
            if await self._write_unaudited():
                log.info("reload_audited_late")
                return

    async def close(self) -> None:
        """Stop trying to audit; what is still unwritten is said in the log."""
        if self._auditing is not None:
            self._auditing.cancel()
            await asyncio.gather(self._auditing, return_exceptions=True)
        if self._unaudited:
            log.error("reloads_never_audited", notes=[e["note"] for e in self._unaudited])

    def on_signal(self) -> None:
        """SIGHUP: reload in the background (errors are logged by `reload`)."""
        self._in_background("sighup", record=True)

    def on_relayed(self) -> None:
        """`RELOAD_UNRECORDED` from the parent of `--workers N`: another worker
        reloaded (a SIGHUP, or `POST /admin/reload` with its operator) and writes
        the audit row and counts it; this one reloads and logs it, without a
        second row or count."""
        self._in_background("relayed", record=False)

    def _in_background(self, trigger: str, *, record: bool) -> None:
        task = watched(self._quiet(trigger, record), "reload")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _quiet(self, trigger: str, record: bool) -> None:
        try:
            await self.reload(trigger, record=record)
        except ConfigError:
            pass  # logged, and nothing changed

    async def handle(self, request: web.Request) -> web.StreamResponse:
        """`POST /admin/reload`: 200 with the destinations, or 400 `invalid_config`
        (`invalid_request` for a query parameter, as every admin route refuses
        one it does not know: nothing is reloaded)."""
        only_params(request.query, ())
        try:
            result = await self.reload(
                "admin", remote=request.remote, operator=operator_of(request)
            )
        except ConfigError as exc:
            return problem_response(
                Rejection(
                    Reason.INVALID_CONFIG,
                    exc.errors[0] if exc.errors else str(exc),
                    errors=list(exc.errors),
                )
            )
        return web.json_response(to_json(ReloadAnswer(True, list(result.destinations))))


def _refused(old: Config, reread: Reread) -> tuple[str, ...]:
    """The keys a restart would apply that this process's variables fail (an
    operator's it was started without, say), then those the files changed."""
    failed = [e.key for e in reread.unread]
    new = reread.config

    def changed(name: str) -> bool:
        if name == "admin_operators":  # a failing operator is named by its own key
            return _operators(new, failed) != _operators(old, failed)
        return bool(getattr(new, name) != getattr(old, name))

    changes = [key for name, key in RESTART_ONLY if name not in old.overridden and changed(name)]
    return tuple(dict.fromkeys([*failed, *changes]))


def _operators(config: Config, failed: list[str]) -> list[tuple[str, str]]:
    return [(n, t) for n, t in config.admin_operators if operator_key(n) not in failed]


def _keep_unchanged(
    old: Mapping[str, DestinationConfig], new: Mapping[str, DestinationConfig]
) -> dict[str, DestinationConfig]:
    """`new`, with the very objects of `old` where nothing changed (their pools stay)."""
    return {name: old[name] if old.get(name) == dest else dest for name, dest in new.items()}


def _difference(
    old: Mapping[str, DestinationConfig],
    new: Mapping[str, DestinationConfig],
    refused: tuple[str, ...],
) -> Reloaded:
    return Reloaded(
        destinations=tuple(sorted(new)),
        added=tuple(sorted(set(new) - set(old))),
        changed=tuple(sorted(n for n in new if n in old and old[n] is not new[n])),
        removed=tuple(sorted(set(old) - set(new))),
        refused=refused,
    )
