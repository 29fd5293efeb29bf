"""The user documentation holds together: every relative link of the README and of
the pages of docs/ names a file that exists and, with a `#fragment`, a heading in
it (GitHub's anchors), so moving a section cannot leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from gateway.config.reference import reference

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]

_FENCED = re.compile(r"^```.*?^```", re.S | re.M)
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6} (.+?)\s*$", re.M)


def prose(text: str) -> str:
    """`text` without its fenced code blocks (a `# comment` there is no heading)."""
    return _FENCED.sub("", text)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces -> '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"[^\w\- ]", "", text.lower())
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    found = set()
    for heading in _HEADING.findall(prose(path.read_text(encoding="utf-8"))):
        base = anchor(heading)
        n = seen.get(base, 0)
        found.add(base if n == 0 else f"{base}-{n}")
        seen[base] = n + 1
    return found


def test_the_anchor_rule_matches_githubs_on_our_headings() -> None:
    assert anchor("With Celery / arq") == "with-celery--arq"
    assert (
        anchor("`sinkgate upstream`: a recording upstream")
        == "sinkgate-upstream-a-recording-upstream"
    )
    assert anchor("Choices where the contract is silent") == "choices-where-the-contract-is-silent"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_leads_somewhere(page: Path) -> None:
    dead = []
    for target in _LINK.findall(prose(page.read_text(encoding="utf-8"))):
        if re.match(r"[a-z]+:", target):  # https:, mailto:
            continue
        file, _, fragment = target.partition("#")
        linked = (page.parent / file).resolve() if file else page
        if not linked.exists():
            dead.append(f"{target}: no such file")
        elif fragment and linked.suffix == ".md" and fragment not in anchors(linked):
            dead.append(f"{target}: no such heading in {linked.name}")
    assert not dead, f"{page.relative_to(REPO)}: " + "; ".join(dead)


def test_the_configuration_reference_is_generated_from_the_key_declarations() -> None:
    """docs/configuration.md is `gateway.config.keys` rendered; a key added, renamed
    or given another default there changes the page (regenerate it with
    `python3 -m gateway.config.reference docs/configuration.md`)."""
    page = (REPO / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert page == reference()
    assert "| `max_in_flight` | `256` |" in page  # a destination key, its default
    assert '| `max_wait` | `"30s"` |' in page  # a duration read by its own reader
