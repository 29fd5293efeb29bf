"""The queue extras keep a working set in any order of installs (issue: `pip install
'sinkgate[celery]'` then `'sinkgate[arq]'` once downgraded redis under kombu 5.7,
whose Redis transport then refused to start; `pip check` saw nothing).

Each order runs in a fresh virtual environment (pip's cache makes a second run
quick); both workers are then started for real against Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from tests.harness import repository_build
from tests.processes.queue_stack import REDIS_URL, require_redis

REPO = Path(__file__).resolve().parents[2]

APPS = """
import os

from arq.connections import RedisSettings
from celery import Celery

import leases.integrations.arq  # noqa: F401  the adapters load beside their queue
import leases.integrations.celery  # noqa: F401

URL = os.environ["QUEUE_REDIS"]
celery_app = Celery("extras", broker=URL)


async def noop(ctx):
    return None


class WorkerSettings:
    functions = [noop]
    redis_settings = RedisSettings.from_dsn(URL)
    queue_name = "sinkgate-extras-test"
    burst = True  # nothing queued: start, find the queue empty, exit 0
"""


def _pip(python: Path, *args: str) -> None:
    result = subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _start_celery(python: Path, cwd: Path, env: dict[str, str]) -> str:
    """Start a Celery worker, wait for its `ready`, stop it; returns what it said."""
    argv = [str(python), "-m", "celery", "-A", "apps", "worker", "--pool", "solo",
            "-Q", "sinkgate-extras-test", "--without-gossip", "--without-mingle",
            "--without-heartbeat", "--loglevel", "INFO"]  # fmt: skip
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    said: list[str] = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            said.append(line)
            if " ready." in line:
                break
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return "".join(said)


@pytest.mark.slow
@pytest.mark.parametrize("order", [("celery", "arq"), ("arq", "celery")])
def test_the_queue_extras_installed_one_after_the_other_both_start(
    tmp_path: Path, order: tuple[str, str]
) -> None:
    require_redis()
    venv.create(tmp_path / "venv", with_pip=True)
    python = tmp_path / "venv" / "bin" / "python"
    for extra in order:
        with repository_build():  # another test process may be building it now
            _pip(python, f"{REPO}[{extra}]")
    (tmp_path / "apps.py").write_text(APPS, encoding="utf-8")
    env = {**os.environ, "QUEUE_REDIS": REDIS_URL, "PYTHONPATH": ""}
    env.pop("VIRTUAL_ENV", None)
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout
    said = _start_celery(python, tmp_path, env)
    assert " ready." in said and "VersionMismatch" not in said, said
    arq = subprocess.run(
        [str(python), "-m", "arq", "apps.WorkerSettings"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert arq.returncode == 0, arq.stdout + arq.stderr
    assert sys.executable != str(python)  # the fresh environment ran them, not ours
