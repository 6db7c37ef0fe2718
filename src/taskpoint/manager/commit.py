"""Writing one step: the payload under a fresh name, then the manifest that commits it, then tidying up."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import time
import uuid
import warnings
from collections.abc import Callable
from typing import Any

from .. import _log
from .._log import TransferStats
from .._progress import NO_PROGRESS, Progress
from ..format.codecs import Codec
from ..format.fileset import FileSetManifest
from ..format.records import FILESET_CODEC, ObjectRecord, StepManifest
from ..payloads import Payload
from .background import Handover, store_payload
from .claims import Claims
from .dedup import Dedup, deduplicable
from .protect import Guard
from .shards import RankPlan, ShardWriter
from .steps import FILESET_NAME, MANIFEST_NAME, StepStore, quietly


class StepWriter:
    """Writes the steps of one manager: each a payload of its own name, committed by its manifest."""

    def __init__(self, steps: StepStore, claims: Claims, codec: Codec, level: int | None, guard: Guard,
                 grace: float, dedup: Dedup | None = None, plan: RankPlan | None = None,
                 waiting: Callable[[int], None] | None = None) -> None:
        self._steps, self._claims, self._dedup = steps, claims, dedup
        self._codec, self._level = codec, level
        self._guard, self._grace = guard, grace
        # ``waiting``: told the step while rank 0 waits for its shards (the preemption agreement).
        self._shards = (ShardWriter(steps, plan, grace, waiting) if plan is not None and plan.ranks.distributed
                        else None)
        #: The last step this writer saved (its shard, with several ranks), committed or not.
        self.last_step: int | None = None

    def write(self, step: int, metadata: dict[str, Any], attempt: int | None, replaced: str | None,
              payload: Payload, saver: Handover | None = None, *, clock: _log.Clock,
              progress: Progress = NO_PROGRESS) -> TransferStats:
        """Upload the payload under a fresh name (or, deduplicated, its missing chunks), then commit it with the
        manifest; then tidy up. Returns the save's figures (``CheckpointManager.last_save``). With several ranks,
        the payload is this rank's shard, and rank 0 alone commits and tidies (:mod:`.shards`). ``progress``
        counts the upload; its callback is told the last count once the step is committed."""
        self.last_step = step
        with progress:
            if self._shards is not None:
                return self._write_shard(step, metadata, attempt, payload, saver, clock=clock, progress=progress)
            return self._write(step, metadata, attempt, replaced, payload, saver, clock, progress)

    def deduplicates(self, payload: Payload) -> bool:
        """Whether ``payload`` is saved as a deduplicated step, whose chunks this process uploads itself."""
        return self._dedup is not None and deduplicable(payload)

    def _write(self, step: int, metadata: dict[str, Any], attempt: int | None, replaced: str | None,
               payload: Payload, saver: Handover | None, clock: _log.Clock, progress: Progress) -> TransferStats:
        save_id = uuid.uuid4().hex
        chunked = self.deduplicates(payload)  # its chunks: named by a lease until the commit
        name = "" if chunked else f"payload-{save_id}"
        manifest_loc = self._steps.object(step, MANIFEST_NAME)
        record = ObjectRecord(kind=payload.kind, codec="chunked" if chunked else
                              self._codec.name if payload.archived else "raw", save_id=save_id, created=time.time())
        manifest = StepManifest(step=step, payload=name, record=record, attempt=attempt, metadata=metadata)
        with self._dedup.lease() if chunked and self._dedup is not None else contextlib.nullcontext():
            if chunked and self._dedup is not None:
                size, digest, tree = self._dedup.store(payload, progress)
                sent = self._dedup.last.uploaded_bytes if self._dedup.last else size  # what crossed the wire
            else:
                # The save process commits this manifest itself (size and digest filled in) if we die meanwhile.
                size, digest = store_payload(self._steps.object(step, name), payload, self._codec, self._level,
                                             saver, (manifest_loc, manifest), progress)
                tree, sent = None, size
            manifest = dataclasses.replace(manifest, tree=tree,
                                           record=dataclasses.replace(record, size=size, sha256=digest))

            # A failed commit leaves the payload in place: the write may have landed although it raised (a lost
            # response, an interrupt after the PUT), and then the manifest names this payload. Deleting it would
            # leave a committed step naming nothing; if the manifest did not land, the payload is a leftover
            # that no manifest names, removed by a later save or gc() once older than the grace period.
            def write() -> None:
                manifest_loc.write_small(manifest.to_bytes(), action="commit the checkpoint at")

            if tree is not None and self._dedup is not None:
                self._dedup.commit(tree, write, manifest_loc.remove)
            else:
                self._steps.check_stored(step, {name: size})
                write()
        self._steps.committed(step)
        self._guard.committed(step, metadata)
        if replaced is not None and replaced != name and not self._claims.is_restoring(step):
            quietly(self._steps.object(step, replaced).remove)
        self._tidy()
        return _log.transferred("save", self._steps.step_uri(step), payload.kind, sent, clock, step)

    def _write_shard(self, step: int, metadata: dict[str, Any], attempt: int | None, payload: Payload,
                     saver: Handover | None, *, clock: _log.Clock, progress: Progress) -> TransferStats:
        assert self._shards is not None
        codec = self._codec.name if payload.archived else "raw"
        # The save process finishes this rank's part (its record; on rank 0, the commit) if we die meanwhile.
        size = self._shards.write(step, metadata, attempt, payload, codec,
                                  lambda location, orphan: store_payload(location, payload, self._codec, self._level,
                                                                         saver, orphan, progress=progress))
        if self._shards.commits:
            self._steps.committed(step)
            self._guard.committed(step, metadata)
            self._tidy()
        return _log.transferred("save", self._steps.step_uri(step), payload.kind, size, clock, step)

    def commit_files(self, step: int, name: str, data: bytes, attempt: int | None,
                     metadata: dict[str, Any]) -> None:
        """Commit a step whose files another writer stored in its folder (``taskpoint.torch``): the manifest
        names their own manifest, ``name`` holding ``data``, by size and sha256. Then tidy up."""
        if name != FILESET_NAME:
            raise ValueError(f"a file-set step's manifest is named {FILESET_NAME!r}, not {name!r}")
        record = ObjectRecord(kind=FILESET_CODEC, codec=FILESET_CODEC, save_id=uuid.uuid4().hex, created=time.time(),
                              size=len(data), sha256=hashlib.sha256(data).hexdigest())
        manifest = StepManifest(step=step, payload=name, record=record, attempt=attempt, metadata=metadata)
        files = FileSetManifest.from_bytes(data, self._steps.object(step, name).uri).files
        self._steps.check_stored(step, {name: len(data), **{each: entry.size for each, entry in files.items()}})
        self._steps.object(step, MANIFEST_NAME).write_small(manifest.to_bytes(), action="commit the checkpoint at")
        self._steps.committed(step)
        self._guard.committed(step, metadata)
        self._tidy()

    def _tidy(self) -> None:
        """After a commit: apply retention and remove old leftovers. Never fails the save that committed."""
        try:
            removed = self._steps.tidy(self._guard.choose, self._grace)
            if self._dedup is not None and self._dedup.sweep_due():
                removed += self._dedup.sweep()  # the chunks of the steps deleted since the last sweep
            if removed:
                _log.logger.debug("swept %d leftover(s) in %s: %s", len(removed), _log.safe_uri(self._steps.directory),
                                  [_log.safe_uri(uri) for uri in removed])
        except Exception as exc:
            warnings.warn(f"taskpoint saved the new step but could not tidy {self._steps.directory} ({exc}); old steps "
                          "and leftovers will be removed by a later save or gc()", RuntimeWarning, stacklevel=2)
