"""README and docs stand alone: every relative link or path points to a file inside the repository."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "twell" / "demo" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# Markdown link targets, and paths in code spans that climb out of their folder.
LINK = re.compile(r"\]\(([^)#\s]+)|`(\.\./[^`\s]+)`")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_stay_inside_the_repository(page):
    for target in (link or span for link, span in LINK.findall(page.read_text())):
        if "://" in target:
            continue
        path = (page.parent / target).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"{page.name} links to {target}"
