"""The write route's refusals are declared once (gateway.write.refusals): the
OpenAPI document lists them by status, and the route's modules name no other."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.errors import STATUS_BY_REASON
from gateway.write.refusals import REFUSALS
from leases.reasons import Reason

REPO = Path(__file__).resolve().parents[2]
# Where the write route's own answers are made: its modules, the pure decision, and
# the body reader it calls.
ROUTE_MODULES = (
    *sorted((REPO / "gateway" / "write").glob("*.py")),
    REPO / "gateway" / "policy" / "decision.py",
    REPO / "gateway" / "http" / "bodies.py",
)
DECLARED = {reason for _, reasons in REFUSALS for reason in reasons}


def test_each_status_is_declared_once_with_reasons_of_that_status() -> None:
    statuses = [STATUS_BY_REASON[reasons[0]] for _, reasons in REFUSALS]
    assert len(statuses) == len(set(statuses))
    for (_, reasons), status in zip(REFUSALS, statuses, strict=True):
        assert {STATUS_BY_REASON[r] for r in reasons} == {status}


def test_every_reason_the_route_names_is_declared() -> None:
    """Checked by hand: a `Reason.JOB_COMPLETED` left out of REFUSALS fails here."""
    named = {
        Reason[name]
        for path in ROUTE_MODULES
        for name in re.findall(r"Reason\.([A-Z_]+)", path.read_text(encoding="utf-8"))
    }
    assert named - {Reason.DUPLICATE} <= DECLARED  # a replay is an answer, not a refusal
