"""Rendering of the admin page: templates from gateway/admin/page/templates
filled by `render`, which escapes every value that is not `Safe` (a fragment
built from escaped parts), the layout with its headers (`html_response`), and
the colour class of each reason."""

from __future__ import annotations

import functools
import html
import string
from importlib import resources

from aiohttp import web

from gateway.admin.session import LOGOUT_PATH
from leases.reasons import REASONS, Family, Reason, ReasonInfo


class Safe(str):
    """Markup built here from escaped parts; `render` inserts it as it is."""


def render(template: str, **values: object) -> str:
    """Fill a `string.Template` from the page's templates, escaping every value not `Safe`."""
    return _template(template).substitute(
        {k: v if isinstance(v, Safe) else html.escape(str(v)) for k, v in values.items()}
    )


def link(href: str, text: str) -> str:
    """An `<a>` to `href`, both escaped."""
    return f'<a href="{html.escape(href)}">{html.escape(text)}</a>'


@functools.cache
def _template(name: str) -> string.Template:
    return string.Template(
        resources.files("gateway.admin.page").joinpath("templates", name).read_text()
    )


def html_response(
    title: str,
    body: str,
    *,
    status: int = 200,
    logout: bool = False,
    refresh: int = 0,
    who: str | None = None,
) -> web.Response:
    """A page in the layout; `refresh` > 0 reloads it every that many seconds
    (a meta refresh: no script); `who` is the signed-in operator's name, shown in
    the header."""
    signed_in = f'<span class="who" id="signed-in">{html.escape(who)}</span>' if who else ""
    head = Safe(f'<meta http-equiv="refresh" content="{int(refresh)}">' if refresh > 0 else "")
    page = render(
        "admin_layout.html",
        title=title,
        body=Safe(body),
        logout=Safe(f'<div class="account">{signed_in}{_LOGOUT if logout else ""}</div>'),
        head=head,
    )
    return web.Response(
        status=status,
        text=page,
        content_type="text/html",
        charset="utf-8",
        headers={
            "Content-Security-Policy": (
                "default-src 'none'; style-src 'unsafe-inline'; form-action 'self'; "
                "frame-ancestors 'none'; base-uri 'none'"
            ),
            "X-Content-Type-Options": "nosniff",
            "Referrer-Policy": "no-referrer",
            "Cache-Control": "no-store",
        },
    )


_LOGOUT = (
    f'<form method="post" action="{LOGOUT_PATH}" class="logout">'
    '<button type="submit">Sign out</button></form>'
)


def _kind(reason: Reason, info: ReasonInfo) -> str:
    """The colour class of a reason on the page."""
    if reason is Reason.DUPLICATE:
        return "replay"
    if info.retry_later:
        return "wait"
    return {Family.FENCE: "fence", Family.IDEMPOTENCY: "key"}.get(info.family, "other")


# The reason's family colours its label on the page.
REASON_KIND: dict[str, str] = {
    reason: _kind(reason, info) for reason, info in REASONS.items() if info.recorded
}
