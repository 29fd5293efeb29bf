"""Optional lease API tokens (`[server] lease_tokens_env`): without them anyone who
reaches the main listener can release or complete any job."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import structlog

from gateway.config.model import load_config
from gateway.errors import ConfigError
from leases import StoreUnavailable, open_store
from tests.harness import destination, make_config, recording_upstream, running_gateway


async def test_lease_api_with_tokens_refuses_callers_without_one(tmp_path: Path) -> None:
    async with recording_upstream() as upstream:
        config = make_config(tmp_path, destination("pay", upstream.url))
        config = replace(config, lease_tokens=("lease-secret",))
        async with running_gateway(config) as gw:
            url = f"{gw.url}/leases/job-1/claim"
            body = {"owner": "a", "ttl": 5}
            with structlog.testing.capture_logs() as logs:
                async with gw.session.post(url, json=body) as resp:
                    assert resp.status == 401
                    assert resp.headers["Sinkgate-Rejected"] == "unauthorized"
                    assert (await resp.json())["job_id"] == "job-1"
                async with gw.session.post(f"{gw.url}/leases/%FF/claim", json=body) as resp:
                    assert resp.status == 401  # the token first, the job id after
            lines = [(e["job_id"], e["reason"]) for e in logs if e["event"] == "lease_decision"]
            assert lines == [("job-1", "unauthorized"), (None, "unauthorized")]
            wrong = {"Authorization": "Bearer lease-secreT"}
            async with gw.session.post(url, json=body, headers=wrong) as resp:
                assert resp.status == 401
            assert await gw.store.get("job-1") is None  # nothing claimed

            async with await open_store(gw.url, token="lease-secret") as store:
                lease = await store.claim("job-1", owner="a", ttl=5)
                assert (await store.complete(lease)).state == "done"
            async with await open_store(gw.url) as anonymous:
                with pytest.raises(StoreUnavailable):
                    await anonymous.get("job-1")


# What a browser adds to a request a page makes: from another site, and from a
# page whose host name a DNS rebinding pointed at the gateway (same-origin,
# `Host` the page's name: only a page's marks tell it from a worker).
PAGES = [
    {"Sec-Fetch-Site": "cross-site", "Origin": "https://evil.example"},
    {"Sec-Fetch-Site": "same-site", "Origin": "http://127.0.0.1:1"},
    {"Origin": "https://evil.example"},  # an older browser: Origin only
    # A sandboxed iframe on a plain-HTTP, non-loopback host: no Sec-Fetch-*.
    {"Origin": "null"},
    {"Sec-Fetch-Site": "same-origin", "Origin": "http://rebound.example:8480"},
    {"Sec-Fetch-Site": "same-origin"},  # a rebound page's fetch() of a lease
]


@pytest.mark.parametrize("page", PAGES)
async def test_a_page_in_a_browser_cannot_call_the_lease_api(
    tmp_path: Path, page: dict[str, str]
) -> None:
    """Without tokens, a page could POST a claim as text/plain (no preflight), or,
    rebound to the gateway's address, read a lease's owner and generation to write
    as its holder; the browser marks the page's requests, which change nothing."""
    async with recording_upstream() as upstream:
        config = make_config(tmp_path, destination("pay", upstream.url))
        async with running_gateway(config) as gw:
            url = f"{gw.url}/leases/job-1/claim"
            text = {**page, "Content-Type": "text/plain"}
            async with gw.session.post(url, data='{"owner": "a", "ttl": 5}', headers=text) as resp:
                assert resp.status == 403
                assert resp.headers["Sinkgate-Rejected"] == "unauthorized"
            assert await gw.store.get("job-1") is None  # nothing claimed
            # The same call from a program goes on; the page cannot read it either.
            async with gw.session.post(url, json={"owner": "a", "ttl": 5}) as resp:
                assert resp.status == 200
            async with gw.session.get(f"{gw.url}/leases/job-1", headers=page) as resp:
                assert resp.status == 403
                assert "owner" not in await resp.text()
            # A lease's URL typed into the address bar is the user's, not a page's.
            typed = {"Sec-Fetch-Site": "none", "Sec-Fetch-Mode": "navigate"}
            async with gw.session.get(f"{gw.url}/leases/job-1", headers=typed) as resp:
                assert resp.status == 200


@pytest.mark.parametrize("page", PAGES[-2:])
async def test_a_rebound_page_cannot_write_with_a_lease_it_read(
    tmp_path: Path, page: dict[str, str]
) -> None:
    """A page same-origin with the gateway sends custom headers without asking:
    with a worker's job, generation and owner it would write as the worker."""
    async with recording_upstream() as upstream:
        config = make_config(tmp_path, destination("pay", upstream.url))
        async with running_gateway(config) as gw:
            lease = await gw.store.claim("job-1", owner="worker-a", ttl=30)
            fencing = {
                "Fencing-Job": "job-1",
                "Fencing-Token": str(lease.generation),
                "Fencing-Owner": "worker-a",
                "Idempotency-Key": "job-1:charge",
            }
            url = f"{gw.url}/to/pay/charges"
            headers = {**page, **fencing}
            async with gw.session.post(url, json={"amount": 1}, headers=headers) as resp:
                assert resp.status == 403
                assert resp.headers["Sinkgate-Rejected"] == "unauthorized"
            assert upstream.received == []  # nothing forwarded
            async with gw.session.post(url, json={"amount": 1}, headers=fencing) as resp:
                assert resp.status == 201  # the worker's own write, same key, goes on
            assert len(upstream.received) == 1


async def test_on_loopback_a_host_name_that_is_not_loopbacks_is_refused(tmp_path: Path) -> None:
    """A rebound page on a plain-HTTP name sends no Sec-Fetch-* (and no Origin on
    a GET): the name it sends is what tells it, on a listener that is loopback's
    alone. Nothing read, claimed or written; loopback's own names go on."""
    async with recording_upstream() as upstream:
        config = make_config(tmp_path, destination("pay", upstream.url))
        async with running_gateway(config) as gw:
            lease = await gw.store.claim("job-1", owner="worker-a", ttl=30)
            rebound = {"Host": "rebound.example:8480"}
            fencing = {
                "Fencing-Job": "job-1",
                "Fencing-Token": str(lease.generation),
                "Fencing-Owner": "worker-a",
                "Idempotency-Key": "job-1:charge",
            }
            async with gw.session.get(f"{gw.url}/leases/job-1", headers=rebound) as resp:
                assert resp.status == 403
                assert "worker-a" not in await resp.text()
            claim = f"{gw.url}/leases/job-2/claim"
            async with gw.session.post(
                claim, json={"owner": "a", "ttl": 5}, headers=rebound
            ) as resp:
                assert resp.status == 403
            assert await gw.store.get("job-2") is None
            write = f"{gw.url}/to/pay/charges"
            async with gw.session.post(write, json={}, headers={**rebound, **fencing}) as resp:
                assert resp.status == 403
                assert resp.headers["Sinkgate-Rejected"] == "unauthorized"
            assert upstream.received == []
            port = gw.url.rsplit(":", 1)[1]
            for host in (f"localhost:{port}", f"127.0.0.1:{port}", "app.localhost"):
                async with gw.session.get(f"{gw.url}/leases/job-1", headers={"Host": host}) as resp:
                    assert resp.status == 200, host


def _write(tmp_path: Path, server: str) -> Path:
    (tmp_path / "gateway.toml").write_text(f"[server]\n{server}\n", encoding="utf-8")
    return tmp_path / "gateway.toml"


def test_lease_tokens_are_read_from_the_named_variable(tmp_path: Path) -> None:
    path = _write(tmp_path, 'lease_tokens_env = "LEASE_TOKENS"')
    config = load_config(path, {"LEASE_TOKENS": "t1, t2"})
    assert config.lease_tokens == ("t1", "t2")
    assert "t1" not in repr(config)
    assert load_config(_write(tmp_path, ""), {}).lease_tokens is None


def test_lease_tokens_variable_unset_is_a_config_error(tmp_path: Path) -> None:
    path = _write(tmp_path, 'lease_tokens_env = "LEASE_TOKENS"')
    with pytest.raises(ConfigError, match=r"gateway.toml: server.lease_tokens_env: .*LEASE_TOKENS"):
        load_config(path, {})
