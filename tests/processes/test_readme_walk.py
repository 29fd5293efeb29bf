"""The README's "Five minutes with curl", run as printed: every `$ command` of the
blocks marked `<!-- walk -->` runs in order in an empty directory, and its output
must be what the README shows (times, dates and versions aside). The blocks
marked `<!-- walk: background -->` are the long-running processes of the walk.

The walk's fixed ports (8480, 8481, 9000) are swapped for free ones, in the
commands and in the files `sinkgate init` writes, so that the test can run next
to anything else; outputs are compared with the README's ports put back.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from tests.harness import eventually, free_port

pytestmark = pytest.mark.slow

README = Path(__file__).resolve().parents[2] / "README.md"
DOCS = README.parent / "docs"


def user_docs() -> str:
    """The README and every page of docs/ but the contract (SPEC.md), as one text."""
    pages = sorted(p for p in DOCS.glob("*.md") if p.name != "SPEC.md")
    return "\n".join(p.read_text(encoding="utf-8") for p in [README, *pages])


PORTS = ("8480", "8481", "9000")  # main listener, admin listener, the walk's upstream

_BLOCK = re.compile(r"<!-- walk(: background)? -->\n```console\n(.*?)```", re.S)
_MASKS = (
    (re.compile(r"\d{4}-\d\d-\d\d[T ]\d\d:\d\d:\d\d(\.\d+)?Z?"), "<time>"),
    (re.compile(r"(?m)^Date: .*$"), "Date: <date>"),
    (re.compile(r"(?m)^Server: .*$"), "Server: <server>"),
)


@dataclass
class Step:
    command: str
    expected: str
    background: bool


def walk_steps(text: str) -> list[Step]:
    """Every `$ command` of the walk's blocks, with the output shown after it."""
    steps: list[Step] = []
    for match in _BLOCK.finditer(text):
        background = match.group(1) is not None
        for chunk in re.split(r"(?m)^\$ ", match.group(2))[1:]:
            command, _, output = chunk.partition("\n")
            steps.append(Step(command, output, background))
    return steps


def normalise(text: str) -> str:
    for pattern, mask in _MASKS:
        text = pattern.sub(mask, text)
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


def test_the_walk_is_there_and_covers_the_story() -> None:
    commands = [s.command for s in walk_steps(README.read_text(encoding="utf-8"))]
    assert commands[:2] == ["sinkgate init", "sinkgate check-config"]
    joined = "\n".join(commands)
    for part in ("/claim", "Fencing-Token: 2", "sinkgate rejections", "/admin/login", "reload"):
        assert part in joined, part


async def test_the_walk_runs_as_printed(tmp_path: Path) -> None:
    def check(step: Step, output: str) -> None:
        assert normalise(output) == normalise(step.expected), step.command

    await run_walk(tmp_path, check)


async def run_walk(where: Path, check: Callable[[Step, str], None]) -> None:
    """Run the walk in the empty directory `where`; `check(step, output)` after each
    command, with the README's ports in the output."""
    ports = {canonical: str(free_port()) for canonical in PORTS}

    def ours(text: str) -> str:
        for canonical, port in ports.items():
            text = text.replace(canonical, port)
        return text

    def theirs(text: str) -> str:
        for canonical, port in ports.items():
            text = text.replace(port, canonical)
        return text

    env = {k: v for k, v in os.environ.items() if not k.startswith("SINKGATE_")}
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    # The admin CLI's default URL, with the swapped port.
    env["SINKGATE_ADMIN_URL"] = ours("http://127.0.0.1:8481")
    background: list[asyncio.subprocess.Process] = []
    ready = False
    try:
        for step in walk_steps(README.read_text(encoding="utf-8")):
            if step.background:
                log = (where / f"background-{len(background)}.log").open("wb")
                proc = await asyncio.create_subprocess_exec(
                    "bash",
                    "-c",
                    ours(step.command),
                    cwd=where,
                    env=env,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
                background.append(proc)
                continue
            if background and not ready:
                await _ready(ports, background, where)
                ready = True
            done = await asyncio.to_thread(
                subprocess.run,
                ["bash", "-c", ours(step.command)],
                cwd=where,
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert done.returncode == 0, f"$ {step.command}\n{done.stderr}"
            check(step, theirs(done.stdout))
            if step.command.startswith("sinkgate init"):
                for path in (where / "config").rglob("*.toml"):
                    path.write_text(ours(path.read_text()))
    finally:
        for proc in background:  # each in a session (process group) of its own
            os.killpg(proc.pid, signal.SIGTERM)
        for proc in background:
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()


async def _ready(
    ports: dict[str, str], procs: list[asyncio.subprocess.Process], where: Path
) -> None:
    """The gateway answers /healthz and the upstream its list of writes."""

    def gone() -> str | None:
        for number, proc in enumerate(procs):
            if proc.returncode is not None:
                log = (where / f"background-{number}.log").read_text(errors="replace")
                return f"background process {number} exited {proc.returncode}:\n{log}"
        return None

    async with aiohttp.ClientSession() as session:

        async def up() -> bool:
            failed = gone()
            if failed is not None:
                pytest.fail(failed)
            try:
                async with session.get(f"http://127.0.0.1:{ports['8480']}/healthz") as resp:
                    if resp.status != 200:
                        return False
                async with session.get(f"http://127.0.0.1:{ports['9000']}/_writes") as resp:
                    return resp.status == 200
            except aiohttp.ClientConnectionError:
                return False

        await eventually(up, within=60, what="the walk's gateway and upstream")


# --- every other command of the README and the docs -------------------------------

# A command shown outside the walk (in the README or a page of docs/) -> the test
# that runs it (the same program with the same flags, shorter where it would take
# minutes) and a piece of that test's source proving it. The walk's own commands need no entry.
RUN_ELSEWHERE: dict[str, tuple[str, str]] = {
    "python3 -m pip install . && sinkgate demo": (
        "tests/processes/test_demo.py",
        '"-m", "gateway", "demo"',
    ),
    "python3 -m bench.run --prefill 1000000": ("tests/processes/test_bench.py", '"bench.run"'),
    "python3 -m bench.run --quick": ("tests/processes/test_bench.py", '"bench.run"'),
    "sinkgate serve --config config/gateway.toml": (
        "tests/processes/test_traces_console.py",
        'OTEL_TRACES_EXPORTER="console"',
    ),
    "sinkgate serve --config config/gateway.toml --workers 2": (
        "tests/processes/test_workers.py",
        '"--workers", "2"',
    ),
    "sinkgate chaos": ("tests/harness.py", '"-m", "gateway", "chaos"'),
    "sinkgate chaos --bypass-gateway": ("tests/processes/test_chaos.py", '"--bypass-gateway"'),
    "sinkgate chaos --gateways 3 --kill-every 3 --store "
    "postgresql://postgres@127.0.0.1:5432/chaos": (
        "tests/processes/test_chaos.py",
        '"--kill-every"',
    ),
    "sinkgate chaos --json report.json --seed 7": ("tests/processes/test_chaos.py", '"--seed"'),
    "sinkgate chaos --ports 20000-20100": ("tests/processes/test_chaos.py", '"--ports", f"{low}'),
    "sinkgate chaos --late-writes": ("tests/processes/test_chaos_fence.py", '"--late-writes")'),
    "sinkgate chaos --late-writes --fenced-destination": (
        "tests/processes/test_chaos_fence.py",
        '"--late-writes", "--fenced-destination"',
    ),
    "sinkgate chaos --bypass-gateway --fenced-destination": (
        "tests/processes/test_chaos_fence.py",
        '"--bypass-gateway", "--fenced-destination"',
    ),
    "sinkgate chaos --store-faults 0.3": (
        "tests/processes/test_chaos_faults.py",
        '"--store-faults", "0.4", "--wire-faults", "0.3"',
    ),
    "sinkgate chaos --wire-faults 0.3": (
        "tests/processes/test_chaos_faults.py",
        '"--wire-faults", "0.3", "--store", url',
    ),
    "sinkgate chaos --gateways 3 --store-faults 0.3 --wire-faults 0.3 "
    "--store postgresql://postgres@127.0.0.1:5432/postgres": (
        "tests/processes/test_chaos_faults.py",
        '"--gateways", "2", "--store-faults", "0.4"',
    ),
    "python3 -m pytest -q -n 2 --dist worksteal": (
        ".ci/run",
        "python3 -m pytest -q -n 2 --dist worksteal",
    ),
    "celery -A examples.celery.tasks worker --loglevel INFO": (
        "tests/processes/test_queue_examples.py",
        '"examples.celery.tasks", "worker"',
    ),
    "python3 -m examples.celery.producer 1001 1999 --twice": (
        "tests/processes/test_queue_examples.py",
        '"examples.celery.producer"',
    ),
    "arq examples.arq.jobs.WorkerSettings": (
        "tests/processes/test_queue_examples.py",
        '"examples.arq.jobs.WorkerSettings"',
    ),
    "python3 -m examples.arq.producer 1002 500 --twice": (
        "tests/processes/test_queue_examples.py",
        '"examples.arq.producer"',
    ),
    "sinkgate keys --state unknown": ("tests/e2e/test_keys_cli.py", '"--state", "unknown"'),
    "sinkgate keys resolve payments inv-46-charge --applied --status 201 "
    '--body-file answer.json --note "PSP dashboard shows charge ch_46"': (
        "tests/e2e/test_keys_cli.py",
        '"--applied", "--status", "201"',
    ),
    "sinkgate keys resolve payments inv-45-charge --not-applied "
    '--note "no charge for inv-45 at the PSP"': ("tests/e2e/test_keys_cli.py", '"--not-applied"'),
    "CI=true python3 -m pytest -q -n 2 --dist worksteal": (
        ".ci/run",
        "python3 -m pytest -q -n 2 --dist worksteal",
    ),
    "npm --prefix clients/typescript ci": (".ci/run", "npm --prefix clients/typescript ci"),
    "(cd clients/typescript && npm ci && npm pack)": (
        "clients/typescript/test/package.test.ts",
        '["pack", "--json", "--ignore-scripts", "--pack-destination", project]',
    ),
    # deploying.md, PostgreSQL the first time: a fresh database, checked, then served
    "sinkgate check-config --connect": (
        "tests/e2e/test_check_connect.py",
        'assert "schema missing: serve creates it" in out',
    ),
    "sinkgate serve": (
        "tests/processes/test_replicas.py",
        "start at once against the empty database",
    ),
    "cd your-worker && npm install "
    "/path/to/sinkgate/clients/typescript/sinkgate-leases-0.1.0.tgz": (
        "clients/typescript/test/package.test.ts",
        '["install", ...quiet, `./${packed.filename}`]',
    ),
}
# Shown but run by no test, and why; a new command must go here or above.
NOT_RUN: dict[str, str] = {
    "python3 bench/overload.py": "minutes of load against a slow upstream; run by hand",
    "python3 -m bench.run --workers 2": "minutes of load; test_bench runs bench.run",
    "python3 -m bench.latency": "minutes of fixed-rate load against every target; run by hand",
    "pip install '.[otel]'": "needs the index for OpenTelemetry; the extra is only listed",
    "createdb -h 127.0.0.1 -U postgres chaos": "creates a database on the shared server",
    "createdb -h db.internal -U postgres -O sinkgate sinkgate": (
        "another server; the tests create theirs with CREATE DATABASE (tests/pg.py)"
    ),
    "python3 -m pip install -e '.[dev]'": "installs the contributor tools",
    "SINKGATE_TEST_PG=postgresql://user@host:5432/db python3 -m pytest -q": "another server",
    'python3 -m pytest -q -m "not slow"': "a part of what .ci/run runs",
    "python3 -m pytest -q tests/unit": "a part of what .ci/run runs",
    "ruff check . && ruff format --check .": "a contributor's check, not in the test extra",
    "mypy": "a contributor's check, not in the test extra",
    "sinkgate serve --config examples/gateway.toml": "the queue example test runs its own gateway",
    "python3 -m examples.celery.destination": "the queue example test runs its own ledger",
    "python3 -m examples.arq.destination": "the queue example test runs its own ledger",
    "python3 -m tests.e2e.test_admin_browser docs": "needs chromium; writes docs/",
    "export SINKGATE_ADMIN_URL=http://127.0.0.1:8481 SINKGATE_ADMIN_TOKEN=...": "sets variables",
    "sinkgate chaos --jobs 3800 --workers 24 --duration 320 --gateways 3 --store-faults 0.2 "
    "--wire-faults 0.2 --seed 102 --store postgresql://postgres@127.0.0.1:5432/postgres": (
        "the proof run: 8 minutes; its short form is tests/processes/test_chaos_faults.py"
    ),
    "sinkgate chaos --jobs 3800 --workers 24 --duration 320 --store-faults 0.2 "
    "--wire-faults 0.2 --seed 101": (
        "the proof run: 8 minutes; its short form is tests/processes/test_chaos_faults.py"
    ),
}


def shown_commands(text: str) -> list[str]:
    """Every command of the `sh` blocks of `text` (comments and `\\` joins undone),
    and the `$ ` lines of its `console` blocks outside the walk."""
    walk = {step.command for step in walk_steps(text)}
    commands = [
        line[2:]
        for body in re.findall(r"```console\n(.*?)```", text, re.S)
        for line in body.splitlines()
        if line.startswith("$ ") and line[2:] not in walk
    ]
    for body in re.findall(r"```sh\n(.*?)```", text, re.S):
        joined = re.sub(r"\\\n\s*", "", body)
        for line in joined.splitlines():
            command = re.sub(r"\s+#(\s.*)?$", "", line).strip()
            if command and not command.startswith("#"):
                commands.append(command)
    return commands


SUITE = re.compile(r"python3 -m pip install -q -e '\.\[test\]' && .*python3 -m pytest -q.*")


def suite_command(readme: str) -> str:
    """The README's command that installs and runs the whole suite."""
    (command,) = [c for c in shown_commands(readme) if SUITE.fullmatch(c)]
    return command


def test_the_suite_command_is_exactly_what_ci_runs() -> None:
    """`.ci/run` runs the README's command as one line of its own (with node; the
    Python half alone where node is missing outside CI), TypeScript included."""
    command = suite_command(README.read_text(encoding="utf-8"))
    ci = (README.parent / ".ci" / "run").read_text(encoding="utf-8")
    assert command in [line.strip() for line in ci.splitlines()]
    assert "npm --prefix clients/typescript test" in command


def test_every_command_in_the_docs_is_run_by_a_test() -> None:
    ci_command = suite_command(README.read_text(encoding="utf-8"))
    for command in shown_commands(user_docs()):
        if command == ci_command or command in NOT_RUN:
            continue
        command = re.sub(r"^(OTEL_\w+=\S+ )+", "", command)  # the variables the test sets
        assert command in RUN_ELSEWHERE, f"no test runs this command of the docs: {command}"
        path, proof = RUN_ELSEWHERE[command]
        assert proof in (README.parent / path).read_text(encoding="utf-8"), (command, path)
