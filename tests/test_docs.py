"""The documentation's links: each relative link of README.md and docs/*.md names a file of the checkout, and an
anchor after it one of that file's headings, as GitHub makes their anchors."""
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


def github_anchor(heading: str) -> str:
    """GitHub's id for a Markdown heading: lower case, punctuation but - and _ dropped, spaces as -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a # in a code block is a comment
    return {github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, re.M)}


def test_github_anchor_drops_punctuation_and_backticks():
    assert github_anchor("The engine: `nibble.Engine`") == "the-engine-nibbleengine"
    assert github_anchor("transformers' `from_pretrained`, and back") == "transformers-from_pretrained-and-back"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_and_anchor_resolves(page):
    links = [link for link in LINK.findall(page.read_text()) if not re.match(r"[a-z]+:", link)]
    for link in links:
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.name}: {link} names no file"
        if anchor:
            assert anchor in anchors(target), f"{page.name}: {link} names no heading of {target.name}"
    assert page.name not in ("README.md", "USAGE.md") or links  # the pages with links were read
