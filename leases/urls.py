"""Store URLs in messages: never quoted, since they may carry a password.

urllib's own `ValueError` for a URL it cannot read may quote the user and
password (`netloc 'u:pw@h' contains invalid characters under NFKC
normalization`), and asyncpg passes it on as it is.
"""

from __future__ import annotations

from urllib.parse import urlsplit

__all__ = ["check_readable", "shown_scheme", "unreadable_url"]


def unreadable_url(exc: ValueError) -> str:
    """Why urllib cannot read a URL, in words that quote nothing of it."""
    text = str(exc)
    if "NFKC" in text:
        return (
            "a character in it reads as a URL delimiter once normalised (a full-width "
            "number sign, solidus, question mark or at sign, say): percent-encode it"
        )
    if "IPv6" in text:
        return "a host in [ ] is not an IPv6 address, or its ] is missing or misplaced"
    return "its user, password or host part is malformed"


def check_readable(url: str) -> None:
    """`ValueError`, quoting nothing of `url`, when urllib (and so asyncpg)
    cannot read it."""
    try:
        urlsplit(url)
    except ValueError as exc:
        raise ValueError(f"the store URL cannot be read: {unreadable_url(exc)}") from None


def shown_scheme(url: str) -> str:
    """The part of `url` a message may show: its scheme, or that it has none."""
    scheme, sep, _ = url.partition("://")
    if not sep or not scheme.replace("+", "").replace(".", "").replace("-", "").isalnum():
        return "a URL without scheme://"
    return f"a {scheme}:// URL"
