"""The two middleware examples of docs/destination-fence.md of "Fencing at the destination" work as
printed (only the database path is moved into the test's directory)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.test_fence_middleware import asgi_call
from tests.harness import serving

PAGE = Path(__file__).resolve().parents[2] / "docs" / "destination-fence.md"


def example(marker: str, tmp_path: Path) -> dict[str, Any]:
    """Run the page's block after `marker` as a module (its `__main__` guard off)."""
    text = PAGE.read_text(encoding="utf-8")
    match = re.search(r"```python\n(.*?)```", text[text.index(marker) :], re.S)
    assert match is not None, marker
    code = match.group(1)
    code_lines = [line for line in code.splitlines() if line.strip()]
    assert len(code_lines) <= 17, f"{marker}: {len(code_lines)} lines"
    ast.parse(code)
    code = code.replace("sqlite:///ledger.db", f"sqlite:///{tmp_path / 'ledger.db'}")
    namespace: dict[str, Any] = {"__name__": "readme_example"}
    exec(compile(code, marker, "exec"), namespace)
    return namespace


async def test_the_aiohttp_example_refuses_a_stale_charge(tmp_path: Path) -> None:
    app = example("<!-- fence-aiohttp-example", tmp_path)["app"]
    async with serving(app) as base, aiohttp.ClientSession() as session:
        answers = []
        for token in ("8", "7"):
            headers = {"Fencing-Job": "order-1001", "Fencing-Token": token}
            async with session.post(f"{base}/charges", json={"amount": 5}, headers=headers) as r:
                answers.append((r.status, r.headers.get("Sinkgate-Rejected"), await r.json()))
    assert answers[0] == (201, None, {"charged": 5})
    assert answers[1][:2] == (409, "stale_generation")


async def test_the_asgi_example_refuses_a_stale_charge(tmp_path: Path) -> None:
    pytest.importorskip("starlette")
    app = example("<!-- fence-asgi-example", tmp_path)["app"]
    try:
        charge = b'{"amount": 5}'
        fresh = await asgi_call(app, "/charges", {"Fencing-Job": "o", "Fencing-Token": "8"}, charge)
        stale = await asgi_call(app, "/charges", {"Fencing-Job": "o", "Fencing-Token": "7"}, charge)
    finally:
        await app.close()
    assert fresh[0] == 201 and json.loads(fresh[2]) == {"charged": 5}
    assert stale[0] == 409 and json.loads(stale[2])["reason"] == "stale_generation"
