"""The small documents processes coordinate by (docs/format.md): leases, the chunk epoch, group records and the
attempt marker. Each JSON object carries a ``format`` name and a ``version``, as the sealed documents do, but no
check: its readers treat one they cannot read as absent or stale, never as damage to a step, and a rewrite is
at most seconds away. Those written before they carried the pair are read as they are; a version newer than
its reader knows is :class:`~taskpoint.errors.NewerFormatError`, which each reader treats as it treats one it
cannot read (an older taskpoint in the same job is the only writer that could meet it)."""

from __future__ import annotations

import json
from typing import Any

from ..errors import NewerFormatError

#: The ``format`` names of the small documents, each at version 1 (:data:`VERSIONS`).
LEASE_FORMAT = "taskpoint.lease"
EPOCH_FORMAT = "taskpoint.epoch"
GROUP_FORMAT = "taskpoint.group"
ATTEMPT_FORMAT = "taskpoint.attempt"
#: The newest version of each small document this taskpoint writes and reads.
VERSIONS = {LEASE_FORMAT: 1, EPOCH_FORMAT: 1, GROUP_FORMAT: 1, ATTEMPT_FORMAT: 1}
#: The fields that name a small document's form.
FORM = ("format", "version")


def small_document(fmt: str, body: dict[str, Any], **dumps: Any) -> bytes:
    """``body`` as the ``fmt`` document of this taskpoint's version (JSON, UTF-8)."""
    return json.dumps({"format": fmt, "version": VERSIONS[fmt], **body}, **dumps).encode()


def read_small_document(data: bytes | None, fmt: str) -> dict[str, Any]:
    """The body of the ``fmt`` document in ``data`` (without ``format`` and ``version``); one written before the
    pair existed (neither field) as it is. ValueError when it is not a JSON object of that format (or is None);
    NewerFormatError when its version is newer than this taskpoint's."""
    doc = json.loads(data or b"")
    if not isinstance(doc, dict):
        raise ValueError(f"a {fmt} document is not a JSON object")
    if not any(key in doc for key in FORM):
        return doc
    version = doc.get("version")
    if doc.get("format") != fmt or isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise ValueError(f"not a {fmt} document of a known version ({doc.get('format')!r}, {version!r})")
    if version > VERSIONS[fmt]:
        raise NewerFormatError(f"a {fmt} document of version {version}, newer than this taskpoint understands "
                               f"({VERSIONS[fmt]}); upgrade taskpoint")
    return {key: value for key, value in doc.items() if key not in FORM}
