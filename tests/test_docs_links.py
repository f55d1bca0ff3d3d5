"""Every relative link of the project's markdown (README.md, docs/, agent/, bootstrap/, benchmarks/) resolves:
to a file or folder of the repository, and where it names a heading (``page.md#heading``) to a heading of
that page, spelled as GitHub makes anchors. Links inside code blocks and web addresses are not checked."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted([REPO / "README.md", *(p for folder in ("docs", "agent", "bootstrap", "benchmarks")
                                      for p in (REPO / folder).glob("*.md"))])
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def prose(text: str) -> list[str]:
    """The page's lines outside fenced code blocks, inline code spans blanked."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(re.sub(r"`[^`]*`", lambda m: "`" + "x" * (len(m.group(0)) - 2) + "`", line))
    return out


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, markup and punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in page.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or heading is None:
            continue
        text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading.group(1))  # a link's text stays
        slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def links(page: Path) -> list[str]:
    return [m.group(1) for line in prose(page.read_text()) for m in LINK.finditer(line)]


def test_the_pages_are_found():
    names = {p.relative_to(REPO).as_posix() for p in PAGES}
    assert {"README.md", "agent/README.md", "bootstrap/README.md", "benchmarks/README.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_resolves(page: Path):
    broken = []
    for target in links(page):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            broken.append(f"{target} (no such file)")
        elif fragment and resolved.suffix == ".md" and fragment not in anchors(resolved):
            broken.append(f"{target} (no heading #{fragment} in {resolved.relative_to(REPO)})")
        elif path and REPO not in resolved.parents and resolved != REPO:
            broken.append(f"{target} (outside the repository)")
    assert not broken, f"{page.relative_to(REPO)}: broken links: " + "; ".join(broken)


def test_anchors_are_spelled_as_github_does(tmp_path: Path):
    page = tmp_path / "page.md"
    page.write_text("# Slow links: wire formats, 1F1B, overlap\n## The runtime's settings (issue 13)\n"
                    "## Notes\n## Notes\n```\n# not a heading\n```\n### `code` and [a link](x.md)\n")
    assert anchors(page) == {"slow-links-wire-formats-1f1b-overlap", "the-runtimes-settings-issue-13", "notes",
                             "notes-1", "code-and-a-link"}
