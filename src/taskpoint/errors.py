"""The exceptions taskpoint raises. Every message names the location and says what to do next."""

from __future__ import annotations


class CheckpointError(Exception):
    """Base class of every error taskpoint raises on purpose."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint exists but its bytes are not what was saved: truncated, bit-flipped, or not an archive."""


class UnsafeArchiveError(CheckpointCorruptError):
    """An archive member would land outside the workspace (absolute path, ``..``, escaping link, device)."""


class StorageError(CheckpointError):
    """Storage kept failing after bounded retries (network, permissions, missing bucket)."""
