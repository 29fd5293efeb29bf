"""The examples' ledger numbers on from the entries an earlier run recorded."""

from __future__ import annotations

import json
from pathlib import Path

from aiohttp.test_utils import TestClient, TestServer

from examples.ledger import make_app


async def test_a_restarted_ledger_numbers_on_and_lists_the_earlier_entries(
    tmp_path: Path,
) -> None:
    record = tmp_path / "ledger.jsonl"
    for run, amount in enumerate((5, 7), start=1):
        async with TestClient(TestServer(make_app(record))) as client:
            answer = await client.post("/entries", json={"amount": amount})
            assert answer.status == 201 and (await answer.json())["n"] == run
            listed = await (await client.get("/entries")).json()
            assert [e["entry"]["amount"] for e in listed["entries"]] == [5, 7][:run]
    lines = [json.loads(line) for line in record.read_text().splitlines()]
    assert [line["n"] for line in lines] == [1, 2]  # one numbering across both runs
