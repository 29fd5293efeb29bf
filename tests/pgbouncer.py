"""PgBouncer in transaction mode in front of the test server, for the tests that
say the gateway works behind it (docs/deploying.md).

    async with transaction_pooler() as url:   # postgresql://... through PgBouncer
        ...

Debian's `pgbouncer` package (the binary only: the pooler runs here as a child
of the test, on a free port, with a config of its own). Without it the tests
skip, except under `CI=true`, where they fail (`.ci/run` installs it).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from urllib.parse import SplitResult, unquote, urlsplit, urlunsplit

import asyncpg  # type: ignore[import-untyped]

from gateway.tools.chaos.processes import free_port
from tests.pg import fresh_database, skip_or_fail

# Debian puts it in sbin, which a user's PATH may not name.
_WHERE = ("pgbouncer", "/usr/sbin/pgbouncer")
START_S = 10.0


def pgbouncer_binary() -> str | None:
    for name in _WHERE:
        found = shutil.which(name)
        if found is not None:
            return found
    return None


@asynccontextmanager
async def transaction_pooler(server_connections: int = 2) -> AsyncIterator[str]:
    """A fresh database (`tests.pg.fresh_database`) behind a PgBouncer of its own
    in transaction mode, with `server_connections` server connections: fewer than
    a store's pool has clients, so a client is lent a different server from one
    transaction to the next, as it would be under load. Yields its URL."""
    binary = pgbouncer_binary()
    if binary is None:
        skip_or_fail("pgbouncer is not installed (Debian: apt-get install pgbouncer)")
    async with fresh_database() as url:
        parts = urlsplit(url)
        port = free_port()
        with tempfile.TemporaryDirectory(prefix="sinkgate-pgbouncer-") as directory:
            config = _write_config(Path(directory), parts, port, server_connections)
            as_user = ["-u", "postgres"] if os.geteuid() == 0 else []
            # Its log goes to a file, not a pipe nobody reads: a full pipe stops it.
            said = config.with_name("stderr.log")
            with said.open("wb") as stderr:
                process = await asyncio.create_subprocess_exec(
                    binary,
                    *as_user,
                    str(config),
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=stderr,
                )
            user = parts.username or "postgres"
            pooled = urlunsplit(parts._replace(netloc=f"{user}@127.0.0.1:{port}"))
            try:
                await _until_it_answers(pooled, process, said)
                yield pooled
            finally:
                with suppress(ProcessLookupError):
                    process.send_signal(signal.SIGINT)  # PgBouncer's "exit now"
                try:
                    await asyncio.wait_for(process.wait(), 10)
                except TimeoutError:
                    process.kill()
                    await process.wait()


def _write_config(where: Path, server: SplitResult, port: int, server_connections: int) -> Path:
    """PgBouncer's config in `where`, listening on `port`; its path."""
    # PgBouncer refuses to run as root; it is told whom to run as then, and that
    # user must read its config and write its log.
    where.chmod(0o777)
    # The password PgBouncer logs in to the server with (trust: clients give none).
    password = unquote(server.password or "")
    (where / "users.txt").write_text(f'"{server.username or "postgres"}" "{password}"\n')
    (where / "pgbouncer.ini").write_text(
        f"""[databases]
* = host={server.hostname or "127.0.0.1"} port={server.port or 5432}

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = {port}
unix_socket_dir =
auth_type = trust
auth_file = {where / "users.txt"}
pool_mode = transaction
default_pool_size = {server_connections}
max_client_conn = 200
ignore_startup_parameters = extra_float_digits
logfile = {where / "pgbouncer.log"}
"""
    )
    for name in ("users.txt", "pgbouncer.ini"):
        (where / name).chmod(0o644)
    return where / "pgbouncer.ini"


async def _until_it_answers(url: str, process: asyncio.subprocess.Process, said: Path) -> None:
    deadline = asyncio.get_running_loop().time() + START_S
    while True:
        if process.returncode is not None:
            words = await asyncio.to_thread(said.read_text, errors="replace")
            raise AssertionError(f"pgbouncer exited with {process.returncode}: {words}")
        try:
            conn = await asyncpg.connect(url, timeout=2, statement_cache_size=0)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            if asyncio.get_running_loop().time() > deadline:
                raise
            await asyncio.sleep(0.05)
            continue
        await conn.close()
        return
