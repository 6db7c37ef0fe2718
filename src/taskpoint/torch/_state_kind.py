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
Reading, verifying, listing and deleting the file is the core's kind of files
(:class:`~taskpoint.manager.kind_api.FilesKind`), whose list of files here is the step's manifest itself.
taskpoint.torch registers the kind on import and names this module in the ``taskpoint.step_kinds`` entry points.
"""

from __future__ import annotations

import io
import re
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .._progress import Progress
from ..errors import CheckpointCorruptError
from ..format.fileset import FileEntry, piece_spans, read_piece_hash
from ..format.names import STATE_DICT_KIND as STEP_KIND
from ..format.records import StepManifest
from ..manager.kind_api import (
    MANIFEST_NAME,
    Described,
    FilesKind,
    SaveJob,
    StepContext,
    StepStore,
    Stored,
    content_of,
    name_in,
    register_step_kind,
    store_staged,
    stored_names,
)
from ..storage import WRITE_PIECE
from ._staged import StagedStateDict
from ._state import StateDictPayload
from ._state_file import STATE_FILE, StateDictFile, state_manifest, write_state

_FILE = re.compile(r"state-[0-9a-f]{32}[.]pt")
_OWNED = stored_names(_FILE.pattern)
_HEX = re.compile(r"[0-9a-f]{64}")


def _check_path(path: str) -> None:
    if path not in ("", ".", STATE_FILE):
        raise KeyError(f"{path!r} is not in the step: a state-dict step holds one file, {STATE_FILE!r}")


class StateDictKind(FilesKind):
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
        """``torch.save`` into the step's file through a :class:`~taskpoint.pieces.PieceWriter` (fsynced on local
        disk), for a commit whose manifest holds the pieces' digests. A state staged by a background save is written
        from its segment by the manager's save process (:mod:`._staged`), which commits it itself if this process
        dies first."""
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

    # -- its file, as the core's kind of files reads it ------------------------------------------------------

    def files(self, steps: StepStore, step: int, manifest: StepManifest) -> dict[str, FileEntry]:
        """The step's one file and its pieces, as its manifest lists them."""
        content, size = content_of(manifest, StateDictFile), manifest.record.size
        if size is None or len(piece_spans(size, content.piece_size)) != len(content.pieces):
            raise CheckpointCorruptError(f"step {step} in {steps.directory} is damaged: its manifest lists "
                                         f"{len(content.pieces)} pieces for {size} bytes")
        return {content.file: FileEntry.of_pieces(size, content.pieces, content.piece_hash, content.piece_size)}

    def listing(self, manifest: StepManifest) -> dict[str, int | None]:
        return {}  # the step's manifest lists the file

    def restored_as(self, rel: str) -> str:
        return STATE_FILE

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
        name = content_of(manifest, StateDictFile).file
        return io.BufferedReader(self.reader(context, step, manifest, name), WRITE_PIECE)

    def describe(self, context: StepContext, step: int, manifest: StepManifest) -> Described:
        content = content_of(manifest, StateDictFile)
        return Described(payload=content.file, details={"pieces": len(content.pieces),
                                                        "piece_size": content.piece_size,
                                                        "piece_hash": content.piece_hash,
                                                        "piece_digests": list(content.pieces)})

    def owns(self, name: str, committed: bool) -> bool:
        return bool(_OWNED.fullmatch(name))


STATE_DICT = register_step_kind(StateDictKind())
