"""Steps this process is restoring or deleting, shared by all managers of the process."""

from __future__ import annotations

import collections
import threading


class InUse:
    """Steps this process is restoring or deleting, per directory, shared by all managers in the process.

    Retention and ``CheckpointManager.delete`` skip a step being restored; a restore treats a step being
    deleted as gone.
    """

    _lock = threading.Lock()
    _restoring: collections.Counter[tuple[str, str, int]] = collections.Counter()
    _deleting: set[tuple[str, str, int]] = set()

    def __init__(self, directory: tuple[str, str]) -> None:
        self._directory = directory

    def start_restore(self, step: int) -> bool:
        key = (*self._directory, step)
        with self._lock:
            if key in self._deleting:
                return False
            self._restoring[key] += 1
            return True

    def end_restore(self, step: int) -> None:
        key = (*self._directory, step)
        with self._lock:
            self._restoring[key] -= 1
            if self._restoring[key] <= 0:
                del self._restoring[key]

    def is_restoring(self, step: int) -> bool:
        with self._lock:
            return (*self._directory, step) in self._restoring

    def start_delete(self, step: int) -> bool:
        key = (*self._directory, step)
        with self._lock:
            if key in self._restoring:
                return False
            self._deleting.add(key)
            return True

    def end_delete(self, step: int) -> None:
        with self._lock:
            self._deleting.discard((*self._directory, step))
