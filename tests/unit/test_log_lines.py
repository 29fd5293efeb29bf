"""`info_line`, the write route's cheap way to the JSON log, and the time stamp.

The autouse fixture in tests/conftest.py gives each test the logging it found."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import structlog
from structlog.testing import capture_logs

from gateway.telemetry import logs
from gateway.telemetry.logs import configure_logging, info_line, utc_timestamp
from leases.reasons import Reason

FIELDS = {
    "destination": "payments",
    "generation": 7,
    "reason": Reason.DUPLICATE,
    "rejection_id": None,
    "total_ms": 1.25,
}
# Beyond orjson: the standard library's encoder takes the whole line.
HUGE = {**FIELDS, "huge": 2**70}


def _lines(capsys: pytest.CaptureFixture[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in capsys.readouterr().err.splitlines()]


@pytest.mark.parametrize("fields", [FIELDS, HUGE], ids=["orjson", "stdlib"])
def test_info_line_writes_what_structlog_writes_field_for_field_in_its_order(
    capsys: pytest.CaptureFixture[str], fields: dict[str, object]
) -> None:
    configure_logging("info", json=True)
    log = structlog.get_logger("gateway.write")
    with structlog.contextvars.bound_contextvars(worker=2):
        info_line(log, "write_decision", fields)
        log.info("write_decision", **fields)
    fast, slow = _lines(capsys)
    assert list(fast) == list(slow)  # same keys, same order
    fast.pop("timestamp"), slow.pop("timestamp")
    assert fast == slow
    assert fast["worker"] == 2 and fast["level"] == "info" and fast["reason"] == "duplicate"
    assert fields.keys().isdisjoint({"event", "level", "timestamp"})  # the caller's dict is kept


@pytest.mark.parametrize("fields", [FIELDS, HUGE], ids=["orjson", "stdlib"])
def test_info_line_writes_structlogs_bytes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, fields: dict[str, object]
) -> None:
    """Byte for byte, at one instant: orjson called at once, the newline its own."""
    monkeypatch.setattr(logs.time, "time_ns", lambda: 1_764_606_639_135_006_999)
    configure_logging("info", json=True)
    log = structlog.get_logger("gateway.write")
    info_line(log, "write_decision", {**fields, "odd": object}, owned=True)
    log.info("write_decision", **fields, odd=object)
    fast, slow = capsys.readouterr().err.splitlines(keepends=True)
    assert fast == slow and fast.endswith("\n") and "<class 'object'>" in fast


def test_an_owned_dict_gives_the_same_line_made_in_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("info", json=True)
    log = structlog.get_logger("gateway.write")
    owned = dict(FIELDS)
    info_line(log, "write_decision", dict(FIELDS))
    info_line(log, "write_decision", owned, owned=True)
    copied, made_in = _lines(capsys)
    assert list(copied) == list(made_in)
    copied.pop("timestamp"), made_in.pop("timestamp")
    assert copied == made_in
    assert owned["event"] == "write_decision"  # the caller's dict became the line


def test_info_line_honours_the_level(capsys: pytest.CaptureFixture[str]) -> None:
    configure_logging("warning", json=True)
    info_line(structlog.get_logger(), "write_decision", FIELDS)
    assert capsys.readouterr().err == ""


def test_info_line_goes_through_structlog_when_another_configuration_holds(
    capsys: pytest.CaptureFixture[str],
) -> None:
    configure_logging("info", json=True)
    with capture_logs() as captured:
        info_line(structlog.get_logger(), "write_decision", {"destination": "payments"})
    assert captured == [{"destination": "payments", "event": "write_decision", "log_level": "info"}]
    assert capsys.readouterr().err == ""
    assert logs._JSON_LINES is not None  # it was set up, and stood aside


@pytest.mark.parametrize(
    "nanos", [1_700_000_000_000_000_000, 1_700_000_000_250_000_000, 1_764_606_639_135_006_999]
)
def test_utc_timestamp_is_structlogs_iso_format(
    monkeypatch: pytest.MonkeyPatch, nanos: int
) -> None:
    monkeypatch.setattr(logs.time, "time_ns", lambda: nanos)
    second, rest = divmod(nanos, 10**9)
    moment = datetime.fromtimestamp(second, UTC).replace(microsecond=rest // 1000)
    assert utc_timestamp() == moment.isoformat().replace("+00:00", "Z")


def test_a_librarys_warning_is_one_line_without_its_traceback(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """asyncpg's pool warns with its exception, every retry, while the database
    refuses connections: a traceback of the driver's frames in every line."""
    import logging

    configure_logging("info", json=True)
    pool = logging.getLogger("asyncpg.pool")
    try:
        raise ConnectionError("the database is not accepting connections")
    except ConnectionError:
        pool.warning("Failed to restore the pool connection floor; retrying", exc_info=True)
        pool.error("and an error keeps it", exc_info=True)
    warning, error = _lines(capsys)
    assert "exception" not in warning and warning["logger"] == "asyncpg.pool"
    assert warning["event"] == (
        "Failed to restore the pool connection floor; retrying: ConnectionError: "
        "the database is not accepting connections"
    )
    assert error["exception"]


def test_console_lines_to_a_pipe_carry_no_colour_codes(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`--log-format console 2> file` wrote ANSI escapes into the file."""
    configure_logging("info", json=False)
    structlog.get_logger("gateway.cli").info("serving", listen="127.0.0.1:8480")
    err = capsys.readouterr().err
    assert "serving" in err and "\x1b[" not in err
