"""MkDocs hook: links from a page to files of the repository outside ``docs/``.

GitHub follows ``[domains/](../domains/README.md)``; the site has no such page. Such a link
becomes the file's repository path, as code, when the file exists, and a warning (which fails
the strict build) when it does not: a page never points to a file that is gone.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.links")

LINK = re.compile(r"\[([^\]]+)\]\((?!https?:|mailto:|#)([^)#\s]+)(#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Any, config: Any, **kwargs: Any) -> str:
    docs = Path(config["docs_dir"]).resolve()
    repo = docs.parent
    here = (docs / page.file.src_path).parent

    def outside(match: re.Match[str]) -> str:
        text, target = match[1], match[2]
        path = (here / target).resolve()
        if path.is_relative_to(docs):
            return match[0]  # MkDocs checks links between pages itself
        if not path.exists():
            log.warning("%s links to %s, which does not exist", page.file.src_path, target)
            return match[0]
        shown = text if text.startswith("`") else f"{text} (`{path.relative_to(repo)}`)"
        return shown

    return LINK.sub(outside, markdown)
