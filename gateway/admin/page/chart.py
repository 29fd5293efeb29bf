"""The page's chart of rejections over time: inline SVG drawn on the server.

Stacked bars, one per bucket of the summary, coloured by the reason's family
(the same families as the reason labels of the listing); each bar carries a
`<title>` with its time and counts, which browsers show as a tooltip without any
script. The time axis has ticks at round times (every 1 min .. 1 day, at most
seven) in the gateway host's local time, its zone named; a page without script
cannot know the browser's.
"""

from __future__ import annotations

import html
import time

from gateway.admin.query import rfc3339
from gateway.store.admin_records import Summary

WIDTH = 1000
HEIGHT = 150
TOP = 14
BOTTOM = 20

# family -> bar colour; the order stacks them bottom-up
FAMILY_COLOURS = {
    "fence": "#c2414b",
    "wait": "#d99a1e",
    "key": "#7b4fc0",
    "replay": "#3c9a5f",
    "other": "#5b7db8",
}


def rejections_chart(summary: Summary, family_of: dict[str, str], *, note: str = "") -> str:
    """The SVG element for `summary`'s series (an empty window draws an empty axis);
    `note` is said at the top, in the middle (what the chart was zoomed to)."""
    count = summary.bucket_count
    totals = [sum(summary.series.get(n, {}).values()) for n in range(count)]
    peak = max(totals, default=0) or 1
    bars: list[str] = []
    for n in range(count):
        counts = summary.series.get(n, {})
        if counts:
            bars.extend(_bar(summary, n, counts, family_of, peak))
    axis = HEIGHT - BOTTOM
    return (
        f'<svg id="chart" class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="rejections over time, {sum(totals)} in all" '
        'xmlns="http://www.w3.org/2000/svg">'
        f'<line x1="0" y1="{axis}" x2="{WIDTH}" y2="{axis}" stroke="#b9c1cc"/>'
        f'<line x1="0" y1="{TOP}" x2="{WIDTH}" y2="{TOP}" stroke="#eef1f5"/>'
        f'<text x="2" y="{TOP - 3}" class="axis">{peak} per {_width(summary.bucket_seconds)}'
        "</text>"
        + (
            f'<text x="{WIDTH / 2:.0f}" y="{TOP - 3}" class="axis" text-anchor="middle" '
            f'id="chart-note">{html.escape(note)}</text>'
            if note
            else ""
        )
        + "".join(bars)
        + _ticks(summary.first_bucket, summary.first_bucket + count * summary.bucket_seconds)
        + "</svg>"
    )


# Tick spacings (seconds): the first that gives at most MAX_TICKS over the window.
_TICK_STEPS = (60, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400)
MAX_TICKS = 7


def _ticks(start: float, end: float) -> str:
    """Tick marks and labels at round local times between `start` and `end`."""
    span = max(end - start, 1.0)
    step = next((s for s in _TICK_STEPS if span / s <= MAX_TICKS), 7 * 86400)
    offset = time.localtime(start).tm_gmtoff  # round in local time, not UTC
    first = ((start + offset) // step + 1) * step - offset
    marks: list[str] = []
    for at in (first + n * step for n in range(int((end - first) // step) + 1)):
        x = (at - start) / span * WIDTH
        if not 24 <= x <= WIDTH - 24:  # a label there would be cut at the edge
            continue
        marks.append(
            f'<line x1="{x:.1f}" y1="{HEIGHT - BOTTOM}" x2="{x:.1f}" y2="{HEIGHT - BOTTOM + 4}" '
            'stroke="#8792a2"/>'
            f'<text x="{x:.1f}" y="{HEIGHT - 5}" class="axis tick" text-anchor="middle">'
            f"{html.escape(_label(at, step))}</text>"
        )
    zone = time.strftime("%Z", time.localtime(start))
    marks.append(
        f'<text x="{WIDTH - 2}" y="{TOP - 3}" class="axis" text-anchor="end">'
        f"time: {html.escape(zone)}</text>"
    )
    return "".join(marks)


def _label(at: float, step: int) -> str:
    moment = time.localtime(at)
    if step >= 86400:
        return time.strftime("%a %d %b", moment)
    if moment.tm_hour == 0 and moment.tm_min == 0:
        return time.strftime("%d %b", moment)  # midnight: the new day's date
    return time.strftime("%H:%M", moment)


def _bar(
    summary: Summary, n: int, counts: dict[str, int], family_of: dict[str, str], peak: int
) -> list[str]:
    """Bucket `n`'s stacked rectangles, then the full-height one carrying its tooltip."""
    slot = WIDTH / summary.bucket_count
    plot = HEIGHT - TOP - BOTTOM
    by_family: dict[str, int] = {}
    for reason, c in counts.items():
        family = family_of.get(reason, "other")
        by_family[family] = by_family.get(family, 0) + c
    bars: list[str] = []
    y = float(HEIGHT - BOTTOM)
    x = n * slot + slot * 0.1
    for family, colour in FAMILY_COLOURS.items():
        c = by_family.get(family, 0)
        if not c:
            continue
        h = c / peak * plot
        y -= h
        bars.append(
            f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(slot * 0.8, 0.6):.1f}" '
            f'height="{h:.1f}" fill="{colour}"/>'
        )
    begins = summary.first_bucket + n * summary.bucket_seconds
    detail = ", ".join(f"{r} {c}" for r, c in sorted(counts.items(), key=lambda rc: -rc[1]))
    when = f"{_clock(begins)} to {_clock(begins + summary.bucket_seconds)}"
    utc = (rfc3339(begins) or "")[:16]
    bars.append(
        f'<rect class="hit" x="{n * slot:.1f}" y="{TOP}" width="{slot:.1f}" '
        f'height="{plot}" fill="transparent"><title>{html.escape(when)} '
        f"({html.escape(utc)}Z): {sum(counts.values())} — {html.escape(detail)}</title></rect>"
    )
    return bars


def _clock(at: float) -> str:
    """A bar's edge in local time: `14:05` (`14:05:30` for buckets under a minute)."""
    moment = time.localtime(at)
    return time.strftime("%H:%M:%S" if moment.tm_sec else "%H:%M", moment)


def _width(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"
