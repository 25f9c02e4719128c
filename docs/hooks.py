"""mkdocs hooks. The site's pages are the README (the home page: docs/index.md is a link to it), docs/**/*.md, and
the notes benchmark/results/notes_*.md and benchmark/DEVICE_RUNBOOK.md (pages outside the nav, at their repository
paths: what each page's runs were measured beside, and when; the GPU steps still to run).

Every link is written as it works on the repository, relative to the file it is in: the README's from the repository
root (docs/usage.md, benchmark/results/notes_ppo.md), a page's from its folder (../benchmark/results/notes_usage.md
from docs/usage.md), a note's to a page through docs/ (../../docs/usage.md). On the site docs/ is the root, so each
link is made relative to where its target lands there."""

import posixpath
import re
from pathlib import Path

from mkdocs.structure.files import File, InclusionLevel

NOTES = "benchmark/results"
RUNBOOK = "benchmark/DEVICE_RUNBOOK.md"
LINK = re.compile(r"\]\(([^)\s#]*)(#[^)\s]*)?\)")


def on_files(files, config, **kwargs):
    repository = Path(config["config_file_path"]).parent
    for note in sorted((repository / NOTES).glob("notes_*.md")):
        inclusion = InclusionLevel.NOT_IN_NAV
        files.append(File.generated(config, f"{NOTES}/{note.name}", abs_src_path=str(note), inclusion=inclusion))
    files.append(File.generated(config, RUNBOOK, abs_src_path=str(repository / RUNBOOK), inclusion=inclusion))
    return files


def repository_path(src_uri: str) -> str:
    """Where a site page's source lies in the repository."""
    if src_uri == "index.md":
        return "README.md"
    return src_uri if src_uri.startswith("benchmark/") else f"docs/{src_uri}"


def site_path(path: str) -> str | None:
    """Where a repository file lands on the site (None: not on the site)."""
    if path == "README.md":
        return "index.md"
    if path.startswith("docs/"):
        return path.removeprefix("docs/")
    return path if path.startswith(f"{NOTES}/notes_") or path == RUNBOOK else None


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    here = posixpath.dirname(repository_path(page.file.src_uri))
    site_here = posixpath.dirname(page.file.src_uri)

    def relink(match: re.Match) -> str:
        target, anchor = match.group(1), match.group(2) or ""
        if not target or "://" in target or target.startswith(("mailto:", "/")):
            return match.group(0)
        on_site = site_path(posixpath.normpath(posixpath.join(here, target)))
        if on_site is None:
            return match.group(0)
        return f"]({posixpath.relpath(on_site, site_here or '.')}{anchor})"

    return LINK.sub(relink, markdown)
