"""Lineage: the attempts of one run and action in storage, and which earlier attempt a new one resumes.

The source of attempt ``n`` is the newest earlier attempt of the same run and action that holds a
checkpoint, so an attempt that died before its first save never costs the progress before it. The layout
is in :mod:`.layout`.

With several ranks, each rank saves to ``{attempt}/checkpoint/rank-{k}`` and resumes from its own shard of
the newest earlier attempt that ran with as many ranks and where *every* rank saved; rank 0 chooses the
attempt number and the others agree on it through storage (:mod:`.rendezvous`).
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from .. import _log
from ..checkpoint import Checkpoint
from ..errors import NewerFormatError
from ..format.documents import ATTEMPT_FORMAT, read_small_document, small_document
from ..ranks import Ranks
from ..storage import Location
from ..storage.uris import check_uri
from .layout import ATTEMPT_MARKER, CHECKPOINT_NAME, RENDEZVOUS_FOLDER, rank_object, rendezvous_timeout
from .rendezvous import agree
from .state import TaskContext


class ActionStore:
    """The storage of one run and action: its attempt folders and what they hold."""

    def __init__(self, root: str, run_name: str, action_name: str, storage_options: dict[str, Any] | None,
                 manager_options: dict[str, Any] | None = None, ranks: Ranks | None = None):
        self.manager_options = dict(manager_options or {})
        self.ranks = ranks or Ranks()
        self._claimed: int | None = None  # the attempt the ranks last agreed on
        check_uri(root, "root")  # before a malformed URL becomes a local folder below
        self.root = root.rstrip("/") if "://" in root else os.path.abspath(root)
        self.run_name = run_name
        self.action_name = action_name
        self.storage_options = storage_options
        self.prefix = f"{self.root}/{run_name}/{action_name}"
        self._folder = Location(self.prefix, storage_options)

    def attempt_uri(self, attempt: int) -> str:
        """Where this rank saves in ``attempt`` (``{attempt}/checkpoint``, with several ranks ``/rank-{k}``)."""
        return rank_object(f"{self.prefix}/{attempt}/{CHECKPOINT_NAME}", self.ranks)

    def attempts(self) -> list[int]:
        """Attempt numbers that exist in storage (marker or checkpoint), ascending."""
        found = {int(name) for name in self._folder.list_names() if name.isdigit()}
        return sorted(n for n in found if n >= 1)

    def begin(self, attempt: int) -> None:
        """Write the attempt's marker (with several ranks, rank 0 writes it, with the world size), a
        :data:`~taskpoint.format.documents.ATTEMPT_FORMAT` document."""
        marker: dict[str, Any] = {"attempt": attempt, "started": time.time(), "pid": os.getpid(),
                                  "host": socket.gethostname()}
        if self.ranks.distributed:
            if self.ranks.rank != 0:
                return
            marker["world_size"] = self.ranks.world_size
        self._folder.child(f"{attempt}/{ATTEMPT_MARKER}").write_small(
            small_document(ATTEMPT_FORMAT, marker), action="start the attempt at")

    def claim(self, attempt: int | None = None) -> int:
        """Start the attempt all ranks of this launch run, and return it: ``attempt`` when given, else the next
        free one. With several ranks rank 0 chooses and writes the marker, and the others agree through storage
        (:mod:`.rendezvous`); an attempt the ranks already agreed on is not agreed again."""
        def choose() -> int:
            number = attempt if attempt is not None else max(self.attempts(), default=0) + 1
            self.begin(number)
            return number

        if not self.ranks.distributed:
            return choose()
        if attempt is None or attempt != self._claimed:
            self._claimed = agree(self._folder.child(RENDEZVOUS_FOLDER), self.ranks, choose, rendezvous_timeout())
            if attempt is not None and self._claimed != attempt:
                raise RuntimeError(f"rank {self.ranks.rank} starts attempt {attempt} of {self.prefix} but rank 0 "
                                   f"started attempt {self._claimed}: the ranks retried a different number of times")
        return self._claimed

    def resume_source(self, attempt: int) -> str | None:
        """The checkpoint of the newest earlier attempt that saved one; None when none did. With several ranks:
        this rank's shard of the newest earlier attempt of as many ranks in which every rank saved."""
        for earlier in sorted((n for n in self.attempts() if n < attempt), reverse=True):
            uri = self.attempt_uri(earlier)
            if not self.ranks.distributed:
                if Location(uri, self.storage_options).exists():
                    return uri
            elif self._saved_by_all(earlier):
                return uri
        return None

    def _saved_by_all(self, attempt: int) -> bool:
        """Whether every rank of ``attempt`` saved, and it ran with this launch's number of ranks."""
        world = self.ranks.world_size
        data = self._folder.child(f"{attempt}/{ATTEMPT_MARKER}").read_small()
        try:
            ran_with = int(read_small_document(data, ATTEMPT_FORMAT).get("world_size", 1)) if data is not None else 1
        except (ValueError, TypeError, NewerFormatError):  # unreadable, or a newer taskpoint's: not resumed from
            return False
        saved = set(self._folder.child(f"{attempt}/{CHECKPOINT_NAME}").list_names())
        complete = all(f"rank-{rank}" in saved for rank in range(ran_with))
        if ran_with != world and complete:
            _log.logger.warning("taskpoint: attempt %d of %s ran with %d ranks, this one with %d: its checkpoint "
                                "is not resumed (its shards do not fit)", attempt, _log.safe_uri(self.prefix),
                                ran_with, world)
        return ran_with == world and complete

    def context(self, attempt: int, max_attempts: int | None) -> TaskContext:
        checkpoint = Checkpoint(self.attempt_uri(attempt), self.resume_source(attempt),
                                storage_options=self.storage_options)
        return TaskContext(run_name=self.run_name, action_name=self.action_name, attempt=attempt,
                           max_attempts=max_attempts, checkpoint=checkpoint, root=self.root,
                           storage_options=self.storage_options, manager_options=self.manager_options,
                           rank=self.ranks.rank, world_size=self.ranks.world_size, local_rank=self.ranks.local_rank)
