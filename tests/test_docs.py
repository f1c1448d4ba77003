"""README and docs stand alone: every relative link or path points to a file inside the repository."""

import re
from pathlib import Path

import pytest
from models import TABLE_END, TABLE_PAGES, TABLE_START, with_table

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


@pytest.mark.parametrize("page", TABLE_PAGES)
def test_architectures_table_is_generated_from_the_test_matrix(page):
    text = (ROOT / page).read_text()
    assert TABLE_START in text and TABLE_END in text, f"{page} has no generated architectures table"
    assert text == with_table(text), f"{page}: the architectures table is out of date; run python tests/models.py"
