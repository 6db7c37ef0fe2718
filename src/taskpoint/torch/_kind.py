"""The step kind of a DCP checkpoint saved into a :class:`~taskpoint.CheckpointManager` step
(``Writer.for_step``): DCP's own files in the step's folder, listed with their sizes and sha256 by taskpoint's
file-set manifest, which the step's manifest names. taskpoint.torch registers it on import (and names this module
in the ``taskpoint.step_kinds`` entry points, so that any process reading such a step finds it); the core
knows none of DCP's file names.

The kind is named ``fileset``, the codec such steps have recorded since the first of them, and its manifests keep
that layout (format version 1 with codec ``fileset``), which older taskpoints read.
"""

from __future__ import annotations

import hashlib
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .._progress import Progress
from ..errors import CheckpointCorruptError, CheckpointError
from ..format.fileset import FileEntry, FileSetManifest
from ..format.records import FILESET_CODEC, ObjectRecord, StepManifest
from ..manager.kind_api import (
    Checked,
    Described,
    SaveJob,
    StepContext,
    StepObjects,
    StepStore,
    Stored,
    best_effort,
    register_step_kind,
    stored_names,
    stored_part,
)
from ._layout import DATA_FILE, MANIFEST_NAME, METADATA_NAME

#: What a save of such a step writes before its commit: swept from a step folder that no manifest commits.
_STRAY = stored_names(rf"{DATA_FILE.pattern}|{METADATA_NAME.replace('.', '[.]')}|{MANIFEST_NAME.replace('.', '[.]')}")


@dataclass(frozen=True)
class FileSetStep:
    """The content of a DCP step: the name of its file-set manifest in the step's folder.

    ``CheckpointManager.commit(step, FileSetStep())`` commits a step whose files a DCP writer stored in
    ``step_uri(step)``, with their manifest (``taskpoint.dcp.json``) beside them; ``Writer.for_step`` does so.
    """

    kind: ClassVar[str] = FILESET_CODEC
    name: str = MANIFEST_NAME

    def to_json(self) -> dict[str, Any]:
        return {"payload": self.name}


def _name(manifest: StepManifest) -> str:
    content = manifest.content
    assert isinstance(content, FileSetStep)
    return content.name


def _files(steps: StepStore, step: int, name: str) -> dict[str, FileEntry]:
    """The files the step's file-set manifest lists (``.metadata`` too). FileNotFoundError when that manifest is
    missing, CheckpointCorruptError when it is damaged."""
    location = steps.object(step, name)
    data = location.read_small()
    if data is None:
        raise FileNotFoundError(f"its manifest of files {name} is missing")
    return FileSetManifest.from_bytes(data, location.uri).files


class DcpKind:
    """DCP checkpoints in manager steps (see the module); committed by :meth:`CheckpointManager.commit
    <taskpoint.CheckpointManager.commit>` once the writer stored every file."""

    name = FILESET_CODEC
    helper = False

    def decode(self, body: dict[str, Any]) -> FileSetStep:
        name = str(body["payload"])
        if name != MANIFEST_NAME:
            raise ValueError(f"a file-set step's manifest is named {MANIFEST_NAME!r}, not {name!r}")
        return FileSetStep(name)

    def accepts(self, payload: object, context: StepContext) -> bool:
        return False  # saved by taskpoint.torch.Writer.for_step, never from a payload

    def store(self, context: StepContext, job: SaveJob) -> Stored:
        """What the writer stored: the manifest names their manifest by size and sha256."""
        content, steps, step = job.payload, context.steps, job.step
        assert isinstance(content, FileSetStep)
        location = steps.object(step, content.name)
        data = location.read_small()
        if data is None:
            raise FileNotFoundError(f"{location.uri} is missing: store the files and their manifest before the commit")
        files = FileSetManifest.from_bytes(data, location.uri).files
        record = ObjectRecord(kind=FILESET_CODEC, codec=FILESET_CODEC, save_id=uuid.uuid4().hex, created=time.time(),
                              size=len(data), sha256=hashlib.sha256(data).hexdigest())
        return Stored(content, record, {content.name: len(data), **{each: entry.size for each, entry in files.items()}})

    def restore(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                progress: Progress) -> Path:
        raise CheckpointError(
            f"step {step} in {context.steps.directory} is a PyTorch Distributed Checkpoint: load it with "
            f"dcp.load(state, storage_reader=taskpoint.torch.Reader.for_step(manager, {step}))")

    def verify(self, context: StepContext, step: int, manifest: StepManifest, progress: object) -> Checked:
        name = _name(manifest)
        files = _files(context.steps, step, name)
        checks = [(name, manifest.record.size, manifest.record.sha256, "sha256"),
                  *((each, entry.size, entry.sha256, entry.digest) for each, entry in sorted(files.items()))]
        for each, size, digest, by in checks:
            stored_part(context, step, each, size, digest, progress, f"verify step {step}: {each}", by)
        # The data the step holds, as ls shows it: its files, not the manifest of them.
        hashes = " and ".join(sorted({entry.hash_name for entry in files.values()}))
        return Checked(sum(entry.size for entry in files.values()), f"{len(files)} files, {hashes} match its manifest")

    def objects(self, steps: StepStore, step: int, manifest: StepManifest) -> StepObjects:
        name = _name(manifest)
        listed = _files(steps, step, name)
        return StepObjects(files={name: manifest.record.size, **{each: entry.size for each, entry in listed.items()}},
                           noun="file")

    def delete(self, steps: StepStore, step: int, manifest: StepManifest) -> set[str]:
        """The files as the file-set manifest lists them, then that manifest. One it cannot read leaves them to
        the sweep of uncommitted folders."""
        name = _name(manifest)
        try:
            files = _files(steps, step, name)
        except (CheckpointCorruptError, FileNotFoundError):
            return set()
        for each in files:
            best_effort(steps.object(step, each).remove)
        best_effort(steps.object(step, name).remove)
        return {name, *files}

    def describe(self, context: StepContext, step: int, manifest: StepManifest) -> Described:
        # Its payload is the manifest of the files that hold its data: the size is theirs.
        files = _files(context.steps, step, _name(manifest))
        return Described(payload=_name(manifest), details={
            "size": sum(entry.size for entry in files.values()), "payload_size": manifest.record.size,
            "files": len(files)})

    def owns(self, name: str, committed: bool) -> bool:
        return not committed and bool(_STRAY.fullmatch(name))


DCP = register_step_kind(DcpKind())
