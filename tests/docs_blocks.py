"""Read the fenced code blocks of a Markdown page, so tests can run the docs as written."""

from __future__ import annotations

import re
from pathlib import Path

__all__ = ["FENCE", "code_blocks", "commands"]

#: A fenced block: (language, body).
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


def code_blocks(page: Path, language: str) -> list[str]:
    """The bodies of the page's ``` blocks in ``language``, in order."""
    return [body for lang, body in FENCE.findall(page.read_text()) if lang == language]


def commands(block: str) -> list[str]:
    """A shell block's commands: one per line, comments and blank lines dropped, trailing comments
    cut."""
    found = []
    for line in block.splitlines():
        line = re.sub(r"\s+#.*$", "", line).strip()
        if line and not line.startswith("#"):
            found.append(line)
    return found
