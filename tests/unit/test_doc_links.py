"""Every relative link in README.md and docs/*.md resolves: the file or folder exists, and a #anchor names a heading
of the target page (GitHub's anchors: lower case, punctuation dropped, spaces as hyphens, -1, -2 for repeats).
Links inside code blocks and to other sites are not checked. The README is the front page: at most 400 lines.
The comments of the shipped configs and examples point into the repository too (`docs/config.md ("Config
reference")`, `README: "Fine-tuning"`, `bench/guide_scenarios.py`): each named file exists and each quoted section
is a heading of it, so a section that moves cannot leave a config pointing at nothing."""

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


COMMENTED = [*sorted((ROOT / "configs").glob("*.yaml")), *sorted((ROOT / "examples").rglob("*.yaml")),
             *sorted((ROOT / "examples").rglob("*.sbatch"))]  # fmt: skip
# A repository path (or README), optionally with the section it names: `PATH ("Section")` or `PATH: "Section"`.
POINTER = re.compile(
    r"(?<![\w/.-])((?:docs|bench|configs|examples|fitlm|tests)/[\w./-]*\w|README(?:\.md)?)(?:\s*\(|:\s*)?(?:\"([^\"]+)\")?"
)


def _comments(text: str):
    """The comment of each line (YAML and shell: from a # at the line's start or after a space)."""
    for line in text.splitlines():
        m = re.search(r"(?:^|\s)#(.*)", line)
        if m:
            yield m.group(1)


def broken_pointers(path: Path, root: Path = ROOT) -> list[str]:
    bad = []
    for comment in _comments(path.read_text()):
        for name, section in POINTER.findall(comment):
            target = root / ("README.md" if name == "README" else name)
            if not target.exists():
                bad.append(f"{name}: no such file")
            elif section and (target.suffix != ".md" or _slug(section) not in anchors(target)):
                bad.append(f'{name} ("{section}"): no such heading')
    return bad


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@pytest.mark.parametrize("path", COMMENTED, ids=[str(p.relative_to(ROOT)) for p in COMMENTED])
def test_config_comments_point_at_files_and_sections_that_exist(path):
    bad = broken_pointers(path)
    assert not bad, f"{path.relative_to(ROOT)}:\n" + "\n".join(bad)


def test_the_pointer_checker_finds_a_moved_section_and_a_missing_file(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("# Top\n## Two words\n")
    (tmp_path / "docs" / "a.md").write_text("# Config reference\n")
    (tmp_path / "c.yaml").write_text(
        'a: 1 # README.md ("Config reference"), docs/a.md ("Config reference")\n'
        '# README: "Two words"; see docs/b.md and bench/x.py\nurl: "http://h/docs/a.md#x"\n'
    )
    assert broken_pointers(tmp_path / "c.yaml", tmp_path) == [
        'README.md ("Config reference"): no such heading',
        "docs/b.md: no such file",
        "bench/x.py: no such file",
    ]
