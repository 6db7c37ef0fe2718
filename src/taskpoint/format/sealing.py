"""Documents that guard themselves: :func:`sealed` writes one as canonical JSON with a ``check``, the digest of
the rest of it, and :func:`parse` refuses one that fails it as damaged (see :mod:`.records` for why sha256 for
manifests and CRC32 for a checkpoint's record)."""

from __future__ import annotations

import hashlib
import json
import zlib
from collections.abc import Callable
from typing import Any, TypeVar

from ..errors import CheckpointCorruptError, NewerFormatError
from .legacy import older_reader

#: The field of a document that holds the digest of the rest of it.
CHECK = "check"
SHA256, CRC32 = "sha256", "crc32"

T = TypeVar("T")


def sealed(doc: dict[str, Any], digest: str = SHA256) -> bytes:
    """``doc`` as stored: canonical JSON (sorted keys) with :data:`CHECK`, the ``digest`` of the rest of it.
    Metadata may hold NaN and infinities (a diverged run's loss), written as Python's JSON writes them."""
    return json.dumps({**doc, CHECK: check_of(doc, digest)}, sort_keys=True).encode()


def check_of(doc: dict[str, Any], digest: str) -> str:
    """The ``digest`` (hex) of ``doc`` without its own check, canonically serialized."""
    body = json.dumps({k: v for k, v in doc.items() if k != CHECK}, sort_keys=True).encode()
    return f"{zlib.crc32(body):08x}" if digest == CRC32 else hashlib.sha256(body).hexdigest()


def parse(data: bytes, fmt: str, uri: str, build: Callable[[dict[str, Any], bool], T], newest: int,
           what_to_do: str, digest: str = SHA256) -> T:
    """``build`` applied to the ``fmt`` document in ``data`` and whether it carried its check; anything
    unreadable, and a check that fails, is CheckpointCorruptError; a version above ``newest`` is
    :class:`~taskpoint.errors.NewerFormatError` (a CheckpointCorruptError too). A document of a form taskpoint no longer
    writes reaches ``build`` through its older reader (:mod:`.legacy`), in the form written now; one without a check
    only so (every form written now carries one)."""
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("format") != fmt:
            raise ValueError("not a taskpoint manifest")
        checked = CHECK in doc
        intact = not checked or doc[CHECK] == check_of(doc, digest)
        if int(doc.get("version", 0)) > newest:
            raise NewerFormatError(
                f"the checkpoint record {uri} has format version {doc['version']}, newer than this "
                f"taskpoint understands ({newest}); upgrade taskpoint to load it"
                f"{'' if intact else ' (or it is damaged: it fails its check)'}.")
        if not intact:
            raise ValueError(f"it fails its check ({digest}): a byte of it is damaged")
        older = older_reader(fmt, int(doc["version"]), checked)
        if older is not None:
            doc = older.upgrade(doc)
        elif not checked:
            raise ValueError("it carries no check (a damaged byte)")
        return build(doc, checked)
    except CheckpointCorruptError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise CheckpointCorruptError(f"the checkpoint record {uri} is unreadable ({exc}); {what_to_do}.") from exc

