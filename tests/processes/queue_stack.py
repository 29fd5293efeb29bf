"""What the queue tests run against, as processes: Redis (the machine's), a
gateway (`python -m gateway serve`) and the examples' ledger as its destination.

Without Redis on 127.0.0.1:6379 the tests skip, except under `CI=true`, where
they fail. Every test gets its own key prefix (queues, marks, job ids).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pytest

from tests.harness import eventually, free_port

REPO = Path(__file__).resolve().parents[2]
REDIS_URL = os.environ.get("SINKGATE_TEST_REDIS", "redis://127.0.0.1:6379/0")
START_S = 30.0


def skip_or_fail(reason: str) -> NoReturn:
    """Skip the test, or fail it when the environment says CI=true."""
    if os.environ.get("CI", "").strip().lower() in ("true", "1"):
        pytest.fail(f"{reason} (CI=true: the queue tests must run)", pytrace=False)
    pytest.skip(reason)


def require_redis() -> None:
    """Skip (or fail under CI) unless Redis answers PING and the queue libraries load."""
    try:
        import arq  # noqa: F401
        import celery  # noqa: F401
        import redis
    except ImportError as exc:
        skip_or_fail(f"queue libraries missing ({exc}); pip install -e '.[test]'")
    try:
        redis.Redis.from_url(REDIS_URL, socket_timeout=2).ping()
    except (redis.RedisError, OSError) as exc:
        skip_or_fail(f"Redis not reachable at {REDIS_URL} ({exc}); set SINKGATE_TEST_REDIS")


def stopped(pid: int) -> bool:
    """Whether process `pid` is stopped (SIGSTOP), per the kernel."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


@dataclass
class Stack:
    tmp: Path
    prefix: str
    gateway: str
    admin: str
    ledger: str
    record: Path
    procs: list[tuple[subprocess.Popen[bytes], Path]] = field(default_factory=list)
    lasting: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def env(self, mode: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith("SINKGATE_")}
        return {
            **base,
            "PYTHONPATH": str(REPO),
            "QUEUE_REDIS": REDIS_URL,
            "QUEUE_PREFIX": self.prefix,
            "QUEUE_GATEWAY": self.gateway,
            "QUEUE_LEDGER": self.ledger,
            "QUEUE_MODE": mode,
        }

    def start(
        self,
        name: str,
        *argv: str,
        mode: str = "fenced",
        env: dict[str, str] | None = None,
        lasting: bool = True,
    ) -> subprocess.Popen[bytes]:
        """Start `python argv...` with the stack's environment; a `lasting` process
        (a server, a worker) must keep running until the end: see `check()`."""
        log = self.tmp / f"{name}.log"
        with log.open("wb") as out:
            proc = subprocess.Popen(
                [sys.executable, *argv],
                cwd=REPO,
                env={**self.env(mode), **(env or {})},
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        self.procs.append((proc, log))
        if lasting:
            self.lasting.append(proc)
        return proc

    def check(self) -> None:
        """Fail the test, with the logs, if a lasting process has exited."""
        for proc in self.lasting:
            if proc.poll() is not None:
                pytest.fail(f"{proc.args} exited {proc.returncode}\n{self.logs()}")

    async def until(self, condition: Any, what: str, within: float = 15.0) -> Any:
        """`eventually(condition)`, failing at once if a lasting process died."""

        def checked() -> Any:
            self.check()
            return condition()

        return await eventually(checked, within=within, what=what)

    def entries(self) -> list[dict[str, Any]]:
        """The ledger's own record of applied effects (one JSON line each)."""
        if not self.record.exists():
            return []
        return [json.loads(line) for line in self.record.read_text().splitlines() if line]

    def rejections(self, job_id: str) -> list[dict[str, Any]]:
        query = urllib.parse.urlencode({"job_id": job_id})
        with urllib.request.urlopen(f"{self.admin}/admin/rejections?{query}", timeout=5) as r:
            return list(json.loads(r.read())["items"])

    def marks(self, name: str) -> list[Any]:
        import redis

        client = redis.Redis.from_url(REDIS_URL)
        return [json.loads(v) for v in client.lrange(f"{self.prefix}{name}", 0, -1)]

    def logs(self) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_text()[-3000:]}" for _, log in self.procs)


def _write_config(tmp: Path, ledger: str) -> tuple[Path, str, str]:
    listen, admin = free_port(), free_port()
    (tmp / "destinations").mkdir()
    (tmp / "destinations" / "ledger.toml").write_text(
        f'upstream = "{ledger}"\nfencing = "lease"\ntimeout = "10s"\n'
    )
    config = tmp / "gateway.toml"
    config.write_text(
        f"""[server]
listen = "127.0.0.1:{listen}"
admin_listen = "127.0.0.1:{admin}"
shutdown_grace = "2s"

[store]
url = "sqlite:///{tmp / "sinkgate.db"}"

[destinations]
dir = "destinations"
"""
    )
    return config, f"http://127.0.0.1:{listen}", f"http://127.0.0.1:{admin}"


def _answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@asynccontextmanager
async def queue_stack(tmp: Path, *, busy: int = 0) -> AsyncIterator[Stack]:
    """A ledger (answering its first `busy` entries 503) and a gateway in front of
    it, stopped (and any worker with them) at the end."""
    require_redis()
    port = free_port()
    ledger = f"http://127.0.0.1:{port}"
    config, gateway, admin = _write_config(tmp, ledger)
    stack = Stack(tmp, f"sgt{secrets.token_hex(6)}:", gateway, admin, ledger, tmp / "ledger.jsonl")
    try:
        stack.start(
            *("ledger", "-m", "examples.ledger", "--port", str(port)),
            *("--record", str(stack.record), "--busy", str(busy)),
        )
        stack.start(
            "gateway", "-m", "gateway", "serve", "--config", str(config), "--log-format", "json"
        )
        for url in (f"{ledger}/entries", f"{gateway}/readyz"):
            await stack.until(lambda u=url: _answers(u), f"{url} answering", within=START_S)
        yield stack
    finally:
        _stop_all(stack)
        _forget_keys(stack.prefix)


def _stop_all(stack: Stack) -> None:
    for proc, _ in reversed(stack.procs):
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)  # a stopped process cannot act on SIGTERM
            proc.terminate()
    for proc, _ in stack.procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _forget_keys(prefix: str) -> None:
    import redis

    client = redis.Redis.from_url(REDIS_URL)
    keys = list(client.scan_iter(match=f"*{prefix}*", count=500))
    if keys:
        client.delete(*keys)
