"""The step kind of a DCP checkpoint saved into a :class:`~taskpoint.CheckpointManager` step
(``Writer.for_step``): DCP's own files in the step's folder, listed with their sizes and sha256 by taskpoint's
file-set manifest, which the step's manifest names. taskpoint.torch registers it on import (and names this module
in the ``taskpoint.step_kinds`` entry points, so that any process reading such a step finds it); the core
knows none of DCP's file names. Reading, verifying, listing and deleting the files is the core's kind of files
(:class:`~taskpoint.manager.kind_api.FilesKind`); a step's files lie in its folder itself, beside their list.

The kind is named ``fileset``, the codec such steps have recorded since the first of them, and its manifests keep
that layout (format version 1 with codec ``fileset``), which older taskpoints read.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .._progress import Progress
from ..errors import CheckpointError
from ..format.fileset import FileSetManifest
from ..format.records import FILESET_CODEC, StepManifest
from ..manager.kind_api import FilesKind, SaveJob, StepContext, Stored, register_step_kind, stored_files, stored_names
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

    @property
    def folder(self) -> str:
        """Where the files lie in the step's folder: in it, beside their manifest."""
        return ""

    @property
    def manifest(self) -> str:
        return self.name

    def to_json(self) -> dict[str, Any]:
        return {"payload": self.name}


class DcpKind(FilesKind):
    """DCP checkpoints in manager steps (see the module); committed by :meth:`CheckpointManager.commit
    <taskpoint.CheckpointManager.commit>` once the writer stored every file. Never read in place either: the
    step's folder holds the step's manifest and the list of files beside them."""

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
        content = job.payload
        assert isinstance(content, FileSetStep)
        location = context.steps.object(job.step, content.name)
        data = location.read_small()
        if data is None:
            raise FileNotFoundError(f"{location.uri} is missing: store the files and their manifest before the commit")
        files = FileSetManifest.from_bytes(data, location.uri).files
        return stored_files(content, data, files, FILESET_CODEC, FILESET_CODEC, uuid.uuid4().hex)

    def restore(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                progress: Progress) -> Path:
        raise CheckpointError(
            f"step {step} in {context.steps.directory} is a PyTorch Distributed Checkpoint: load it with "
            f"dcp.load(state, storage_reader=taskpoint.torch.Reader.for_step(manager, {step}))")

    def owns(self, name: str, committed: bool) -> bool:
        return not committed and bool(_STRAY.fullmatch(name))


DCP = register_step_kind(DcpKind())
