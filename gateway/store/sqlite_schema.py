"""The gateway's tables on SQLite, and creating or migrating them at open."""

from __future__ import annotations

import sqlite3

from gateway.store import sqlite_admin
from leases import sqlite as lease_sql
from leases.sqlite import ensure_component

# v2: the audit log and the summary's index (sqlite_admin).
# v3: a keyed write's barrier lives in its key's row (`barrier_until`, read
# through `idempotency_in_flight`); the attempts table holds keyless writes only.
# v4: the audit log names the operator of each action (`operator`).
GATEWAY_SCHEMA_VERSION = 4

GATEWAY_SCHEMA = """
CREATE TABLE IF NOT EXISTS fences (
    job_id TEXT PRIMARY KEY,
    highest_generation INTEGER NOT NULL,
    updated_at REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency (
    destination TEXT NOT NULL,
    key TEXT NOT NULL,
    state TEXT NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    fingerprint TEXT NOT NULL,
    attempt TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    job_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    owner TEXT,
    created_at REAL NOT NULL,
    updated_at REAL NOT NULL,
    deadline REAL NOT NULL,
    completed_at REAL,
    status INTEGER,
    headers TEXT,
    body BLOB,
    body_omitted INTEGER NOT NULL DEFAULT 0,
    barrier_until REAL,
    PRIMARY KEY (destination, key)
);
CREATE INDEX IF NOT EXISTS idempotency_completed ON idempotency (state, completed_at);
CREATE TABLE IF NOT EXISTS attempts (
    attempt TEXT PRIMARY KEY,
    job_id TEXT NOT NULL,
    generation INTEGER NOT NULL,
    destination TEXT NOT NULL,
    key TEXT,
    started_at REAL NOT NULL,
    deadline REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS attempts_job ON attempts (job_id, generation);
CREATE TABLE IF NOT EXISTS rejections (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    at REAL NOT NULL,
    destination TEXT,
    method TEXT,
    path TEXT,
    job_id TEXT,
    generation INTEGER,
    owner TEXT,
    idempotency_key TEXT,
    reason TEXT NOT NULL,
    detail TEXT,
    current_generation INTEGER,
    highest_generation INTEGER,
    remote TEXT,
    body_sha256 TEXT,
    body_bytes INTEGER
);
CREATE INDEX IF NOT EXISTS rejections_at ON rejections (at);
CREATE INDEX IF NOT EXISTS rejections_job ON rejections (job_id, id);
CREATE INDEX IF NOT EXISTS rejections_reason ON rejections (reason, id);
CREATE INDEX IF NOT EXISTS rejections_destination ON rejections (destination, id);
"""


# After the v1 -> v2 migration: the column it indexes may be new.
_IN_FLIGHT_INDEX = (
    "CREATE INDEX IF NOT EXISTS idempotency_in_flight ON idempotency (job_id, generation) "
    "WHERE state = 'in_flight'"
)


def init_schema(conn: sqlite3.Connection) -> int | None:
    """The gateway's tables and their migrations; the gateway schema's
    version before (None: a file without it)."""
    lease_sql.init_leases_schema(conn)
    conn.executescript("BEGIN IMMEDIATE;" + GATEWAY_SCHEMA + "COMMIT;")
    conn.execute("BEGIN IMMEDIATE")
    try:
        sqlite_admin.migrate(conn)
        _migrate(conn)
        conn.execute(_IN_FLIGHT_INDEX)
        before = ensure_component(conn, "gateway", GATEWAY_SCHEMA_VERSION)
        conn.execute("COMMIT")
        return before
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def _migrate(conn: sqlite3.Connection) -> None:
    """-> v3: add `barrier_until`. A keyed attempt row an older gateway left in the
    attempts table keeps barring its job until its deadline (the barrier reads both)."""
    columns = {row[1] for row in conn.execute("PRAGMA table_info(idempotency)")}
    if "barrier_until" not in columns:
        conn.execute("ALTER TABLE idempotency ADD COLUMN barrier_until REAL")
