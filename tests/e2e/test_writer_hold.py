"""A writer given what `hold()` yields refuses to send once the lease may be gone."""

from __future__ import annotations

from pathlib import Path

import pytest

from leases import FencedWriter, LeaseLost, hold
from tests.harness import destination, make_config, recording_upstream, running_gateway


async def test_writer_inside_hold_refuses_once_the_local_deadline_passed(tmp_path: Path) -> None:
    """Between the worker's own deadline passing and the watchdog waking up, the
    writer itself refuses: no effect under a lease that may have run out."""
    async with recording_upstream() as upstream:
        config = make_config(tmp_path, destination("payments", upstream.url + "/api"))
        async with running_gateway(config) as gw:
            with pytest.raises(LeaseLost) as held:  # ... and hold() says so on exit
                async with hold(gw.store, "job-1", owner="a", ttl=30, on_exit="keep") as lease:
                    async with FencedWriter(gw.url, lease, max_retries=0) as writer:
                        assert (await writer.post("payments", "/one", step="one")).status == 201
                        lease.hold.deadline = 0.0  # the worker's monotonic clock: run out
                        with pytest.raises(LeaseLost) as lost:
                            await writer.post("payments", "/two", step="two")
                        assert lost.value.reason == "lease_expired"
            assert held.value is lost.value
            assert upstream.paths() == ["/api/one"]
