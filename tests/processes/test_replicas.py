"""Three real gateway processes on one PostgreSQL database (SPEC 9), traffic
round-robin: one lease winner, stale writes refused, the generation barrier and
idempotency keys held across replicas, the upstream a recording server here.

Each test starts `python -m gateway serve` three times on a fresh database, with
its own config files (SPEC 5) and free ports, and stops every process (SIGTERM,
exit 0) at the end. Nothing waits on a timer: readiness is polled, and the slow
upstream path answers when the test releases it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.harness import (
    RecordingUpstream,
    recording_upstream,
    spawn_serve,
    stop_serve,
    wait_until_ok,
    write_serve_config,
)
from tests.pg import fresh_database

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 20.0


@dataclass
class Replica:
    url: str
    process: asyncio.subprocess.Process
    log: Path


@dataclass
class Cluster:
    replicas: list[Replica]
    session: aiohttp.ClientSession
    upstream: RecordingUpstream

    def at(self, n: int) -> str:
        """Round-robin: request number `n` goes to replica n mod 3."""
        return self.replicas[n % len(self.replicas)].url

    async def lease_op(self, n: int, op: str, job: str, **body: Any) -> tuple[int, dict[str, Any]]:
        async with self.session.post(f"{self.at(n)}/leases/{job}/{op}", json=body) as resp:
            return resp.status, await resp.json(content_type=None)

    async def write(
        self, n: int, path: str, *, job: str, generation: int, key: str, owner: str | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        headers = {
            "Content-Type": "application/json",
            "Fencing-Job": job,
            "Fencing-Token": str(generation),
            "Idempotency-Key": key,
        }
        if owner is not None:
            headers["Fencing-Owner"] = owner
        async with self.session.post(
            f"{self.at(n)}/to/pay{path}", data=b'{"amount": 100}', headers=headers
        ) as resp:
            return resp.status, dict(resp.headers), await resp.read()


async def start_replica(directory: Path, store_url: str, upstream: str) -> Replica:
    config, url = write_serve_config(directory, store_url, upstream)
    log = directory / "serve.log"
    process = await spawn_serve(config, log)
    return Replica(url, process, log)


async def wait_ready(replica: Replica, session: aiohttp.ClientSession) -> None:
    """Poll /readyz (the store can take a write) until 200; fail if the process exits."""

    def exited() -> str | None:
        code = replica.process.returncode
        return None if code is None else f"replica exited {code}: {replica.log.read_text()}"

    await wait_until_ok(session, f"{replica.url}/readyz", exited=exited, within=START_TIMEOUT_S)


async def stop(replica: Replica) -> int:
    return await stop_serve(replica.process, STOP_TIMEOUT_S)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    async with (
        fresh_database() as store_url,
        recording_upstream() as upstream,
        aiohttp.ClientSession() as session,
    ):
        # All three start at once against the empty database: the schema lock
        # must let them create the tables without tripping over each other.
        replicas = list(
            await asyncio.gather(
                *(start_replica(tmp_path / f"r{n}", store_url, upstream.url) for n in range(3))
            )
        )
        try:
            await asyncio.gather(*(wait_ready(r, session) for r in replicas))
            yield Cluster(replicas, session, upstream)
        finally:
            upstream.release.set()
            codes = await asyncio.gather(*(stop(r) for r in replicas))
        assert codes == [0, 0, 0], [r.log.read_text()[-2000:] for r in replicas]


def rejected(result: tuple[int, dict[str, str], bytes]) -> str | None:
    return result[1].get("Sinkgate-Rejected")


# --- the tests ---------------------------------------------------------------------------------


async def test_competing_claims_through_three_replicas_have_one_winner(cluster: Cluster) -> None:
    for round_ in range(5):
        job = f"job-{round_}"
        results = await asyncio.gather(
            *(cluster.lease_op(n, "claim", job, owner=f"w{n}", ttl=30) for n in range(3))
        )
        winners = [body for status, body in results if status == 200]
        assert len(winners) == 1 and winners[0]["generation"] == 1
        losers = sorted(body["reason"] for status, body in results if status != 200)
        assert losers == ["lease_held", "lease_held"]
        # Every replica reads the same lease: one database, one answer.
        for n in range(3):
            async with cluster.session.get(f"{cluster.at(n)}/leases/{job}") as resp:
                assert (await resp.json())["owner"] == winners[0]["owner"]


async def test_a_stale_write_is_refused_by_every_replica(cluster: Cluster) -> None:
    status, first = await cluster.lease_op(0, "claim", "job-s", owner="a", ttl=30)
    assert status == 200 and first["generation"] == 1
    assert (await cluster.lease_op(1, "release", "job-s", owner="a", generation=1))[0] == 200
    status, second = await cluster.lease_op(2, "claim", "job-s", owner="b", ttl=30)
    assert status == 200 and second["generation"] == 2
    for n in range(3):
        late = await cluster.write(n, "/charge", job="job-s", generation=1, key=f"late-{n}")
        assert late[0] == 409 and rejected(late) == "stale_generation"
    fresh = await cluster.write(1, "/charge", job="job-s", generation=2, key="b-1", owner="b")
    assert fresh[0] == 201 and rejected(fresh) is None
    assert [
        (r.headers["Fencing-Token"], r.headers["Idempotency-Key"])
        for r in cluster.upstream.received
    ] == [("2", "b-1")]


async def test_the_generation_barrier_holds_across_replicas(cluster: Cluster) -> None:
    """Generation 1's slow write on replica 1 holds generation 2's write on replica 2
    (409 older_generation_in_flight) until the upstream has answered it."""
    upstream = cluster.upstream
    assert (await cluster.lease_op(0, "claim", "job-b", owner="a", ttl=30))[0] == 200
    slow = asyncio.create_task(
        cluster.write(0, "/slow/old", job="job-b", generation=1, key="old", owner="a")
    )
    await asyncio.wait_for(upstream.arrived.wait(), 10)
    # The worker of generation 1 lets go (as after a pause); generation 2 is claimed.
    assert (await cluster.lease_op(1, "release", "job-b", owner="a", generation=1))[0] == 200
    status, lease = await cluster.lease_op(2, "claim", "job-b", owner="b", ttl=30)
    assert status == 200 and lease["generation"] == 2
    held = await cluster.write(1, "/new", job="job-b", generation=2, key="new", owner="b")
    assert held[0] == 409 and rejected(held) == "older_generation_in_flight"
    assert 1 <= int(held[1]["Retry-After"]) <= 10
    assert [r.raw_path for r in upstream.received] == ["/api/slow/old"]
    upstream.release.set()
    assert (await slow)[0] == 201
    landed = await cluster.write(1, "/new", job="job-b", generation=2, key="new", owner="b")
    assert landed[0] == 201 and rejected(landed) is None
    assert [r.headers["Fencing-Token"] for r in upstream.received] == ["1", "2"]


async def test_one_key_sent_to_all_three_at_once_reaches_the_upstream_once(
    cluster: Cluster,
) -> None:
    assert (await cluster.lease_op(0, "claim", "job-k", owner="a", ttl=30))[0] == 200
    for round_ in range(5):
        key = f"pay-{round_}"
        results = await asyncio.gather(
            *(cluster.write(n, "/charge", job="job-k", generation=1, key=key) for n in range(3))
        )
        applied = [r for r in results if r[0] == 201 and "Idempotent-Replayed" not in r[1]]
        assert len(applied) == 1
        for other in results:
            if other is applied[0]:
                continue
            assert rejected(other) == "request_in_progress" or (
                other[0] == 201 and other[1]["Idempotent-Replayed"] == "true"
            ), other
        sent = [r for r in cluster.upstream.received if r.headers["Idempotency-Key"] == key]
        assert len(sent) == 1
        # Afterwards every replica replays the one stored answer.
        replays = await asyncio.gather(
            *(cluster.write(n, "/charge", job="job-k", generation=1, key=key) for n in range(3))
        )
        assert {(r[0], r[1]["Idempotent-Replayed"], r[2]) for r in replays} == {
            (201, "true", applied[0][2])
        }
    assert len(cluster.upstream.received) == 5
