"""The chaos run's check against the store's own key records (SPEC 7, v3).

5. `effects_have_key_records` - every effect the destination applied has a key
   record in the gateway's store (`completed`, `unknown` or `in_flight`): no
   write reached the destination without a durable reservation, and none whose
   record was released (a released key may be forwarded again).
6. `acknowledged_writes_applied` - every key a worker got a `2xx` for (applied
   or replayed) was applied by the destination: nothing reported as done that
   was not.

`check_records` is pure; `read_key_records` reads the records at the end of the
run, straight from the store (not through a fault proxy).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Mapping
from typing import Any

RECORD_INVARIANTS = ("effects_have_key_records", "acknowledged_writes_applied")
HELD_STATES = frozenset({"completed", "unknown", "in_flight"})


def check_records(
    *,
    effects: Iterable[Mapping[str, Any]],
    jobs: Mapping[str, list[str]],
    records: Mapping[str, str | None],
    acknowledged: Iterable[str],
) -> dict[str, list[str]]:
    """`records` maps each key of the run to its record's state (None: no record)."""
    found: dict[str, list[str]] = {name: [] for name in RECORD_INVARIANTS}
    ours = [e for e in effects if e["job_id"] in jobs]
    applied = {str(e["key"]) for e in ours}
    for effect in sorted(ours, key=lambda e: int(e["seq"])):
        key = str(effect["key"])
        state = records.get(key)
        if state not in HELD_STATES:
            what = "no key record" if state is None else f"a {state} key record"
            found["effects_have_key_records"].append(
                f"effect #{effect['seq']} (job {effect['job_id']}, key {key}) has {what}"
            )
    for key in sorted(set(acknowledged) - applied):
        found["acknowledged_writes_applied"].append(f"key {key} was answered 2xx but never applied")
    return found


async def read_key_records(
    store_url: str, destination: str, keys: Iterable[str]
) -> dict[str, str | None]:
    """The state of each key's record in the store at `store_url`."""
    from gateway.store import open_store

    store = await open_store(store_url, pool_size=4)
    try:
        gate = asyncio.Semaphore(4)

        async def one(key: str) -> tuple[str, str | None]:
            async with gate:
                record = await store.key_record(destination, key)
            return key, None if record is None else str(record.state)

        return dict(await asyncio.gather(*(one(k) for k in keys)))
    finally:
        await store.close()
