"""The admin page in a real headless browser (Debian's chromium + chromedriver, via Selenium).

Skipped when the browser, its driver or Selenium is missing; under CI=true that
is a failure instead. Nothing is downloaded: the driver's path is given.

Also a screenshot tool for the README:

    python -m tests.e2e.test_admin_browser docs   # docs/admin.png, docs/admin-queue.png
"""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from gateway.admin.app import create_admin_app
from gateway.http.server import GatewayRunner
from gateway.policy.decision import Fencing, WriteFacts
from gateway.policy.records import Outcome, RejectionRecord, WriteContext
from gateway.store.sqlite import SQLiteStore
from gateway.telemetry.metrics import Metrics
from tests.conftest import FakeClock

TOKEN = "browser-test-token"
OPERATORS = (("alice", "alice-browser-token-0123"), ("bob", "bob-browser-token-0123456"))
EXPIRED_JOB = "report-2024-05"  # claimed with a 30 s lease that ran out during the seeding
START = 1_714_564_800.0  # 2024-05-01T12:00:00Z
CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1440,900",
)

SAMPLE = [
    # reason, job, generation, current, destination, path, key
    ("stale_generation", "invoice-2024-0042", 7, 8, "payments", "/charges", "inv-42-charge"),
    ("duplicate", "invoice-2024-0042", 8, 8, "payments", "/charges", "inv-42-charge"),
    ("lease_expired", "mail-digest-17", 3, 3, "emails", "/send", "digest-17"),
    ("idempotency_key_reused", "sync-crm-9", 2, 2, "crm", "/contacts/881", "crm-881"),
    ("older_generation_in_flight", "invoice-2024-0043", 5, 5, "payments", "/charges", "inv-43"),
    ("stale_generation", "mail-digest-17", 2, 3, "emails", "/send", "digest-17-b"),
    ("owner_mismatch", "sync-crm-10", 1, 1, "crm", "/contacts/902", "crm-902"),
    ("request_in_progress", "invoice-2024-0044", 1, 1, "payments", "/refunds", "inv-44-refund"),
    ("unknown_generation", "export-5", 4, 3, "warehouse", "/rows?batch=5", "export-5-rows"),
    ("stale_generation", "invoice-2024-0044", 1, 2, "payments", "/refunds", "inv-44-refund"),
]


async def seed(store: SQLiteStore, clock: FakeClock) -> None:
    for reason, job, generation, current, destination, path, key in SAMPLE:
        await store.record_rejection(
            RejectionRecord(
                reason=reason,
                detail=f"{reason.replace('_', ' ')}",
                destination=destination,
                method="POST",
                path=path,
                job_id=job,
                generation=generation,
                owner="worker-a",
                idempotency_key=key,
                current_generation=current,
                highest_generation=current,
                remote="10.1.4.23",
                body_sha256="9f" * 32,
                body_bytes=214,
            )
        )
        clock.advance(47.0)


# Unknown outcomes for the queue: destination, key, job, generation.
UNKNOWN = [
    ("payments", "inv-45-charge", "invoice-2024-0045", 3),
    ("payments", "inv-46-charge", "invoice-2024-0046", 1),
    ("emails", "digest-18", "mail-digest-18", 2),
]


async def seed_unknown(store: SQLiteStore, clock: FakeClock) -> None:
    """Keys whose forward ended with the upstream dropping the connection."""
    for destination, key, job, generation in UNKNOWN:
        facts = WriteFacts(
            destination=destination,
            method="POST",
            path="/charges",
            query="",
            job_id=job,
            generation=generation,
            owner="worker-a",
            key=key,
            fingerprint="f" * 64,
            fencing=Fencing.MONOTONIC,
            upstream_idempotent=False,
            timeout=10.0,
        )
        context = WriteContext(remote="10.1.4.23", body_sha256="9f" * 32, body_bytes=214)
        verdict = await store.decide_write(facts, context)
        assert verdict.attempt is not None
        await store.record_outcome(facts, verdict.attempt, Outcome("unknown"))
        clock.advance(13.0)


async def seed_history(store: SQLiteStore, clock: FakeClock) -> None:
    """A day of rejections before the sample, for the chart: a quiet night, a busy
    morning, a burst of stale writes after a deploy."""
    start = clock.now
    reasons = ("stale_generation", "duplicate", "lease_expired", "request_in_progress")
    for n in range(0, 24 * 60, 7):
        hour = n // 60
        weight = 1 + (hour >= 7) * 2 + (hour == 15) * 5
        for k in range(weight):
            clock.now = start + n * 60 + k
            await store.record_rejection(
                RejectionRecord(
                    reason=reasons[(n + k) % (len(reasons) if hour != 15 else 1)],
                    detail="history",
                    destination=("payments", "emails", "crm")[(n + k) % 3],
                    job_id=f"history-{n % 40}",
                    generation=1,
                )
            )
    clock.now = start + 24 * 3600


class AdminServer:
    """The admin app with sample rejections, served on loopback from its own thread.
    `history`: a day of earlier rejections and a few unknown outcomes too."""

    def __init__(self, directory: Path, *, history: bool = False) -> None:
        self._directory = directory
        self._history = history
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self.url = ""

    def __enter__(self) -> AdminServer:
        self._thread.start()
        self.url = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(30)
        return self

    def __exit__(self, *exc: object) -> None:
        asyncio.run_coroutine_threadsafe(self._stop(), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(30)
        self._loop.close()

    async def _start(self) -> str:
        clock = FakeClock(START - 24 * 3600 if self._history else START)
        url = "sqlite:///" + str(self._directory / "admin.db")
        self._store = await SQLiteStore.open(url, clock=clock)
        if self._history:
            await seed_history(self._store, clock)
        await self._store.claim(EXPIRED_JOB, owner="worker-b", ttl=30)
        await seed(self._store, clock)
        await seed_unknown(self._store, clock)
        app = create_admin_app(
            self._store, Metrics(), token=TOKEN, operators=OPERATORS, gauge_interval=None
        )
        self._runner = GatewayRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", 0).start()
        host, port = self._runner.addresses[0][:2]
        return f"http://{host}:{port}"

    async def _stop(self) -> None:
        await self._runner.cleanup()
        await self._store.close()


def _missing(reason: str) -> None:
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"{reason} (required under CI=true)")
    pytest.skip(reason)


@contextmanager
def chromium(profile: Path) -> Iterator[Any]:
    """A headless chromium driven through the system chromedriver."""
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        _missing("selenium is not installed (pip install selenium)")
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    driver_path = shutil.which("chromedriver")
    if browser is None or driver_path is None:
        _missing("chromium / chromedriver not found (apt-get install chromium chromium-driver)")
    options = Options()
    options.binary_location = browser
    for flag in (*CHROMIUM_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        driver.set_page_load_timeout(30)
        yield driver
    finally:
        driver.quit()


def replaced(element: Any) -> Any:
    """A wait condition: `element`'s page has been replaced. As Selenium's
    `staleness_of`, but chromedriver may answer a question about an element of a
    page being torn down with an inspector error ("Node with given id does not
    belong to the document") instead of a stale reference: that is gone too."""
    from selenium.common.exceptions import WebDriverException

    def gone(_driver: Any) -> bool:
        try:
            element.is_enabled()
        except WebDriverException:  # StaleElementReferenceException among them
            return True
        return False

    return gone


def sign_in(driver: Any, url: str, token: str = TOKEN) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url + "/admin/")
    driver.find_element(By.ID, "token").send_keys(token)
    driver.find_element(By.ID, "sign-in").click()
    WebDriverWait(driver, 20).until(ec.presence_of_element_located((By.ID, "rejections")))


@pytest.fixture
def server(tmp_path: Path) -> Iterator[AdminServer]:
    with AdminServer(tmp_path) as s:
        yield s


@pytest.fixture
def driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must never fetch anything
    with chromium(tmp_path / "profile") as d:
        yield d


def test_page_lists_rejections_and_a_filter_click_narrows_it(server, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import Select, WebDriverWait

    sign_in(driver, server.url)
    rows = driver.find_elements(By.CSS_SELECTOR, "tr.rejection")
    assert len(rows) == len(SAMPLE)
    assert rows[0].get_attribute("data-reason") == "stale_generation"  # newest first
    assert "invoice-2024-0044" in rows[0].text and "1 / 2" in rows[0].text
    assert "owner_mismatch" in driver.find_element(By.ID, "rejections").text

    table = driver.find_element(By.ID, "rejections")
    Select(driver.find_element(By.ID, "reason")).select_by_value("stale_generation")
    driver.find_element(By.ID, "apply").click()
    WebDriverWait(driver, 20).until(replaced(table))
    WebDriverWait(driver, 20).until(ec.presence_of_element_located((By.ID, "rejections")))

    assert "reason=stale_generation" in driver.current_url
    rows = driver.find_elements(By.CSS_SELECTOR, "tr.rejection")
    expected = [s for s in SAMPLE if s[0] == "stale_generation"]
    assert len(rows) == len(expected) == 3
    assert {r.get_attribute("data-reason") for r in rows} == {"stale_generation"}
    selected = Select(driver.find_element(By.ID, "reason")).first_selected_option
    assert selected.get_attribute("value") == "stale_generation"  # the form keeps the filter

    listing = driver.find_element(By.ID, "rejections")
    rows[0].find_element(By.CSS_SELECTOR, "a[href$='format=html']").click()
    # Wait for the detail page itself, not any h2 the listing may still show.
    WebDriverWait(driver, 20).until(replaced(listing))
    WebDriverWait(driver, 20).until(
        ec.text_to_be_present_in_element((By.TAG_NAME, "h2"), "Rejection #10")
    )
    assert "inv-44-refund" in driver.page_source


def test_job_link_filters_by_job(server, driver):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    sign_in(driver, server.url)
    table = driver.find_element(By.ID, "rejections")
    driver.find_element(By.LINK_TEXT, "mail-digest-17").click()
    WebDriverWait(driver, 20).until(replaced(table))
    rows = WebDriverWait(driver, 20).until(
        ec.presence_of_all_elements_located((By.CSS_SELECTOR, "tr.rejection"))
    )
    assert len(rows) == 2
    assert all("mail-digest-17" in row.text for row in rows)
    job_input = driver.find_element(By.NAME, "job_id")
    assert job_input.get_attribute("value") == "mail-digest-17"


def test_chart_queue_resolve_and_audit(server, driver):
    """Sign in, see the day at a glance, settle an unknown outcome from its form,
    and find the verdict in the audit log; all without any script on the page."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    sign_in(driver, server.url)
    chart = driver.find_element(By.ID, "chart")
    assert chart.tag_name == "svg"
    bars = chart.find_elements(By.CSS_SELECTOR, "rect:not(.hit)")
    assert len(bars) >= 1 and chart.size["width"] > 600
    replays = sum(1 for sample in SAMPLE if sample[0] == "duplicate")
    assert driver.find_element(By.ID, "total").text == str(len(SAMPLE) - replays)
    assert driver.find_element(By.ID, "replays").text == str(replays)
    assert driver.find_element(By.ID, "unknown-count").text == str(len(UNKNOWN))
    assert driver.execute_script("return document.scripts.length") == 0

    glance = driver.find_element(By.ID, "glance")
    driver.find_element(By.LINK_TEXT, "unknown outcomes").click()
    WebDriverWait(driver, 20).until(replaced(glance))
    forms = WebDriverWait(driver, 20).until(
        ec.presence_of_all_elements_located((By.CSS_SELECTOR, "form.resolve"))
    )
    assert len(forms) == len(UNKNOWN)
    form = driver.find_element(By.CSS_SELECTOR, "form.resolve[data-key='inv-46-charge']")
    form.find_element(By.CSS_SELECTOR, "input[value='applied']").click()
    form.find_element(By.NAME, "status").clear()
    form.find_element(By.NAME, "status").send_keys("201")
    form.find_element(By.NAME, "body").send_keys('{"id":"ch_46"}')
    form.find_element(By.NAME, "note").send_keys("PSP dashboard shows ch_46")
    form.find_element(By.CSS_SELECTOR, "button[type='submit']").click()
    WebDriverWait(driver, 20).until(replaced(form))
    notice = WebDriverWait(driver, 20).until(
        ec.presence_of_element_located((By.CSS_SELECTOR, "p.notice"))
    )
    assert "inv-46-charge as applied" in notice.text
    keys = [
        f.get_attribute("data-key") for f in driver.find_elements(By.CSS_SELECTOR, "form.resolve")
    ]
    assert sorted(keys) == ["digest-18", "inv-45-charge"]

    driver.find_element(By.LINK_TEXT, "audit log").click()
    rows = WebDriverWait(driver, 20).until(
        ec.presence_of_all_elements_located((By.CSS_SELECTOR, "#audit tr.audit"))
    )
    assert len(rows) == 1
    assert "resolve_applied" in rows[0].text and "inv-46-charge" in rows[0].text
    assert "PSP dashboard shows ch_46" in rows[0].text

    rows[0].find_element(By.LINK_TEXT, "inv-46-charge").click()
    state = WebDriverWait(driver, 20).until(ec.presence_of_element_located((By.ID, "key-state")))
    assert state.text == "completed"
    assert "201" in driver.find_element(By.CSS_SELECTOR, "table.fields").text


def resolve_in_queue(driver: Any, key: str, note: str) -> None:
    """Settle `key` as not applied from its form on the queue page."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    form = driver.find_element(By.CSS_SELECTOR, f"form.resolve[data-key='{key}']")
    form.find_element(By.CSS_SELECTOR, "input[value='not_applied']").click()
    form.find_element(By.NAME, "note").send_keys(note)
    form.find_element(By.CSS_SELECTOR, "button[type='submit']").click()
    WebDriverWait(driver, 20).until(replaced(form))
    notice = WebDriverWait(driver, 20).until(
        ec.presence_of_element_located((By.CSS_SELECTOR, "p.notice"))
    )
    assert f"{key} as not applied" in notice.text


def test_two_operators_each_resolve_a_key_and_the_audit_log_names_both(server, driver):
    """Named operators (SPEC 4): alice and bob sign in with their own tokens, each
    settles a key from the queue; the page says who is signed in and the audit log
    says who did what."""
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support import expected_conditions as ec
    from selenium.webdriver.support.ui import WebDriverWait

    for (name, token), key in zip(OPERATORS, ("inv-45-charge", "digest-18"), strict=True):
        driver.delete_all_cookies()  # the next person, in the same browser
        sign_in(driver, server.url, token)
        assert driver.find_element(By.ID, "signed-in").text == name
        driver.get(server.url + "/admin/queue")
        resolve_in_queue(driver, key, f"{name} checked the destination")

    driver.get(server.url + "/admin/audit?format=html")
    rows = WebDriverWait(driver, 20).until(
        ec.presence_of_all_elements_located((By.CSS_SELECTOR, "#audit tr.audit"))
    )
    cells = [[td.text for td in row.find_elements(By.TAG_NAME, "td")] for row in rows]
    assert [(c[1], c[4]) for c in cells] == [("bob", "digest-18"), ("alice", "inv-45-charge")]
    assert "bob checked the destination" in rows[0].text


def test_the_job_page_of_an_expired_lease_says_expired(server, driver):
    from selenium.webdriver.common.by import By

    sign_in(driver, server.url)
    driver.get(f"{server.url}/admin/jobs/{EXPIRED_JOB}?format=html")
    fields = driver.find_element(By.CSS_SELECTOR, "table.fields").text
    assert "lease state expired at 2024-05-01T12:00:30" in fields
    assert "by the store's clock" in fields and "lease state active" not in fields


def screenshot(target: Path, queue: Path) -> None:
    """Save screenshots of the page (a day of sample rejections) and of the queue."""
    with tempfile.TemporaryDirectory() as tmp, AdminServer(Path(tmp), history=True) as server:
        with chromium(Path(tmp) / "profile") as driver:
            driver.set_window_size(1440, 1000)
            sign_in(driver, server.url)
            target.parent.mkdir(parents=True, exist_ok=True)
            driver.save_screenshot(str(target))
            driver.get(server.url + "/admin/queue")
            driver.set_window_size(1440, 640)
            driver.save_screenshot(str(queue))
    print(f"saved {target} and {queue}")


if __name__ == "__main__":
    os.environ.setdefault("SE_OFFLINE", "true")
    docs = Path(sys.argv[1] if len(sys.argv) > 1 else "docs")
    screenshot(docs / "admin.png", docs / "admin-queue.png")
