"""Every relative link of README.md and docs/*.md points at a file that exists and, with ``#anchor``, at a heading
of that file, under GitHub's anchor rules (lower case; punctuation other than ``-`` and ``_`` dropped; spaces to
``-``; a repeated heading gets ``-1``, ``-2``, ...); and no doc points outside the repository."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest

from paths import REPO

DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """GitHub's id of a Markdown heading's text (inline code marks dropped)."""
    text = heading.replace("`", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _outside_fences(text: str) -> list[str]:
    lines, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(path: Path) -> set[str]:
    seen, out = Counter(), set()
    for line in _outside_fences(path.read_text(encoding="utf-8")):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            a = github_anchor(m.group(1))
            out.add(a if not seen[a] else f"{a}-{seen[a]}")
            seen[a] += 1
    return out


def test_github_anchor_rules():
    assert github_anchor("Issue 25: the PyTorch path only, before and after, one run (2026-12-02)") == \
        "issue-25-the-pytorch-path-only-before-and-after-one-run-2026-12-02"
    assert github_anchor("Retrieval tasks (`python -m tinyattn eval --task`)") == \
        "retrieval-tasks-python--m-tinyattn-eval---task"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(doc: Path):
    bad = []
    for line in _outside_fences(doc.read_text(encoding="utf-8")):
        for target in LINK.findall(line):
            if target.startswith(("http://", "https://", "mailto:")):
                continue
            name, _, anchor = target.partition("#")
            dest = (doc.parent / name) if name else doc
            if not dest.exists():
                bad.append(f"{target}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                bad.append(f"{target}: no heading with that anchor")
    assert not bad, f"{doc.name}: {bad}"


def test_docs_point_inside_the_repository():
    """The design card the code and docs cite as DESIGN.md is in the repository; no doc (command, snippet or link)
    reads a ../shared folder beside the checkout (a fresh clone has none) or keeps a ``git+<...>`` placeholder."""
    assert (REPO / "docs" / "DESIGN.md").exists()
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        assert "../shared" not in text and "git+<" not in text, path.name
