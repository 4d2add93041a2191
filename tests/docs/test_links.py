"""Every relative link in README.md and docs/ points at a file that exists (and, for a
Markdown file, at a heading it has)."""

from __future__ import annotations

from urllib.parse import unquote, urlsplit

import pytest

from tests.docs.markdown import ROOT, Link, anchors, links, markdown_files

_EXTERNAL = ("http", "https", "mailto")


def _relative_links() -> list[Link]:
    return [
        link
        for path in markdown_files()
        for link in links(path)
        if urlsplit(link.target).scheme not in _EXTERNAL
    ]


def test_the_docs_link_to_each_other() -> None:
    assert len(_relative_links()) > 20


@pytest.mark.parametrize(
    "link", _relative_links(), ids=lambda link: f"{link.location} {link.target}"
)
def test_relative_link_resolves(link: Link) -> None:
    parts = urlsplit(link.target)
    target = (link.path.parent / unquote(parts.path)).resolve() if parts.path else link.path
    assert target.exists(), f"{link.location}: {link.target} does not exist"
    assert target.is_relative_to(ROOT), f"{link.location}: {link.target} leaves the repository"
    if parts.fragment and target.suffix == ".md":
        assert parts.fragment in anchors(target), (
            f"{link.location}: {target.relative_to(ROOT)} has no heading #{parts.fragment}"
        )
