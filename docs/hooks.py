"""mkdocs hook: the site's home page is the README (docs/index.md is a link to it). The README's links are written
from the repository root (docs/..., static/...); on the site they are made relative to docs/."""


def on_page_markdown(markdown: str, page, **kwargs) -> str:
    if page.file.src_uri == "index.md":
        return markdown.replace("](docs/", "](")
    return markdown
