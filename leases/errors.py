"""The lease module's one exception root and the typed errors callers branch on."""

from __future__ import annotations

from .reasons import Reason


class LeaseError(Exception):
    """Root of every error the lease module raises on purpose.

    `reason` is the contract's reason code (see SPEC 2 step 6 and 3).
    """

    reason: str = "lease_error"

    def __init__(self, message: str, *, reason: str | None = None) -> None:
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class LeaseHeld(LeaseError):
    """The job is claimed and its lease has not expired.

    `current_generation` is the holder's generation: a worker whose claim
    succeeded but whose answer was lost sees its own `owner` here and can go on
    with that generation instead of idling until the lease runs out.
    """

    reason = Reason.LEASE_HELD

    def __init__(
        self,
        job_id: str,
        owner: str,
        expires_in: float,
        current_generation: int | None = None,
    ) -> None:
        super().__init__(f"job {job_id!r} is held by {owner!r} for {expires_in:.3f}s more")
        self.job_id = job_id
        self.owner = owner
        self.expires_in = expires_in
        self.current_generation = current_generation


class JobCompleted(LeaseError):
    """The job is done and can never be claimed again; `current_generation`: the
    generation that completed it, where known."""

    reason = Reason.JOB_COMPLETED

    def __init__(self, job_id: str, current_generation: int | None = None) -> None:
        super().__init__(f"job {job_id!r} is completed")
        self.job_id = job_id
        self.current_generation = current_generation


class LeaseLost(LeaseError):
    """A renewal, completion or release found the lease no longer held.

    `reason` is one of lease_not_held, stale_generation, unknown_generation,
    job_completed, lease_expired, owner_mismatch; or store_unavailable when
    `hold()` could not reach the store before the worker's own deadline.
    """

    def __init__(
        self,
        job_id: str,
        generation: int,
        reason: str,
        *,
        current_generation: int | None = None,
    ) -> None:
        super().__init__(
            f"lease on {job_id!r} generation {generation} lost: {reason}", reason=reason
        )
        self.job_id = job_id
        self.generation = generation
        self.current_generation = current_generation


def refused(job_id: str, generation: int, reason: str, current_generation: int | None) -> LeaseLost:
    """The LeaseLost a backend raises when renew/complete/release is refused."""
    return LeaseLost(job_id, generation, reason, current_generation=current_generation)


class StoreUnavailable(LeaseError):
    """The store could not be reached or failed; the operation's outcome is unknown
    only for the caller: the store either applied it whole or not at all.

    `status`: the HTTP status of the answer the HTTP lease store could not use (a
    503, or a 401/403 for a wrong lease token: the configuration, not an outage);
    None when nothing answered, and for the database stores."""

    reason = Reason.STORE_UNAVAILABLE
    status: int | None = None

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class ForeignTables(LeaseError):
    """Tables of sinkgate's names that no sinkgate release recorded: refused at open,
    left unchanged (`CREATE TABLE IF NOT EXISTS` would take them as they are)."""

    def __init__(self, component: str, tables: list[str]) -> None:
        super().__init__(
            f"table{'s' * (len(tables) > 1)} {', '.join(tables)} already in this database "
            f"(and search_path schema), not made by sinkgate: the {component} schema is not "
            "recorded in sinkgate_schema. Give sinkgate a database or schema of its own"
        )
        self.component = component
        self.tables = tables


class SchemaTooNew(LeaseError):
    """The database was written by a newer release: refused at open, left unchanged."""

    def __init__(self, component: str, found: int, supported: int) -> None:
        super().__init__(
            f"database schema {component} v{found} is newer than this sinkgate "
            f"(v{supported}): run the release that wrote it"
        )
        self.component = component
        self.found = found
        self.supported = supported
