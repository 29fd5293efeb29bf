"""`serve`: the watched janitor and the admin listener's start-up rule."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from gateway import app as app_module
from gateway.store import janitor as janitor_module
from tests.harness import make_config


async def test_a_crashed_janitor_stops_the_gateway(tmp_path: Path, monkeypatch) -> None:
    """The retention janitor is watched: if it dies, serve() says so and stops
    instead of letting the store grow unnoticed."""
    crashed = asyncio.Event()

    async def broken_janitor(*args: object, **kwargs: object) -> None:
        await asyncio.sleep(0)
        crashed.set()
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(janitor_module, "run_janitor", broken_janitor)
    started: list[dict[str, object]] = []
    with pytest.raises(RuntimeError, match="retention janitor stopped"):
        await asyncio.wait_for(app_module.serve(make_config(tmp_path), started=started.append), 30)
    assert crashed.is_set() and started and started[0]["listen"]


async def test_admin_beyond_loopback_without_a_token_refuses_to_start(tmp_path: Path) -> None:
    config = replace(make_config(tmp_path), admin_listen=("0.0.0.0", 0), admin_token=None)
    with pytest.raises(SystemExit, match="refusing to start"):
        await app_module.serve(config)
