"""Jobs (SPEC 4): `GET /admin/jobs/{job_id}`, the lease, the fence mark, the
attempts on the wire and the recent rejections of one job."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from gateway.admin import models
from gateway.admin.query import rfc3339, utc_time
from gateway.admin.rejections import rejection_model
from gateway.errors import Rejection
from gateway.http.schema import to_json
from gateway.store.protocol import AdminStore
from gateway.store.records import JobState
from leases.model import IDENT, expires_in
from leases.reasons import Reason


class JobsApi:
    """`GET /admin/jobs/{job_id}`."""

    def __init__(self, store: AdminStore) -> None:
        self._store = store

    async def get(self, request: web.Request) -> web.StreamResponse:
        job_id = request.match_info["job_id"]
        state = None
        if IDENT.fullmatch(job_id):
            state = await self._store.job_state(job_id)
        if state is None:
            raise Rejection(Reason.NOT_FOUND, "no lease, fence, attempt or rejection for this job")
        return web.json_response(job_view(state, self._store.clock()))


def job_view(state: JobState, now: float) -> dict[str, Any]:
    """`models.JobState`: the lease, the fence mark, attempts on the wire."""
    lease = state.lease
    return to_json(
        models.JobState(
            job_id=state.job_id,
            server_time=utc_time(now),
            lease=None
            if lease is None
            else models.JobLease(
                job_id=lease.job_id,
                owner=lease.owner,
                generation=lease.generation,
                state=str(lease.state),
                lease_until=utc_time(lease.lease_until),
                expires_in=expires_in(lease, now),
            ),
            highest_generation=state.highest_generation,
            in_flight=[
                models.InFlightAttempt(
                    attempt=a.get("attempt"),
                    generation=a.get("generation"),
                    destination=a.get("destination"),
                    key=a.get("key"),
                    started_at=rfc3339(a.get("started_at")),
                    deadline=rfc3339(a.get("deadline")),
                )
                for a in state.in_flight
            ],
            recent_rejections=[rejection_model(r) for r in state.recent_rejections],
        )
    )
