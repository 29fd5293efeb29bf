"""The SQLite lease store across OS processes: atomic claims, durable generations.

Other processes sharing the file are the case `BEGIN IMMEDIATE` exists for; a
crash (SIGKILL) right after a claim returned must not let a generation be reused.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import signal
import sys
import textwrap
import time
from pathlib import Path

import pytest

from leases import LeaseHeld
from leases.sqlite import SQLiteLeaseStore

PROCESSES = 4
ROUNDS = 100
TTL = 60.0
PATIENCE = 60.0


def _claimer(path: str, index: int, barrier: object, results: object) -> None:
    """One competing process: every round, wait for the others, then claim."""
    asyncio.run(_claim_rounds(path, index, barrier, results))


async def _claim_rounds(path: str, index: int, barrier: object, results: object) -> None:
    won: list[int] = []
    store = await SQLiteLeaseStore.open(path)
    try:
        for round_no in range(ROUNDS):
            # Blocking on purpose: nothing else runs on this loop, and releasing all
            # four processes from one barrier is what makes the claims collide.
            barrier.wait(timeout=PATIENCE)  # type: ignore[attr-defined]
            try:
                await store.claim(f"race-{round_no}", owner=f"proc-{index}", ttl=TTL)
            except LeaseHeld:
                continue
            won.append(round_no)
    finally:
        await store.close()
    results.put((index, won))  # type: ignore[attr-defined]


@pytest.mark.slow
def test_four_processes_claim_one_job_exactly_one_wins(tmp_path: Path) -> None:
    """4 processes, released together by a barrier, claim the same never-seen job
    in each of 100 rounds: every round has exactly one winner, generation 1."""
    path = str(tmp_path / "leases.db")
    asyncio.run(_create(path))  # schema first, so the race is on claims only
    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(PROCESSES)
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_claimer, args=(path, i, barrier, results)) for i in range(PROCESSES)
    ]
    for proc in procs:
        proc.start()
    try:
        wins = dict(results.get(timeout=PATIENCE) for _ in procs)
    finally:
        for proc in procs:
            proc.join(timeout=PATIENCE)
            if proc.is_alive():
                proc.kill()
    assert [proc.exitcode for proc in procs] == [0] * PROCESSES

    winners_per_round = {r: [i for i, won in wins.items() if r in won] for r in range(ROUNDS)}
    assert {r: len(w) for r, w in winners_per_round.items()} == dict.fromkeys(range(ROUNDS), 1)
    stored = asyncio.run(_owners_and_generations(path))
    assert stored == {f"race-{r}": (f"proc-{w[0]}", 1) for r, w in winners_per_round.items()}
    # the race was real: more than one process won some rounds
    assert sum(1 for won in wins.values() if won) > 1


async def _create(path: str) -> None:
    store = await SQLiteLeaseStore.open(path)
    await store.close()


async def _owners_and_generations(path: str) -> dict[str, tuple[str, int]]:
    async with await SQLiteLeaseStore.open(path) as store:
        out = {}
        for r in range(ROUNDS):
            lease = await store.get(f"race-{r}")
            assert lease is not None
            out[lease.job_id] = (lease.owner, lease.generation)
        return out


async def test_generations_survive_a_reopen(tmp_path: Path) -> None:
    """Close and reopen the file: the generation carries on from where it was."""
    path = tmp_path / "leases.db"
    async with await SQLiteLeaseStore.open(path) as store:
        for _ in range(3):
            lease = await store.claim("job-1", owner="worker-a", ttl=TTL)
            await store.release(lease)
        assert lease.generation == 3
    async with await SQLiteLeaseStore.open(path) as store:
        kept = await store.get("job-1")
        assert (kept.generation, kept.state, kept.owner) == (3, "free", "worker-a")
        assert (await store.claim("job-1", owner="worker-b", ttl=TTL)).generation == 4


_CRASHING_WORKER = textwrap.dedent(
    """
    import asyncio, sys, time
    from leases.sqlite import SQLiteLeaseStore

    async def main():
        store = await SQLiteLeaseStore.open(sys.argv[1])
        for _ in range(4):
            lease = await store.claim("job-1", owner="doomed", ttl=60.0)
            await store.release(lease)
        lease = await store.claim("job-1", owner="doomed", ttl=60.0)
        print(lease.generation, flush=True)
        time.sleep(3600)  # killed here, with the store still open

    asyncio.run(main())
    """
)


@pytest.mark.slow
async def test_generation_is_never_reused_after_a_crash(tmp_path: Path) -> None:
    """A process is killed (SIGKILL) right after its claim returned: after a reopen
    the claim is still there, and the next claim (once it expires) is higher."""
    path = tmp_path / "leases.db"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _CRASHING_WORKER, str(path), stdout=asyncio.subprocess.PIPE
    )
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), PATIENCE)
    finally:
        proc.send_signal(signal.SIGKILL)
        await asyncio.wait_for(proc.wait(), PATIENCE)
    assert proc.returncode == -signal.SIGKILL
    claimed = int(line.decode())
    assert claimed == 5

    later = time.time() + TTL + 1  # the crashed worker's lease has run out
    async with await SQLiteLeaseStore.open(path, clock=lambda: later) as store:
        survived = await store.get("job-1")
        assert (survived.generation, survived.owner, survived.state) == (5, "doomed", "active")
        nxt = await store.claim("job-1", owner="survivor", ttl=TTL)
        assert nxt.generation == claimed + 1
