"""mkdocs hook: the docstrings use Sphinx roles (:meth:`save`), which Markdown renders as ":meth:" before the
code; drop the role, and a leading "~" (Sphinx's "show the last part only") with the path before it."""

from __future__ import annotations

import re
from typing import Any

_ROLE = re.compile(r":(?:meth|class|func|attr|exc|data|mod|obj):<code>~?((?:[\w.]+\.)?)([^<]*)</code>")


def _shorten(match: re.Match[str]) -> str:
    whole = match.group(0)
    path, name = match.group(1), match.group(2)
    return f"<code>{name}</code>" if "~" in whole.split("<code>", 1)[1][:1] else f"<code>{path}{name}</code>"


def on_page_content(html: str, **_: Any) -> str:
    return _ROLE.sub(_shorten, html)
