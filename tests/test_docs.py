"""The code's pointers into the docs: every `README.md#anchor` / `docs/PAGE.md#anchor` named in a docstring or
comment is a heading that exists (anchors as mkdocs makes them), and no pointer is written as prose ("README: the
learner loop") that no test can follow."""

import re

from conftest import REPO
from markdown.extensions.toc import slugify

CODE = [*REPO.glob("cleanba/*.py"), *REPO.glob("cleanrl_utils/**/*.py"), *REPO.glob("benchmark/*.py")]
POINTER = re.compile(r"\b(README\.md|docs/[\w./-]+\.md)(?:#([\w-]+))?")


def anchors(page) -> set[str]:
    """The anchors mkdocs gives a page's headings (Python-Markdown's toc slugify, outside code blocks)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.DOTALL)
    return {slugify(heading, "-") for heading in re.findall(r"^#{1,6}\s+(.+?)\s*$", text, flags=re.MULTILINE)}


def test_every_pointer_in_the_code_names_a_page_and_heading_that_exist():
    found, broken = 0, []
    for path in CODE:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for page, anchor in POINTER.findall(line):
                found += 1
                target = REPO / page
                if not target.is_file():
                    broken.append(f"{path.relative_to(REPO)}:{number}: no page {page}")
                elif anchor and anchor not in anchors(target):
                    broken.append(f"{path.relative_to(REPO)}:{number}: {page} has no heading #{anchor}")
    assert not broken, "\n".join(broken)
    assert found >= 5  # the scripts' pointers (e.g. docs/performance.md#on-a-gpu) are found


def test_no_pointer_is_written_as_prose():
    prose = re.compile(r"\((README|docs)\s*:")
    hits = [
        f"{path.relative_to(REPO)}:{number}: {line.strip()}"
        for path in CODE
        for number, line in enumerate(path.read_text().splitlines(), start=1)
        if prose.search(line)
    ]
    assert not hits, "write pointers as README.md#anchor or docs/PAGE.md#anchor:\n" + "\n".join(hits)


def test_anchors_are_the_ones_mkdocs_makes():
    """The test's slugs against headings whose mkdocs anchors the docs already link to."""
    assert "on-a-gpu" in anchors(REPO / "docs" / "performance.md")
    assert "the-sebulba-system-every-script" in anchors(REPO / "docs" / "rl-algorithms" / "ppo.md")
    assert "the-readmes-cartpole-command-ten-seeds" in anchors(REPO / "docs" / "rl-algorithms" / "muzero.md")
