"""The ``jax.pytree`` step kind: a :class:`~taskpoint.jax.PyTree` saved into a manager step as the files Orbax
writes, committed and hashed in place, instead of a copy of them in a tar archive.

A step of this kind holds, in its folder::

    pytree-<save id>/            the folder :meth:`~taskpoint.jax._pytree.Encoded.write` makes: the sidecar and
                                 Orbax's checkpoint of the arrays (``orbax/``), written there by Orbax itself
                                 when the store is the local disk, else uploaded file by file
    pytree-<save id>.files.json  taskpoint's file-set manifest: every file of that folder, its size and sha256
                                 (a file larger than 16 MiB: the BLAKE3 of each 16 MiB piece)
    taskpoint.json               the step's manifest, naming the folder and the file-set manifest's sha256

Why: an archive costs a second copy of every byte and one core of gzip on save and on restore (a 256 MiB tree
saved 1.45x and restored 2.2x Orbax's own time, issue 26); the files as Orbax wrote them cost one read to hash.
A restore reads every file against its digests before Orbax sees it: into the restore's folder, or (through
:func:`taskpoint.jax.load_pytree` on a local directory) in place. All of that is the core's kind of files
(:class:`~taskpoint.manager.kind_api.FilesKind`); this module says only how a tree becomes its files.
taskpoint.jax registers the kind on import and names this module in the ``taskpoint.step_kinds`` entry points,
so that any process reading such a step finds it.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from .._progress import Progress
from ..errors import CheckpointCorruptError
from ..format.fileset import FileSetManifest
from ..manager.kind_api import (
    MANIFEST_NAME,
    FilesKind,
    SaveJob,
    Segment,
    StepContext,
    StepManifest,
    Stored,
    name_in,
    register_step_kind,
    store_folder,
    store_listing,
    store_staged,
    stored_names,
    write_folder,
    write_listing,
)
from ..storage import Location
from ._payload import PyTreePayload
from ._pytree import KIND, Encoded
from ._staged import StagedTree, rebuilt

#: The format the file-set manifest names (what wrote the files).
FILES_KIND = "jax.orbax"
#: The codec the step's record names: files as Orbax wrote them, no archive.
FILES_CODEC = "files"
_FOLDER = re.compile(r"pytree-[0-9a-f]{32}")
_OWNED = stored_names(r"pytree-[0-9a-f]{32}[.]files[.]json")


@dataclass(frozen=True)
class PyTreeFiles:
    """The content of a PyTree step: the folder of the tree's files in the step's folder."""

    kind: ClassVar[str] = KIND
    folder: str

    @property
    def manifest(self) -> str:
        """The name of the file-set manifest that lists the folder's files."""
        return f"{self.folder}.files.json"

    def to_json(self) -> dict[str, Any]:
        return {"folder": self.folder}


class PyTreeKind(FilesKind):
    """PyTrees in manager steps, as Orbax's files (see the module), saved by a blocking save in this process, and
    from a background save's segment by the manager's save process (``helper``), which commits it even if this
    process dies first. A background save's snapshot (a tree serialized already, when it was not staged) is not
    accepted: it travels as a directory archive, a payload."""

    name = KIND
    helper = True

    def decode(self, body: dict[str, Any]) -> PyTreeFiles:
        return PyTreeFiles(name_in(body, "folder", _FOLDER, "a PyTree folder"))

    def accepts(self, payload: object, context: StepContext) -> bool:
        return isinstance(payload, StagedTree) or (isinstance(payload, PyTreePayload) and not payload.is_serialized)

    def store(self, context: StepContext, job: SaveJob) -> Stored:
        """Write the tree's files into the step's folder (Orbax itself, on local disk), hash them, and write their
        file-set manifest, which the step's manifest names. A tree staged by a background save is written so from
        its segment by the manager's save process (:mod:`._staged`), which commits it itself if this process dies
        first."""
        save_id = uuid.uuid4().hex
        content = PyTreeFiles(f"pytree-{save_id}")
        steps, step = context.steps, job.step
        if isinstance(job.payload, StagedTree):
            write = StagedTreeWrite(job.payload.skeleton, content, _where(steps.object(step, content.folder)),
                                    _where(steps.object(step, content.manifest)), save_id, step, job.attempt,
                                    job.metadata)
            sizes, manifest = store_staged(steps.object(step, MANIFEST_NAME), job.payload.segment, write, job.saver,
                                           job.progress)
            return Stored(manifest.content, manifest.record, sizes, sent=sum(sizes.values()))
        assert isinstance(job.payload, PyTreePayload)
        files = store_folder(context, job, content.folder, job.payload)
        return store_listing(context, job, content, files, FILES_KIND, save_id, PyTreePayload.kind, FILES_CODEC)

    def owns(self, name: str, committed: bool) -> bool:
        # A tree's folder is swept only from a folder no manifest commits: a committed step's is named by its
        # manifest, or was replaced by an overwrite, whose commit removed the files the old manifest named.
        return bool(_OWNED.fullmatch(name)) or (not committed and bool(_FOLDER.fullmatch(name)))


def _where(location: Location) -> tuple[str, Any, Any]:
    return location.uri, location.storage_options, location.retry


@dataclass(frozen=True)
class StagedTreeWrite:
    """The save process's part of a staged PyTree save (:mod:`._staged`): :meth:`run` writes the tree's files
    from the segment and their list, as :meth:`PyTreeKind.store` does, and returns their sizes and the manifest
    that commits them (written by the trainer, or by the save process for a trainer that died)."""

    skeleton: Encoded
    content: PyTreeFiles
    folder: tuple[str, Any, Any]
    listing: tuple[str, Any, Any]
    save_id: str
    step: int
    attempt: int | None
    metadata: dict[str, Any]

    def run(self, segment: Segment, progress: Progress) -> tuple[dict[str, int], StepManifest]:
        source = PyTreePayload(rebuilt(segment, self.skeleton))
        files = write_folder(Location(*self.folder), source, progress)
        del source  # no view of the segment is left (nor its temp folder, off local disk): it can be unmapped
        stored = write_listing(Location(*self.listing), self.content, files, FILES_KIND, self.save_id,
                               PyTreePayload.kind, FILES_CODEC, self.attempt, self.metadata)
        return dict(stored.objects), stored.manifest(self.step, self.attempt, self.metadata)


def lost_in_place(folder: Path) -> bool:
    """Whether ``folder`` is a tree's folder inside a step (what :meth:`PyTreeKind.restore_in_place` returns)
    that no longer holds every file its list names at its size: another process overwrote or deleted the step
    while it was read there. False for any other folder (a restore's copy, which nobody else changes)."""
    if not _FOLDER.fullmatch(folder.name):
        return False
    listing = folder.with_name(f"{folder.name}.files.json")
    try:
        listed = FileSetManifest.from_bytes(listing.read_bytes(), str(listing)).files
        return any((folder / rel).stat().st_size != entry.size for rel, entry in listed.items())
    except (OSError, ValueError, CheckpointCorruptError):
        return True


PYTREE = register_step_kind(PyTreeKind())
