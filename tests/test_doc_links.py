"""Docs that match the repo: every relative link in README.md, BENCHMARKS.md and docs/*.md
(and deploy/kubernetes/README.md) resolves to a file, and an ``#anchor`` to a heading of it;
no doc points at files outside this repository (the session-only ``shared/spec``)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", ROOT / "BENCHMARKS.md", ROOT / "deploy/kubernetes/README.md",
               *(ROOT / "docs").glob("*.md")])
LINK_RE = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)|!\[[^\]]*\]\(([^)\s]+)\)")
FENCE_RE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)


def _links(doc: Path) -> list[str]:
    text = FENCE_RE.sub("", doc.read_text())  # code blocks hold examples, not links
    return [a or b for a, b in LINK_RE.findall(text)]


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"`|\*|_(?=\w)|(?<=\w)_", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(doc: Path) -> set[str]:
    text = FENCE_RE.sub("", doc.read_text())
    return {_slug(m) for m in re.findall(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


CASES = [(doc, link) for doc in DOCS for link in _links(doc)
         if not re.match(r"[a-z][a-z0-9+.-]*:", link)]  # http:, https:, mailto: are external


def test_the_docs_have_links() -> None:
    assert len(CASES) >= 20


@pytest.mark.parametrize(("doc", "link"), CASES,
                         ids=[f"{d.relative_to(ROOT)}:{link}" for d, link in CASES])
def test_relative_link_resolves(doc: Path, link: str) -> None:
    path, _, anchor = link.partition("#")
    target = (doc.parent / path).resolve() if path else doc
    assert target.exists(), f"{doc.relative_to(ROOT)} links to missing {link}"
    assert target.is_relative_to(ROOT), f"{doc.relative_to(ROOT)} links outside the repo: {link}"
    if anchor and target.suffix == ".md":
        assert anchor in _anchors(target), f"{link}: no heading #{anchor} in {target.name}"


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_no_reference_to_files_outside_the_repo(doc: Path) -> None:
    text = doc.read_text()
    assert "shared/spec" not in text and "../spec/" not in text, doc
