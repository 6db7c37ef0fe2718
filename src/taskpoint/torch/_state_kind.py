"""The ``torch.state_dict`` step kind: a :class:`~taskpoint.torch.StateDict` written by ``torch.save`` straight
into the step's folder, hashed in pieces while it is written.

A step of this kind holds, in its folder::

    state-<save id>.pt   the ``torch.save`` file (on local disk fsynced before the commit; on an object store
                         streamed up as it is serialized)
    taskpoint.json       the step's manifest: the file's name, its size, the digest of each 16 MiB piece
                         (BLAKE3; sha256 in steps saved before, which still load), and as the record's sha256
                         the sha256 of those digests

Why: serializing into bytes and saving those as a payload copies and hashes every byte after ``torch.save`` is
done (2.2x ``torch.save`` + fsync, issue 26); here the pieces are written and hashed on other threads while
``torch.save`` goes on. A restore (``restore()``, ``restore(paths=["state_dict.pt"])``, ``open(step,
"state_dict.pt")``, :func:`~taskpoint.torch.load_state_dict_sync`) checks each piece before its bytes are used.
taskpoint.torch registers the kind on import and names this module in the ``taskpoint.step_kinds`` entry points.
"""

from __future__ import annotations

import io
import os
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._progress import Progress
from ..errors import CheckpointCorruptError
from ..format.fileset import read_piece_hash
from ..format.names import STATE_DICT_KIND as STEP_KIND
from ..format.records import StepManifest
from ..manager.kind_api import (
    MANIFEST_NAME,
    Checked,
    Described,
    Gone,
    SaveJob,
    StepContext,
    StepObjects,
    StepStore,
    Stored,
    best_effort,
    content_of,
    file_gone,
    name_in,
    register_step_kind,
    store_staged,
    stored_names,
)
from ..payloads import DirectoryPayload
from ..storage import WRITE_PIECE
from ..workspace import Staging
from ._pieces import PieceReader
from ._staged import StagedStateDict
from ._state import StateDictPayload
from ._state_file import STATE_FILE, StateDictFile, state_manifest, write_state

_FILE = re.compile(r"state-[0-9a-f]{32}[.]pt")
_OWNED = stored_names(_FILE.pattern)
_HEX = re.compile(r"[0-9a-f]{64}")


def _check_path(path: str) -> None:
    if path not in ("", ".", STATE_FILE):
        raise KeyError(f"{path!r} is not in the step: a state-dict step holds one file, {STATE_FILE!r}")


class StateDictKind:
    """State dicts in manager steps (see the module): saved by a blocking save in this process, and from a background
    save's segment by the manager's save process (``helper``), which commits it even if this process dies first. A
    snapshot of ``torch.save`` bytes (a background save without a save process) is not accepted: it is a payload."""

    name = STEP_KIND
    helper = True

    def decode(self, body: dict[str, Any]) -> StateDictFile:
        name = name_in(body, "file", _FILE, "a state dict's file")
        piece_size, pieces = int(body["piece_size"]), tuple(body["pieces"])
        piece_hash = read_piece_hash(body)
        if piece_size <= 0 or not pieces or not all(isinstance(p, str) and _HEX.fullmatch(p) for p in pieces):
            raise ValueError("its piece digests are malformed")
        return StateDictFile(name, piece_size, pieces, piece_hash)

    def accepts(self, payload: object, context: StepContext) -> bool:
        return isinstance(payload, StagedStateDict) or (isinstance(payload, StateDictPayload) and not \
            payload.is_serialized)

    def store(self, context: StepContext, job: SaveJob) -> Stored:
        """``torch.save`` into the step's file through a :class:`PieceWriter` (fsynced on local disk), for a commit
        whose manifest holds the pieces' digests. A state staged by a background save is written from its segment
        by the manager's save process (:mod:`._staged`), which commits it itself if this process dies first."""
        payload, steps, step = job.payload, context.steps, job.step
        save_id = uuid.uuid4().hex
        name = f"state-{save_id}.pt"
        target = steps.object(step, name)
        if isinstance(payload, StagedStateDict):
            staged = payload.write_job((target.uri, target.storage_options, target.retry), name, save_id, step,
                                       job.attempt, job.metadata)
            sizes, manifest = store_staged(steps.object(step, MANIFEST_NAME), payload.segment, staged, job.saver,
                                           job.progress)
        else:
            assert isinstance(payload, StateDictPayload)
            size, digests = write_state(target, payload.save_into, job.progress)
            sizes, manifest = {name: size}, state_manifest(step, job.attempt, job.metadata, save_id, name, size,
                                                           digests)
        return Stored(manifest.content, manifest.record, sizes, sent=sum(sizes.values()))

    # -- reading -------------------------------------------------------------------------------------------

    def _reader(self, context: StepContext, step: int, manifest: StepManifest) -> PieceReader:
        steps, content = context.steps, content_of(manifest, StateDictFile)
        source = steps.object(step, content.file)
        size = manifest.record.size
        if size is None or -(-size // content.piece_size) != len(content.pieces) - (size == 0):
            raise CheckpointCorruptError(f"step {step} in {steps.directory} is damaged: its manifest lists "
                                         f"{len(content.pieces)} pieces for {size} bytes")

        def damaged(index: int) -> CheckpointCorruptError:
            return CheckpointCorruptError(
                f"step {step} in {steps.directory} is damaged: piece {index} of {content.file} (bytes from "
                f"{index * content.piece_size}) does not match the {content.piece_hash} of its manifest (or the file "
                f"is not the {size} bytes it was saved with). Restore an older step (fallback=True), or save it "
                "again.")

        if source.is_local:
            try:
                fd = os.open(source.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise file_gone(steps, step, content.file) from None
            return PieceReader(size, list(content.pieces), content.piece_size, damaged,
                               piece_hash=content.piece_hash, fd=fd, name=source.path)

        def fetch(start: int, length: int) -> bytes:
            try:
                return source.read_range(start, length)
            except FileNotFoundError:
                raise file_gone(steps, step, content.file) from None

        return PieceReader(size, list(content.pieces), content.piece_size, damaged,
                           piece_hash=content.piece_hash, fetch=fetch)

    def restore(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                progress: Progress) -> Path:
        """The file as ``<workspace>/state_dict.pt``, each piece checked before it is written; the workspace."""
        progress.set_total(manifest.record.size or 0)
        workspace.mkdir(parents=True, exist_ok=True)
        with Staging(workspace) as staging, self._reader(context, step, manifest) as reader, \
                open(staging / STATE_FILE, "xb") as out:
            buffer = bytearray(WRITE_PIECE)
            while count := reader.readinto(buffer):
                out.write(memoryview(buffer)[:count])
                progress.update(count)
            out.close()
            return DirectoryPayload.publish(staging, workspace)

    def restore_paths(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                      paths: Sequence[str], progress: Progress) -> Path:
        for path in paths:
            _check_path(path)
        return self.restore(context, step, manifest, workspace, progress)

    def open_file(self, context: StepContext, step: int, manifest: StepManifest, path: str) -> io.BufferedReader:
        """The state dict's file, its pieces fetched ahead and each checked before it is read
        (``torch.load(manager.open(step, "state_dict.pt"))``)."""
        _check_path(path.strip("/"))
        if path.strip("/") != STATE_FILE:
            raise IsADirectoryError(f"{path!r} is the step's folder, not a file; open {STATE_FILE!r}")
        return io.BufferedReader(self._reader(context, step, manifest), WRITE_PIECE)

    def verify(self, context: StepContext, step: int, manifest: StepManifest, progress: object) -> Checked:
        content = content_of(manifest, StateDictFile)
        try:
            with self._reader(context, step, manifest) as reader:
                size = reader.verify_all()
        except Gone:
            raise FileNotFoundError(f"its file {content.file} is missing") from None
        return Checked(size, f"{len(content.pieces)} pieces, {content.piece_hash} matches its manifest")

    # -- listing and deleting ------------------------------------------------------------------------------

    def objects(self, steps: StepStore, step: int, manifest: StepManifest) -> StepObjects:
        return StepObjects(files={content_of(manifest, StateDictFile).file: manifest.record.size}, noun="file")

    def delete(self, steps: StepStore, step: int, manifest: StepManifest) -> set[str]:
        name = content_of(manifest, StateDictFile).file
        best_effort(steps.object(step, name).remove)
        return {name}

    def describe(self, context: StepContext, step: int, manifest: StepManifest) -> Described:
        content = content_of(manifest, StateDictFile)
        return Described(payload=content.file, details={"pieces": len(content.pieces),
                                                        "piece_size": content.piece_size,
                                                        "piece_hash": content.piece_hash})

    def owns(self, name: str, committed: bool) -> bool:
        return bool(_OWNED.fullmatch(name))


STATE_DICT = register_step_kind(StateDictKind())
