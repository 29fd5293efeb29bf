"""The chaos run's processes: the recording destination and the gateways.

Each runs in its own session (process group), so `kill -9` of a gateway takes
its whole group and the final clean-up can stop every group it started. On
Linux each is also sent SIGTERM when the chaos command itself dies, even by
`kill -9`, which no clean-up of its own can handle (`PR_SET_PDEATHSIG`).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import sys
from collections.abc import Callable, Collection
from pathlib import Path

import aiohttp

_PR_SET_PDEATHSIG = 1


def death_signal() -> Callable[[], None] | None:
    """A `preexec_fn` asking the kernel to SIGTERM the child when its parent dies;
    None off Linux. `prctl` is looked up here, in the parent: between fork and exec
    the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    parent = os.getpid()

    def die_with_parent() -> None:
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before the call: nobody to wait for
            os.kill(os.getpid(), signal.SIGTERM)

    return die_with_parent


class ProcessFailed(Exception):
    """A chaos process did not start or did not become healthy."""


# Where the kernel picks the local ports of outgoing connections (Linux's default
# where the setting cannot be read).
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_EPHEMERAL_LOW_DEFAULT = 32768
_BELOW_EPHEMERAL = 16384  # how many ports under that range free_port draws from


def ephemeral_low() -> int:
    """The lowest port the kernel hands to outgoing connections."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _EPHEMERAL_LOW_DEFAULT


def free_port(within: range | None = None, *, avoid: Collection[int] = ()) -> int:
    """A loopback port free now, for a process that binds it a moment later (and
    again after each restart), from `within` when given. Otherwise drawn below the
    ephemeral range: a port the kernel hands out (`bind(0)`) is one it may give
    next to any outgoing connection (the store's, a proxy's, a worker's), which
    then takes it before the gateway binds."""
    if within is not None:
        return _free_port_within(within, avoid)
    low = ephemeral_low()
    draw = random.SystemRandom()
    for _ in range(200):
        port = draw.randrange(max(1024, low - _BELOW_EPHEMERAL), low)
        if port not in avoid and _bindable(port):
            return port
    with socket.socket() as sock:  # the range below is full: the kernel's pick
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _free_port_within(within: range, avoid: Collection[int]) -> int:
    """A free port of `within`, tried in a random order; ProcessFailed if none is."""
    ports = [port for port in within if port not in avoid]
    random.SystemRandom().shuffle(ports)
    for port in ports:
        if _bindable(port):
            return port
    raise ProcessFailed(f"no free loopback port left in {within.start}-{within.stop - 1}")


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        # As the servers that take the port bind it: through the TIME-WAIT an
        # earlier run's connections leave (back-to-back runs in a small --ports).
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class Ports:
    """The run's listening ports: from `sinkgate chaos --ports LOW-HIGH` when given,
    each handed out once (a port is bound by its process only a moment later)."""

    def __init__(self, within: range | None = None) -> None:
        self.within = within
        self._taken: set[int] = set()

    def take(self) -> int:
        port = free_port(self.within, avoid=self._taken)
        self._taken.add(port)
        return port


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


class Managed:
    """One subprocess in its own process group, with its stderr in a log file."""

    def __init__(self, name: str, argv: list[str], log_path: Path) -> None:
        self.name = name
        self.argv = argv
        self.log_path = log_path
        self.proc: asyncio.subprocess.Process | None = None

    async def spawn(self, stdout: int | None = asyncio.subprocess.DEVNULL) -> None:
        with self.log_path.open("ab") as log:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=stdout,
                stderr=log,
                start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"},
                preexec_fn=death_signal(),
            )

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    def _signal_group(self, signum: int) -> None:
        assert self.proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signum)

    async def kill(self) -> None:
        """`kill -9` of the whole process group; returns once the process is gone."""
        if self.proc is None:
            return
        self._signal_group(signal.SIGKILL)
        await self.proc.wait()

    async def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace`; the group is killed either way."""
        if self.proc is None:
            return
        if self.proc.returncode is None:
            self._signal_group(signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace)
            except TimeoutError:
                pass
        self._signal_group(signal.SIGKILL)  # leftovers of the group, if any
        with contextlib.suppress(ProcessLookupError):
            await self.proc.wait()

    def failure(self, what: str) -> ProcessFailed:
        return ProcessFailed(f"{self.name} {what}; its log ends with:\n{_tail(self.log_path)}")


class Destination(Managed):
    """The recording destination (gateway.tools.chaos.destination) on a free loopback port."""

    def __init__(
        self,
        workdir: Path,
        *,
        seed: int,
        fault_rate: float,
        max_latency: float,
        idempotent: bool,
        ports: Ports,
        extra_args: list[str] | None = None,
    ) -> None:
        argv = [
            sys.executable,
            "-m",
            "gateway.tools.chaos.destination",
            "--port",
            str(ports.take()),
            "--seed",
            str(seed),
            "--fault-rate",
            str(fault_rate),
            "--max-latency",
            str(max_latency),
        ]
        if idempotent:
            argv.append("--idempotent")
        argv += extra_args or []
        super().__init__("destination", argv, workdir / "destination.log")
        self.url = ""

    async def start(self, timeout: float = 20.0) -> None:  # noqa: ASYNC109
        await self.spawn(stdout=asyncio.subprocess.PIPE)
        assert self.proc is not None and self.proc.stdout is not None
        try:
            line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        except TimeoutError:
            raise self.failure("did not start in time") from None
        words = line.decode().split()
        if len(words) != 2 or words[0] != "READY":
            raise self.failure("did not start")
        self.url = f"http://127.0.0.1:{int(words[1])}"

    async def record(self, session: aiohttp.ClientSession) -> dict[str, object]:
        from gateway.tools.chaos.destination import RECORD_PATH

        async with session.get(self.url + RECORD_PATH) as resp:
            resp.raise_for_status()
            doc = await resp.json()
        assert isinstance(doc, dict)
        return doc


def _toml_str(value: str) -> str:
    return json.dumps(value)  # a JSON string of ASCII is a valid TOML basic string


class GatewayProcess(Managed):
    """`python -m gateway serve` with its own config dir, on fixed loopback ports so a
    restart after `kill -9` comes back at the same address on the same store."""

    def __init__(
        self,
        index: int,
        workdir: Path,
        *,
        store_url: str,
        upstream: str,
        timeout: str,
        upstream_idempotent: bool,
        ports: Ports,
    ) -> None:
        self.index = index
        self.port = ports.take()
        self.admin_port = ports.take()
        confdir = workdir / f"gateway-{index}"
        (confdir / "destinations").mkdir(parents=True, exist_ok=True)
        (confdir / "gateway.toml").write_text(
            "[server]\n"
            f'listen = "127.0.0.1:{self.port}"\n'
            f'admin_listen = "127.0.0.1:{self.admin_port}"\n'
            'shutdown_grace = "2s"\n'
            "[store]\n"
            f"url = {_toml_str(store_url)}\n"
            "[destinations]\n"
            'dir = "destinations"\n'
        )
        (confdir / "destinations" / "sink.toml").write_text(
            f"upstream = {_toml_str(upstream)}\n"
            f"timeout = {_toml_str(timeout)}\n"
            'connect_timeout = "1s"\n'
            f"upstream_idempotent = {'true' if upstream_idempotent else 'false'}\n"
        )
        argv = [
            sys.executable,
            "-m",
            "gateway",
            "serve",
            "--config",
            str(confdir / "gateway.toml"),
            "--log-level",
            "warning",
            "--log-format",
            "json",
        ]
        super().__init__(f"gateway {index}", argv, workdir / f"gateway-{index}.log")
        self.url = f"http://127.0.0.1:{self.port}"

    async def start(self, session: aiohttp.ClientSession, timeout: float = 30.0) -> None:  # noqa: ASYNC109
        """Spawn and wait until `/healthz` answers (a restart binds the same port)."""
        await self.spawn()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        probe = aiohttp.ClientTimeout(total=1.0)
        while loop.time() < deadline:
            if not self.running:
                raise self.failure("exited during start-up")
            try:
                async with session.get(self.url + "/healthz", timeout=probe) as resp:
                    if resp.status == 200:
                        return
            except (aiohttp.ClientError, OSError, TimeoutError):
                pass
            await asyncio.sleep(0.1)
        raise self.failure("did not become healthy in time")
