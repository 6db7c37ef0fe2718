"""mkdocs hook: the docstrings use Sphinx roles (:meth:`save`, :meth:`Checkpoint.save <taskpoint.Checkpoint.save>`)
and name pages as paths (see docs/manager.md), which Markdown renders as text. Each role becomes its code,
linked (through mkdocs-autorefs) when it names a ``taskpoint`` object: the title when it has one, else the name
(its last part after a leading "~", Sphinx's "show the last part only"). Each path of a page that exists becomes
a link to it. Code blocks are left as they are."""

from __future__ import annotations

import posixpath
import re
from pathlib import Path
from typing import Any

#: A role as Markdown renders it: the role's name, then its text in <code> (``<`` and ``>`` escaped).
_ROLE = re.compile(r":(?:meth|class|func|attr|exc|data|mod|obj):<code>([^<]*)</code>")
#: The text of a role with a title: ``title <target>``.
_TITLED = re.compile(r"(.*?)\s*&lt;(~?[\w.]+)&gt;", re.DOTALL)
#: A page named as a path in prose (``docs/manager.md``, ``docs/manager.md#retention``), not inside a link.
_PAGE_PATH = re.compile(r"(?<![\w/\"'=.-])docs/((?:[\w-]+/)*[\w-]+\.md)(#[\w-]+)?(?![\w/\"'])")
#: What the hook leaves alone: code blocks, and links that exist already.
_UNTOUCHED = re.compile(r"(<pre\b.*?</pre>|<a\b.*?</a>)", re.DOTALL)
DOCS = Path(__file__).resolve().parent


def _role(match: re.Match[str]) -> str:
    text = match.group(1).strip()
    titled = _TITLED.fullmatch(text)
    if titled is not None:
        title, target = titled.group(1), titled.group(2).lstrip("~")
    else:
        target = text.lstrip("~")
        title = target.rsplit(".", 1)[-1] if text.startswith("~") else target
    code = f"<code>{title}</code>"
    if not target.startswith("taskpoint.") and target != "taskpoint":
        return code
    # optional: a name the reference does not document (a private helper) stays code, without a warning.
    return f'<autoref identifier="{target}" optional>{code}</autoref>'


def _page_link(page_url: str) -> Any:
    here = posixpath.dirname(page_url)

    def link(match: re.Match[str]) -> str:
        path, anchor = match.group(1), match.group(2) or ""
        if not (DOCS / path).is_file():
            return match.group(0)
        href = posixpath.relpath(path[:-len(".md")] + ".html", here or ".") + anchor
        return f'<a href="{href}">{path}{anchor}</a>'

    return link


def on_page_content(html: str, page: Any, **_: Any) -> str:
    link = _page_link(page.url)
    parts = _UNTOUCHED.split(html)
    for index in range(0, len(parts), 2):  # the even parts lie outside code blocks and links
        parts[index] = _PAGE_PATH.sub(link, _ROLE.sub(_role, parts[index]))
    return "".join(parts)
