"""The exceptions taskpoint raises. Every message names the location and says what to do next."""

from __future__ import annotations

__all__ = [
    "CheckpointCorruptError",
    "CheckpointError",
    "StorageAccessDenied",
    "StorageError",
    "StorageFull",
    "StorageNotFound",
    "StorageUnavailable",
    "UnsafeArchiveError",
]


class CheckpointError(Exception):
    """Base class of every error taskpoint raises on purpose."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint exists but its bytes are not what was saved: truncated, bit-flipped, or not an archive."""


class UnsafeArchiveError(CheckpointCorruptError):
    """An archive member would land outside the workspace (absolute path, ``..``, escaping link, device)."""


class StorageError(CheckpointError):
    """Storage could not do what was asked. The subclasses say why; anything else (a parent path that is a
    file, a name the store refuses) is a plain StorageError. Never raised for "there is no checkpoint"."""


class StorageUnavailable(StorageError):
    """Storage kept failing transiently (network, timeouts, throttling, 5xx) after the retries ran out."""


class StorageAccessDenied(StorageError):
    """Credentials are missing or were rejected, or permissions forbid the operation. Not retried; the
    message names the credential source that was tried, never a credential's value."""


class StorageNotFound(StorageError):
    """The bucket or container (or, for a save, a folder the store will not create) does not exist."""


class StorageFull(StorageError):
    """No space left: on the destination, or on the local disk a load extracts to. Not retried."""


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)``, also on Python 3.10 (where the note is kept in ``__notes__`` for tools to show)."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)
    else:
        exc.__notes__ = [*getattr(exc, "__notes__", []), note]
