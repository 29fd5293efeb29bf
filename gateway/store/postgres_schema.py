"""The gateway's tables on PostgreSQL, and creating or migrating them at open.

The same tables as `sqlite_schema` in PostgreSQL types (`double precision` epoch
seconds, `bigint` generations, `bytea` bodies, `bigserial` rejection ids), in the
database the lease store (`leases.postgres`) uses.
"""

from __future__ import annotations

from gateway.store import postgres_admin
from gateway.store.postgres_batch import DECIDE_FUNCTION_DDL
from gateway.store.postgres_notify import NOTIFY_DDL
from gateway.store.postgres_outcomes import OUTCOMES_FUNCTION_DDL
from leases.postgres import (
    SCHEMA_LOCK_KEY,
    Conn,
    component_version,
    ensure_component,
)

# v2: the audit log and the summary's index (postgres_admin).
# v3: a keyed write's barrier lives in its key's row (`barrier_until`, read
# through `idempotency_in_flight`); the attempts table holds keyless writes only.
# v4: the audit log names the operator of each action (`operator`).
# v5: a batch of outcomes is one call of a server-side function
# (`postgres_outcomes.OUTCOMES_FUNCTION`), and a decision batch's locks and state
# read another (`postgres_batch.STATE_FUNCTION`), created and replaced here.
# v6: a decision batch is one call (`postgres_batch.DECIDE_FUNCTION`): the policy
# runs in the server. v5's state function is left in place, so v5 replicas still
# running decide on (their batches take the same locks in the same order).
# Still v6, no table changed: the decision function became `sinkgate_decide_v2`
# (a column more: each replay's row, sent once per run of a key); v1 is left in
# place for the replicas of the release before.
GATEWAY_SCHEMA_VERSION = 6
# The tables the DDL below and the audit log's create (checked before the first).
GATEWAY_TABLES = ("fences", "idempotency", "attempts", "rejections", "audit")

GATEWAY_DDL = """
CREATE TABLE IF NOT EXISTS fences (
    job_id text PRIMARY KEY,
    highest_generation bigint NOT NULL,
    updated_at double precision NOT NULL
);
CREATE TABLE IF NOT EXISTS idempotency (
    destination text NOT NULL,
    key text NOT NULL,
    state text NOT NULL CHECK (state IN ('in_flight', 'completed', 'unknown')),
    fingerprint text NOT NULL,
    attempt text NOT NULL,
    attempts integer NOT NULL,
    job_id text NOT NULL,
    generation bigint NOT NULL,
    owner text,
    created_at double precision NOT NULL,
    updated_at double precision NOT NULL,
    deadline double precision NOT NULL,
    completed_at double precision,
    status integer,
    headers text,
    body bytea,
    body_omitted boolean NOT NULL DEFAULT false,
    barrier_until double precision,
    PRIMARY KEY (destination, key)
);
-- v1 -> v2 (a v1 keyed attempt row left in attempts bars its job until its deadline)
ALTER TABLE idempotency ADD COLUMN IF NOT EXISTS barrier_until double precision;
CREATE INDEX IF NOT EXISTS idempotency_in_flight ON idempotency (job_id, generation)
    WHERE state = 'in_flight';
-- Settled keys only: the write path's barrier read walks a job's in-flight rows on
-- idempotency_in_flight, and an index on every state drew it onto all of them.
CREATE INDEX IF NOT EXISTS idempotency_settled ON idempotency (state, completed_at)
    WHERE state <> 'in_flight';
DROP INDEX IF EXISTS idempotency_completed;
CREATE TABLE IF NOT EXISTS attempts (
    attempt text PRIMARY KEY,
    job_id text NOT NULL,
    generation bigint NOT NULL,
    destination text NOT NULL,
    key text,
    started_at double precision NOT NULL,
    deadline double precision NOT NULL
);
CREATE INDEX IF NOT EXISTS attempts_job ON attempts (job_id, generation);
CREATE TABLE IF NOT EXISTS rejections (
    id bigserial PRIMARY KEY,
    at double precision NOT NULL,
    destination text,
    method text,
    path text,
    job_id text,
    generation bigint,
    owner text,
    idempotency_key text,
    reason text NOT NULL,
    detail text,
    current_generation bigint,
    highest_generation bigint,
    remote text,
    body_sha256 text,
    body_bytes bigint
);
CREATE INDEX IF NOT EXISTS rejections_at ON rejections (at);
CREATE INDEX IF NOT EXISTS rejections_job ON rejections (job_id, id);
CREATE INDEX IF NOT EXISTS rejections_reason ON rejections (reason, id);
CREATE INDEX IF NOT EXISTS rejections_destination ON rejections (destination, id);
"""


async def init_schema(conn: Conn) -> int | None:
    """The gateway's tables, under the schema lock every sinkgate process takes; the
    gateway schema's version before (None: a database without it).

    The tables' DDL runs only on a database that is not at this version yet:
    even where nothing is missing, `CREATE INDEX IF NOT EXISTS` locks its table
    against writes and `ALTER TABLE ... IF NOT EXISTS` against everything, so a
    gateway starting beside running replicas would stop their writes, and wait
    for the longest transaction on those tables. The functions and triggers are
    created or replaced at every start (that locks no table)."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", SCHEMA_LOCK_KEY)
        current = await component_version(conn, "gateway")
        if current != GATEWAY_SCHEMA_VERSION:
            await conn.execute(GATEWAY_DDL)
            await postgres_admin.migrate(conn)
        await conn.execute(NOTIFY_DDL)
        await conn.execute(OUTCOMES_FUNCTION_DDL)
        await conn.execute(DECIDE_FUNCTION_DDL)
        return await ensure_component(conn, "gateway", GATEWAY_SCHEMA_VERSION)
