"""The exceptions taskpoint raises. Every message names the location and says what to do next."""

from __future__ import annotations

__all__ = ["CheckpointCorruptError", "CheckpointError", "StorageError", "UnsafeArchiveError"]


class CheckpointError(Exception):
    """Base class of every error taskpoint raises on purpose."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint exists but its bytes are not what was saved: truncated, bit-flipped, or not an archive."""


class UnsafeArchiveError(CheckpointCorruptError):
    """An archive member would land outside the workspace (absolute path, ``..``, escaping link, device)."""


class StorageError(CheckpointError):
    """Storage kept failing after bounded retries (network, permissions, missing bucket)."""


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where the note is kept in ``__notes__`` for tools to show)."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]
