"""How a Celery run's end becomes `task.retry(...)`: waits for a lease held
elsewhere are unlimited and do not use up the task's own `max_retries` (real
Celery carries the count in the message's headers; a worker run of this, on
Redis, passed 4 waits then 2 store outages with max_retries=3)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from celery.app.task import Context  # type: ignore[import-untyped]

from leases.integrations.celery import WAITS_HEADER, _apply, waits_for_holders
from leases.integrations.gate import Verdict
from leases.reasons import Reason


class Retried(Exception):
    def __init__(self, options: dict[str, Any]) -> None:
        self.options = options


class FakeTask:
    name = "shop.charge"

    def __init__(self, retries: int, waits: int | None = None, max_retries: int | None = 3):
        self.max_retries = max_retries
        # As a worker gives it: a message's custom headers are attributes too, and
        # RabbitMQ's dead-letter headers may be among them.
        headers: dict[str, Any] = {"x-death": [{"count": 1}], "mine": 1}
        custom = {}
        if waits is not None:
            headers[WAITS_HEADER] = custom[WAITS_HEADER] = waits
        self.request = Context(id="t-1", retries=retries, is_eager=False, headers=headers, **custom)

    def retry(self, **options: Any) -> Retried:
        if "max_retries" in options:  # as Celery's Task.retry does
            self.override_max_retries = options["max_retries"]
        return Retried(options)


HELD = Verdict("retry", Reason.LEASE_HELD, 2.0)
DOWN = Verdict("retry", Reason.STORE_UNAVAILABLE, 1.0)


def retry_of(task: FakeTask, found: Verdict) -> dict[str, Any]:
    with pytest.raises(Retried) as raised:
        _apply(task, found, "order-1")  # type: ignore[arg-type]
    return raised.value.options


def test_a_wait_for_a_holder_is_unlimited_and_counted_in_the_headers() -> None:
    options = retry_of(FakeTask(retries=7, waits=7), HELD)
    assert options["max_retries"] == 8  # always one more than it has had
    assert options["headers"][WAITS_HEADER] == 8
    assert options["countdown"] == 2.0
    # The message's own headers go on, but for RabbitMQ's x-death, which Celery
    # leaves out of a retry (published again, RabbitMQ < 4.0.1 drops the message).
    assert options["headers"]["mine"] == 1 and "x-death" not in options["headers"]


def test_waits_for_holders_leave_the_tasks_own_retries_whole() -> None:
    """Seven waits, then the store is down: three retries are still there (Celery
    refuses a retry once its `retries` passes `max_retries`)."""
    options = retry_of(FakeTask(retries=7, waits=7), DOWN)
    assert options["max_retries"] == 3 + 7
    assert options["headers"][WAITS_HEADER] == 7  # carried on to the next retry
    assert retry_of(FakeTask(retries=2), DOWN) == {"countdown": 1.0}  # no waits: Celery's own


def test_a_task_without_a_limit_keeps_none_and_an_eager_run_counts_every_retry() -> None:
    assert "max_retries" not in retry_of(FakeTask(retries=9, waits=2, max_retries=None), DOWN)
    eager = FakeTask(retries=1, waits=1)
    eager.request.is_eager = True
    assert retry_of(eager, HELD) == {"countdown": 2.0}


@pytest.mark.parametrize("value", [None, -1, True, "3", 2.5])
def test_a_header_that_is_no_count_reads_as_none(value: object) -> None:
    request = SimpleNamespace(headers={WAITS_HEADER: value})
    assert waits_for_holders(request) == 0
    assert waits_for_holders(SimpleNamespace(**{WAITS_HEADER: 4}, headers=None)) == 4


def test_a_retrys_max_retries_is_not_left_on_the_shared_task_object() -> None:
    """Celery keeps it there for autoretry_for, which would bound another message's
    retries by this run's count of waits."""
    task = FakeTask(retries=7, waits=7)
    retry_of(task, HELD)
    assert not hasattr(task, "override_max_retries")
