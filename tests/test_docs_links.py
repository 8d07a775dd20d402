"""Every relative link of the user docs and the studies points at a file (and heading) that exists.

Covers README.md, docs/*.md and experiments/**/*.md (the study folders under experiments/studies/): inline links
and images ``[text](target)``, outside fenced code blocks and inline code. A target is taken relative to the file
that links it; ``#anchor`` parts into a markdown file must name one of its headings (GitHub's slugs).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,}).*?^ {0,3}\1[ \t]*$", re.M | re.S)
_CODE = re.compile(r"(`+).+?\1", re.S)
_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_HEADING = re.compile(r"^ {0,3}#{1,6}[ \t]+(.+?)[ \t#]*$", re.M)


def doc_files(root: Path = REPO) -> list[Path]:
    files = [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "experiments").rglob("*.md"))]
    return [f for f in files if f.is_file()]


def _prose(text: str) -> str:
    return _CODE.sub("", _FENCE.sub("", text))


def anchors(path: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to '-', repeats suffixed -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for heading in _HEADING.findall(_FENCE.sub("", path.read_text())):
        text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
        slug = re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(path: Path, root: Path = REPO) -> list[str]:
    """The relative link targets in ``path`` that name no existing file (or no heading of the file they name)."""
    broken = []
    for target in _LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I):  # http:, https:, mailto: ...
            continue
        file, _, anchor = target.partition("#")
        dest = path if not file else (path.parent / file).resolve()
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor.lower() not in anchors(dest):
            broken.append(target)
        elif root not in (dest, *dest.parents):
            broken.append(f"{target} (outside the repository)")
    return broken


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_relative_links_resolve(path):
    assert broken_links(path) == [], f"{path.relative_to(REPO)} links to what does not exist"


def test_the_check_sees_a_broken_link(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "there.md").write_text("# A heading\n")
    page = tmp_path / "docs" / "page.md"
    page.write_text("[ok](../there.md) [ok](../there.md#a-heading) [web](https://example.org/x.md)\n"
                    "`[code](nowhere.md)`\n\n```\n[fenced](nowhere.md)\n```\n"
                    "[gone](missing.md) ![plot](plot.png) [bad anchor](../there.md#no-such-heading)\n")
    assert broken_links(page, tmp_path) == ["missing.md", "plot.png", "../there.md#no-such-heading"]
