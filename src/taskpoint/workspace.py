"""The local folder where loads land: a private temp folder, or one the caller chose, never shared."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path

from .storage import normalize_uri

#: Prefix of the folders where a load is staged until it is verified; they live inside the workspace.
STAGING_PREFIX = ".taskpoint-staging-"


class Workspace:
    """The local folder of one Checkpoint: private temp folder, or one the caller chose."""

    _in_use: set[str] = set()
    _to_remove: set[str] = set()
    _guard = threading.Lock()
    _exit_hook = False

    def __init__(self, folder: str | os.PathLike[str] | None) -> None:
        if folder is None:
            self.path = Path(tempfile.mkdtemp(prefix="taskpoint-"))
            self.owned = True
        else:
            self.path = Path(normalize_uri(folder, "workspace")).absolute()
            self.path.mkdir(parents=True, exist_ok=True)
            self.owned = False
        key = str(self.path.resolve())
        with self._guard:
            if not Workspace._exit_hook:
                atexit.register(Workspace.remove_all)
                Workspace._exit_hook = True
            if key in self._in_use:
                raise ValueError(f"workspace {self.path} is already used by another open Checkpoint")
            self._in_use.add(key)
            if self.owned:
                self._to_remove.add(key)
        self._key = key

    def close(self) -> None:
        with self._guard:
            self._in_use.discard(self._key)
            self._to_remove.discard(self._key)
        if self.owned:
            shutil.rmtree(self.path, ignore_errors=True)
        else:
            for leftover in self.path.glob(STAGING_PREFIX + "*"):
                shutil.rmtree(leftover, ignore_errors=True)

    @classmethod
    def remove_all(cls) -> None:
        with cls._guard:
            paths, cls._to_remove = list(cls._to_remove), set()
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)


