"""Every relative link in README.md and docs/*.md resolves: the file or folder exists, and a #anchor names a heading
of the target page (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens, -1, -2 for repeats).
Links inside code blocks and to other sites are not checked. The README is the front page: at most 400 lines."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[([^\]]*)\]\(([^)\s]+)\)")


def _prose(text: str):
    """Lines outside fenced code blocks."""
    fence = False
    for line in text.splitlines():
        if line.startswith("```"):
            fence = not fence
        elif not fence:
            yield line


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in _prose(path.read_text()):
        m = re.match(r"^#+ (.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    bad = []
    for line in _prose(page.read_text()):
        for label, url in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"^[a-z][a-z0-9+.-]*:", url):  # http:, https:, mailto:
                continue
            path, _, anchor = url.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                bad.append(
                    f"[{label}]({url}): no file {target.relative_to(ROOT) if ROOT in target.parents else target}"
                )
            elif anchor and target.suffix == ".md" and anchor not in anchors(target):
                bad.append(f"[{label}]({url}): {target.name} has no heading #{anchor}")
    return bad


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_and_anchors_resolve(page):
    bad = broken_links(page)
    assert not bad, f"{page.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_checker_finds_a_broken_link_and_anchor(tmp_path):
    (tmp_path / "a.md").write_text(
        "# Top\n## Two words\n[ok](#two-words) [x](#nope) [y](b.md) [z](a.md#top)\n```\n[in code](missing.md)\n```\n"
    )
    assert broken_links(tmp_path / "a.md") == [
        "[x](#nope): a.md has no heading #nope",
        f"[y](b.md): no file {(tmp_path / 'b.md').resolve()}",
    ]


def test_the_readme_is_a_front_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 400
