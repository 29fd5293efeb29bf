"""Pre-fill a gateway SQLite store with N idempotency records and N/10 jobs.

Rows go straight into the gateway's tables (schema of gateway/store/sqlite.py,
created by the gateway itself on its first start): N completed idempotency
records of destination `bench` with a stored 200 answer, and N/10 jobs, each
with an active lease and a fence mark. Timestamps are recent, so retention
purges none of them during the run. The gateway must not be running.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BATCH = 20_000
BODY = b'{"ok":true,"id":"bench"}'


def _tables(conn: sqlite3.Connection) -> set[str]:
    return {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


def prefill_sqlite(db_path: Path, records: int, log: Callable[[str], None]) -> bool:
    """Insert the rows; False (and nothing changed) when the schema isn't the expected one."""
    if not (REPO / "gateway" / "store" / "sqlite.py").exists():
        log("gateway/store/sqlite.py is missing: --prefill skipped")
        return False
    conn = sqlite3.connect(db_path, isolation_level=None)
    try:
        missing = {"idempotency", "leases", "fences"} - _tables(conn)
        if missing:
            log(f"store has no table(s) {sorted(missing)}: --prefill skipped")
            return False
        conn.execute("PRAGMA synchronous=OFF")
        started = time.monotonic()
        now = time.time()
        headers = json.dumps([["Content-Type", "application/json"]])
        jobs = max(1, records // 10)
        conn.execute("BEGIN")
        for lo in range(0, records, BATCH):
            rows = []
            for i in range(lo, min(records, lo + BATCH)):
                job = f"prefill-{i % jobs}"
                fp = hashlib.sha256(b"POST /items %d" % i).hexdigest()
                at = now - (i % 3600)
                rows.append(
                    ("bench", f"prefill-key-{i}", fp, f"prefill-attempt-{i}", job, 1,
                     "prefill-worker", at, at, at + 15, at, 200, headers, BODY)
                )  # fmt: skip
            conn.executemany(
                "INSERT INTO idempotency (destination, key, state, fingerprint, attempt, "
                "attempts, job_id, generation, owner, created_at, updated_at, deadline, "
                "completed_at, status, headers, body, body_omitted) "
                "VALUES (?, ?, 'completed', ?, ?, 1, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, 0)",
                rows,
            )
        conn.executemany(
            "INSERT INTO leases (job_id, owner, generation, state, lease_until, ttl) "
            "VALUES (?, 'prefill-worker', 1, 'active', ?, 3600)",
            ((f"prefill-{j}", now + 3600) for j in range(jobs)),
        )
        conn.executemany(
            "INSERT INTO fences (job_id, highest_generation, updated_at) VALUES (?, 1, ?)",
            ((f"prefill-{j}", now) for j in range(jobs)),
        )
        conn.execute("COMMIT")
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        size = db_path.stat().st_size / 1e6
        log(
            f"prefill: {records} keys and {jobs} jobs in {time.monotonic() - started:.1f} s "
            f"({size:.0f} MB)"
        )
        return True
    except sqlite3.Error as exc:
        log(f"prefill failed ({exc}): running on what the store has")
        return False
    finally:
        conn.close()
