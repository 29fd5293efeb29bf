"""A reload signal that reaches a worker of `serve --workers N` while it starts
is held for its handlers, not its death (SIGHUP's and SIGUSR2's default action
ends a process). Run in a child interpreter: the parent blocks signals and forks."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# A worker that, before any handler of its own, is sent each reload signal (as the
# parent would relay a reload while it starts), then reports whether it still
# holds them pending, and stops the parent.
SCRIPT = textwrap.dedent(
    """
    import os, signal, sys
    from gateway.supervisor import RELOADS, Supervisor

    for signum in RELOADS:  # their default action, even where this runs under nohup
        signal.signal(signum, signal.SIG_DFL)

    def run(slot):
        for signum in sorted(RELOADS):
            os.kill(os.getpid(), signum)
        held = RELOADS <= signal.sigpending()
        slot.ready()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the parent passes its stop on
        os.kill(os.getppid(), signal.SIGTERM)
        return 0 if held else 3

    sys.exit(Supervisor(1, ("127.0.0.1", 0), ("127.0.0.1", 0), run).main())
    """
)


@pytest.mark.parametrize("held", [True, False])
def test_a_reload_signal_while_a_worker_starts_waits_for_its_handlers(held: bool) -> None:
    script = SCRIPT
    if not held:  # the protection off: the worker lets them in at its start
        script = script.replace(
            "def run(slot):",
            "def run(slot):\n    signal.pthread_sigmask(signal.SIG_UNBLOCK, RELOADS)",
        )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60
    )
    if held:
        assert done.returncode == 0, done.stderr
    else:  # ended by the first signal before it served: the start fails
        assert done.returncode == 1
        assert "signal=SIGHUP" in done.stdout + done.stderr
