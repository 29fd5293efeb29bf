"""The page's chart of rejections over time: inline SVG drawn on the server.

Stacked bars, one per bucket of the summary, coloured by the reason's family
(the same families as the reason labels of the listing); each bar carries a
`<title>`, which browsers show as a tooltip without any script.
"""

from __future__ import annotations

import html

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


def rejections_chart(summary: Summary, family_of: dict[str, str]) -> str:
    """The SVG element for `summary`'s series (an empty window draws an empty axis)."""
    count = summary.bucket_count
    totals = [sum(summary.series.get(n, {}).values()) for n in range(count)]
    peak = max(totals, default=0) or 1
    bars: list[str] = []
    for n in range(count):
        counts = summary.series.get(n, {})
        if counts:
            bars.extend(_bar(summary, n, counts, family_of, peak))
    first = rfc3339(summary.since) or ""
    last = rfc3339(summary.until) or ""
    axis = HEIGHT - BOTTOM
    return (
        f'<svg id="chart" class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="rejections over time, {sum(totals)} in all" '
        'xmlns="http://www.w3.org/2000/svg">'
        f'<line x1="0" y1="{axis}" x2="{WIDTH}" y2="{axis}" stroke="#b9c1cc"/>'
        f'<line x1="0" y1="{TOP}" x2="{WIDTH}" y2="{TOP}" stroke="#eef1f5"/>'
        f'<text x="2" y="{TOP - 3}" class="axis">{peak} per {_width(summary.bucket_seconds)}'
        "</text>"
        + "".join(bars)
        + f'<text x="2" y="{HEIGHT - 5}" class="axis">{html.escape(first[:16])}Z</text>'
        f'<text x="{WIDTH - 2}" y="{HEIGHT - 5}" class="axis" text-anchor="end">'
        f"{html.escape(last[:16])}Z</text></svg>"
    )


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
    start = rfc3339(summary.first_bucket + n * summary.bucket_seconds) or ""
    detail = ", ".join(f"{r} {c}" for r, c in sorted(counts.items()))
    bars.append(
        f'<rect class="hit" x="{n * slot:.1f}" y="{TOP}" width="{slot:.1f}" '
        f'height="{plot}" fill="transparent"><title>{html.escape(start[:16])}Z: '
        f"{html.escape(detail)}</title></rect>"
    )
    return bars


def _width(seconds: int) -> str:
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if seconds % size == 0:
            return f"{seconds // size} {unit}"
    return f"{seconds} s"
