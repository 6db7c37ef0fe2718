"""What one writer knows of the destinations it saved to, between its saves (see :mod:`taskpoint.record`)."""

from __future__ import annotations

import threading

from .folders import refuse_folder_destination
from .format.records import Record
from .storage import Location


class SaveMemory:
    """What one writer knows of the destinations it saved to, kept by its owner (a :class:`~taskpoint.Checkpoint`)
    for as long as it saves: the record it last wrote beside each, with its stored version (S3's and Azure's
    ETag, GCS's generation, a local file's identity), and which destinations on object stores it found not to be
    a folder or prefix.

    A later save starts from that record: where the store has conditional writes, its record write lands only
    over that version, and on a conflict it reads the record again and keeps what the other writer listed;
    elsewhere (``memory://``), just before it lists its new object it reads the record again, so that what another
    writer made visible stays listed. A new owner knows nothing, as a new process does: its first save reads the
    record (and, without one, checks that the destination is no folder)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, tuple[Record, str | None]] = {}
        self._not_folders: set[str] = set()

    def take(self, record_loc: Location) -> tuple[Record | None, str | None]:
        """The record last written at ``record_loc`` and its version, forgotten until :meth:`keep` (None, None
        when unknown): a save that fails leaves nothing to start from."""
        with self._lock:
            return self._records.pop(record_loc.path, (None, None))

    def keep(self, record_loc: Location, record: Record, version: str | None) -> None:
        with self._lock:
            self._records[record_loc.path] = (record, version)

    def refuse_folder(self, dest: Location) -> None:
        """:func:`~taskpoint.folders.refuse_folder_destination`, paid once per destination on object stores (a
        HEAD and a listing) and on every save on local disk (one ``stat``)."""
        with self._lock:
            if not dest.is_local and dest.path in self._not_folders:
                return
        refuse_folder_destination(dest)
        if not dest.is_local:
            with self._lock:
                self._not_folders.add(dest.path)
