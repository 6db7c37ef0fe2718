"""The ``payload`` step kind: one payload object in the step's folder, stored as a Checkpoint stores it (raw,
or a tar archive), committed by a manifest naming it with the BLAKE3 of each of its 16 MiB pieces, computed beside
the write (:mod:`taskpoint.format.pieces`). The kind of every step saved without ``dedup`` by one rank. Its
manifest is version 7 (version 4's layout); a partial restore through the archive's index checks the pieces it
reads. Steps saved before keep their version: 6, by one BLAKE3 of the object, and 1, by its sha256, read and
verified by it as they were."""

from __future__ import annotations

import dataclasses
import io
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..._progress import NO_PROGRESS, Progress
from ...format.codecs import Codec
from ...format.index import normalize_path
from ...format.pieces import PAYLOAD_PIECES
from ...format.records import ObjectRecord, StepManifest
from ...format.subset import CheckedRanges
from ...partial import indexed, open_by_restoring, open_indexed, restore_indexed
from ...payloads import BytesPayload, Payload, StagedBytes
from ...storage import Location, RetryPolicy
from ...transfer import write_payload
from ..background import store_payload, store_staged
from ..staging import Segment
from ..step_commit import OrphanCommit, Stored
from ..step_names import MANIFEST_NAME, PAYLOAD_NAME, name_in, stored_names
from ..steps import StepObjects, StepStore, save_clock
from . import (
    GONE_HOW,
    Checked,
    Described,
    Gone,
    SaveJob,
    StepContext,
    content_of,
    read_object,
    register_step_kind,
    stored_object,
)

_OWNED = stored_names(PAYLOAD_NAME.pattern)


@dataclass(frozen=True)
class PayloadObject:
    """The content of a payload step: the name of its payload object (``payload-<save id>``)."""

    kind: ClassVar[str] = "payload"
    name: str

    def to_json(self) -> dict[str, Any]:
        return {"payload": self.name}


class PayloadKind:
    """One payload object per step (see the module)."""

    name = PayloadObject.kind
    helper = True
    exclusive = True

    def decode(self, body: dict[str, Any]) -> PayloadObject:
        return PayloadObject(name_in(body, "payload", PAYLOAD_NAME, "a payload object"))

    def accepts(self, payload: Payload | object, context: StepContext) -> bool:
        return isinstance(payload, Payload)

    def store(self, context: StepContext, job: SaveJob) -> Stored:
        payload, steps, step = job.payload, context.steps, job.step
        assert isinstance(payload, Payload)
        save_id = uuid.uuid4().hex
        name = f"payload-{save_id}"
        record = ObjectRecord(kind=payload.kind, codec=context.codec.name if payload.archived else "raw",
                              save_id=save_id, created=time.time())
        manifest = StepManifest(step=step, record=record, attempt=job.attempt, metadata=job.metadata,
                                content=PayloadObject(name))
        began = save_clock()
        target = steps.object(step, name)
        if isinstance(payload, StagedBytes):  # the save process writes it from its segment, and commits it if we die
            write = StagedPayloadWrite(target.uri, target.storage_options, target.retry, name, manifest,
                                       context.codec, context.level)
            sizes, manifest = store_staged(steps.object(step, MANIFEST_NAME), payload.segment, write, job.saver,
                                           job.progress)
            return Stored(manifest.content, manifest.record, sizes, sent=sizes[name], began=began)
        # The save process commits this manifest itself (size and digest filled in) if we die meanwhile.
        orphan = OrphanCommit.at(steps.object(step, MANIFEST_NAME), manifest, fill=True)
        size, digest = store_payload(target, payload, context.codec, context.level, job.saver,
                                     orphan, job.progress, orphan.hash_name)
        record = record.with_digest(size, orphan.hash_name, digest)
        if payload.archived:
            record = dataclasses.replace(record, index=payload.written_index)
        return Stored(PayloadObject(name), record, {name: size}, sent=size, began=began)

    def restore(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                progress: Progress) -> Path:
        name = content_of(manifest, PayloadObject).name
        return read_object(context, step, name, manifest.record, workspace, progress)

    def restore_paths(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                      paths: Sequence[str], progress: Progress) -> Path:
        """With the archive's index, ranged reads of the members that hold ``paths``; without, the whole object
        streamed and verified against its digest, keeping those entries."""
        name, record = content_of(manifest, PayloadObject).name, manifest.record
        if not indexed(record.index, record.codec):
            return read_object(context, step, name, record, workspace, progress, only=paths)
        assert record.index is not None
        src = context.steps.object(step, name)
        try:
            return restore_indexed(src, record.index, paths, workspace, progress=progress,
                                   read_range=_checked_ranges(context, step, src, record))
        except FileNotFoundError:
            raise _gone(context, step, name) from None

    def open_file(self, context: StepContext, step: int, manifest: StepManifest, path: str) -> io.BufferedReader:
        name, record = content_of(manifest, PayloadObject).name, manifest.record
        if not indexed(record.index, record.codec):
            return open_by_restoring(lambda folder: self.restore_paths(
                context, step, manifest, folder, [normalize_path(path)], NO_PROGRESS), normalize_path(path))
        assert record.index is not None
        src = context.steps.object(step, name)
        return open_indexed(src, record.index, path, _checked_ranges(context, step, src, record))

    def verify(self, context: StepContext, step: int, manifest: StepManifest, progress: object) -> Checked:
        name, record = content_of(manifest, PayloadObject).name, manifest.record
        size = stored_object(context, step, name, record, progress, f"verify step {step}")
        return Checked(size, "blake3 pieces match its manifest" if record.pieces else
                       f"{record.hash_name} matches its manifest")

    def objects(self, steps: StepStore, step: int, manifest: StepManifest) -> StepObjects:
        name, record = content_of(manifest, PayloadObject).name, manifest.record
        return StepObjects(files={name: record.size}, digests={} if record.digest is None else {name: record.digest})

    def delete(self, steps: StepStore, step: int, manifest: StepManifest) -> set[str]:
        name = content_of(manifest, PayloadObject).name
        steps.object(step, name).remove()
        return {name}

    def describe(self, context: StepContext, step: int, manifest: StepManifest) -> Described:
        return Described(payload=content_of(manifest, PayloadObject).name, details={})

    def owns(self, name: str, committed: bool) -> bool:
        return bool(_OWNED.fullmatch(name))


def _checked_ranges(context: StepContext, step: int, src: Location, record: ObjectRecord) -> CheckedRanges | None:
    """Ranged reads of ``step``'s payload object that check the pieces they cover; None for an object recorded by
    one digest (manifest versions 1 to 6), whose ranged reads only the codec checks (each gzip member's CRC32)."""
    if not record.pieces:
        return None
    return CheckedRanges(src.read_range, record.pieces, record.size or 0, f"step {step} in {context.steps.directory}",
                         src.uri.rpartition("/")[2])


class _SegmentBytes(BytesPayload):
    """The bytes of a segment, written as they lie there (no copy)."""

    def __init__(self, view: memoryview) -> None:
        self._view = view


@dataclass(frozen=True)
class StagedPayloadWrite:
    """The save process's part of a background save of staged bytes: :meth:`run` writes the step's payload object
    ``name`` at ``uri`` from the segment, as :meth:`PayloadKind.store` writes bytes, and returns its size and
    ``manifest`` with the object's size and BLAKE3 pieces (written by the trainer, or by the save process for a trainer
    that died)."""

    uri: str
    storage_options: dict[str, Any]
    retry: RetryPolicy
    name: str
    manifest: StepManifest
    codec: Codec
    level: int | None

    def run(self, segment: Segment, progress: Progress) -> tuple[dict[str, int], StepManifest]:
        payload = _SegmentBytes(segment.buffer)
        size, digest = write_payload(Location(self.uri, self.storage_options, self.retry), payload, self.codec,
                                     self.level, PAYLOAD_PIECES, progress=progress)
        del payload  # no view of the segment is left: it can be unmapped
        record = self.manifest.record.with_digest(size, PAYLOAD_PIECES, digest)
        return {self.name: size}, dataclasses.replace(self.manifest, record=record)


def _gone(context: StepContext, step: int, name: str) -> Gone:
    return Gone(f"step {step} in {context.steps.directory} is committed but its payload {name} is missing: it was "
                f"removed after the commit{GONE_HOW}. Restore an older step (fallback=True), or delete this one.")


PAYLOAD = register_step_kind(PayloadKind())
