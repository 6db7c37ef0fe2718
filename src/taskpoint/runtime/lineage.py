"""Lineage: the attempts of one run and action in storage, and which earlier attempt a new one resumes.

The source of attempt ``n`` is the newest earlier attempt of the same run and action that holds a
checkpoint, so an attempt that died before its first save never costs the progress before it. The layout
is in :mod:`.layout`.
"""

from __future__ import annotations

import json
import os
import socket
import time
from typing import Any

from ..checkpoint import Checkpoint
from ..storage import Location
from .layout import ATTEMPT_MARKER, CHECKPOINT_NAME, STEPS_FOLDER
from .state import TaskContext


class ActionStore:
    """The storage of one run and action: its attempt folders and what they hold."""

    def __init__(self, root: str, run_name: str, action_name: str, storage_options: dict[str, Any] | None,
                 manager_options: dict[str, Any] | None = None):
        self.manager_options = dict(manager_options or {})
        self.root = root.rstrip("/") if "://" in root else os.path.abspath(root)
        self.run_name = run_name
        self.action_name = action_name
        self.storage_options = storage_options
        self.prefix = f"{self.root}/{run_name}/{action_name}"
        self._folder = Location(self.prefix, storage_options)

    def attempt_uri(self, attempt: int) -> str:
        return f"{self.prefix}/{attempt}/{CHECKPOINT_NAME}"

    def steps_uri(self) -> str:
        return f"{self.prefix}/{STEPS_FOLDER}"

    def attempts(self) -> list[int]:
        """Attempt numbers that exist in storage (marker or checkpoint), ascending."""
        found = {int(name) for name in self._folder.list_names() if name.isdigit()}
        return sorted(n for n in found if n >= 1)

    def begin(self, attempt: int) -> None:
        marker = {"attempt": attempt, "started": time.time(), "pid": os.getpid(), "host": socket.gethostname()}
        self._folder.child(f"{attempt}/{ATTEMPT_MARKER}").write_small(
            json.dumps(marker).encode(), action="start the attempt at")

    def resume_source(self, attempt: int) -> str | None:
        """The checkpoint of the newest earlier attempt that saved one; None when none did."""
        for earlier in sorted((n for n in self.attempts() if n < attempt), reverse=True):
            uri = self.attempt_uri(earlier)
            if Location(uri, self.storage_options).exists():
                return uri
        return None

    def context(self, attempt: int, max_attempts: int | None) -> TaskContext:
        checkpoint = Checkpoint(self.attempt_uri(attempt), self.resume_source(attempt),
                                storage_options=self.storage_options)
        return TaskContext(run_name=self.run_name, action_name=self.action_name, attempt=attempt,
                           max_attempts=max_attempts, checkpoint=checkpoint, root=self.root,
                           storage_options=self.storage_options, manager_options=self.manager_options)
