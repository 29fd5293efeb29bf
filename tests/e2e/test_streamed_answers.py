"""Answers over `max_replay_body` are streamed through, not buffered: their
outcome is recorded before the relay, so a worker that goes away mid-stream
cannot stop it; an upstream that breaks off mid-body never looks complete."""

from __future__ import annotations

from pathlib import Path

import aiohttp
from aiohttp import web

from gateway.policy.decision import Fencing, KeyState
from tests.harness import (
    catch_all,
    destination,
    eventually,
    make_config,
    running_gateway,
    serving,
)

CHUNK = b"x" * 65536
CHUNKS = 64  # 4 MiB


async def long_answer(request: web.Request) -> web.StreamResponse:
    await request.read()
    response = web.StreamResponse()
    if request.path.endswith("/broken"):
        response.content_length = len(CHUNK) * CHUNKS
    await response.prepare(request)
    for n in range(CHUNKS):
        if n == 8 and request.path.endswith("/broken"):
            assert request.transport is not None
            request.transport.abort()  # breaks off mid-body
            return response
        await response.write(CHUNK)
    await response.write_eof()
    return response


def headers(key: str) -> dict[str, str]:
    return {"Fencing-Job": "job-1", "Fencing-Token": "1", "Idempotency-Key": key}


async def test_worker_gone_mid_stream_still_gets_the_outcome_recorded(tmp_path: Path) -> None:
    async with serving(catch_all(long_answer)) as upstream:
        dest = destination("big", upstream, fencing=Fencing.MONOTONIC, max_replay_body=1024)
        async with running_gateway(make_config(tmp_path, dest)) as gw:
            async with aiohttp.ClientSession() as session:
                resp = await session.post(
                    f"{gw.url}/to/big/blob", data=b"{}", headers=headers("gone")
                )
                assert resp.status == 200
                await resp.content.read(100_000)  # some of it, then the worker goes away
                resp.close()

            async def completed() -> bool:
                record = await gw.store.key_record("big", "gone")
                return record is not None and record.state == KeyState.COMPLETED

            await eventually(completed)
            record = await gw.store.key_record("big", "gone")
            assert record is not None and record.body_omitted
            async with gw.session.post(
                f"{gw.url}/to/big/blob", data=b"{}", headers=headers("gone")
            ) as replay:
                assert (replay.status, await replay.read()) == (200, b"")
                assert replay.headers["Sinkgate-Replay-Body"] == "omitted"


async def test_whole_stream_arrives_and_an_upstream_cut_shows_as_cut(tmp_path: Path) -> None:
    async with serving(catch_all(long_answer)) as upstream:
        dest = destination("big", upstream, fencing=Fencing.MONOTONIC, max_replay_body=1024)
        async with running_gateway(make_config(tmp_path, dest)) as gw:
            async with gw.session.post(
                f"{gw.url}/to/big/whole", data=b"{}", headers=headers("whole")
            ) as resp:
                assert (resp.status, len(await resp.read())) == (200, len(CHUNK) * CHUNKS)
            cut = False
            async with gw.session.post(
                f"{gw.url}/to/big/broken", data=b"{}", headers=headers("broken")
            ) as resp:
                assert resp.status == 200
                try:
                    await resp.read()
                except aiohttp.ClientPayloadError:
                    cut = True
            assert cut  # a cut body never reads as a complete answer
