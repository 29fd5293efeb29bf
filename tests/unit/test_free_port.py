"""The ports the chaos run and the process tests give their gateways."""

from __future__ import annotations

import socket

from gateway.tools.chaos.processes import ephemeral_low, free_port


def test_a_free_port_is_bindable_and_below_the_range_of_outgoing_connections() -> None:
    """A port from the ephemeral range can be taken by any outgoing connection in
    the moment before the gateway binds it (a CI run failed on exactly that:
    `address already in use` at a gateway's start)."""
    low = ephemeral_low()
    ports = {free_port() for _ in range(20)}
    assert all(1024 <= port < low for port in ports), (low, sorted(ports))
    assert len(ports) > 1  # drawn, not one fixed port
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))  # free now
