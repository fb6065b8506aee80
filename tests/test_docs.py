"""The README guides and docs/ holds the rest: every relative link in them leads to a file that
exists, and the README stays short."""

import re

import pytest

from tests.helpers import REPO

pytestmark = pytest.mark.fast

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md")), REPO / "benchmarks" / "README.md"]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_leads_to_a_file(page):
    text = page.read_text()
    for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        assert (page.parent / target).exists(), f"{page.name}: a link to {target}, which is not there"


def test_the_readme_is_a_guide_of_about_200_lines_at_most():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200
