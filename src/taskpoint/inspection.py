"""Looking at checkpoint objects without loading them: :func:`checkpoints_in` (those in a folder),
:func:`describe_object` (what its record says, and whether the stored object is one it lists) and
:func:`verify_object` (every byte against the record's checksum),
behind :meth:`Checkpoint.describe <taskpoint.Checkpoint.describe>` and :meth:`Checkpoint.verify
<taskpoint.Checkpoint.verify>`."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import _log, _progress
from .errors import CheckpointCorruptError
from .format.conformance import document_problem
from .format.records import RECORD_SUFFIX
from .record import listed, load_object, read_record
from .storage import Deadline, Location, normalize_uri
from .storage.deadline import bounded
from .transfer import hash_object


@dataclass(frozen=True)
class CheckpointVerification:
    """A checkpoint object, verified: ``healthy`` (``digest``, CRC32 or sha256, matched an object its record
    lists) or ``readable`` (no record: it loaded with the archive's own checks, ``digest`` None)."""

    uri: str
    state: str
    size: int | None
    digest: str | None


@dataclass(frozen=True)
class CheckpointDescription:
    """A checkpoint object and its record: ``state`` is ``saved`` (the stored object is one the record lists),
    ``damaged`` (it is none of them), ``missing`` (recorded, not stored) or ``unrecorded`` (no record).
    ``objects`` are the record's entries, newest first, each with ``current`` (the stored object, which a load
    reads), ``confirmed`` (the record's own bookkeeping) and ``size_matches``."""

    uri: str
    state: str
    size: int | None
    kind: str | None
    created: float | None
    objects: tuple[dict[str, Any], ...]
    record: str | None


def checkpoints_in(folder: str | os.PathLike[str], *, storage_options: dict[str, Any] | None = None) -> list[str]:
    """The checkpoint objects directly in ``folder`` (any fsspec URL), sorted by name: each object with its record
    beside it (``<name>.taskpoint.json``), as every taskpoint save leaves one, the ``.ckpt`` files of
    :class:`taskpoint.lightning.CheckpointIO` among them. ``[]`` when there is none (or no such folder).

    Each URI is one :class:`~taskpoint.Checkpoint` loads, describes and verifies
    (``taskpoint ls`` and ``taskpoint verify`` of a folder list and check them)."""
    loc = Location(normalize_uri(folder, "folder").rstrip("/"), storage_options)
    names = sorted(name[:-len(RECORD_SUFFIX)] for name in loc.list_names()
                   if name.endswith(RECORD_SUFFIX) and len(name) > len(RECORD_SUFFIX))
    return [loc.child(name).uri for name in names]


def object_size(loc: Location) -> int | None:
    """The size of the object at ``loc``; None when there is none (or it is a folder)."""

    def info(deadline: Deadline) -> int | None:
        try:
            found = loc.fs.info(loc.path, **bounded(loc.fs, deadline))
        except (FileNotFoundError, NotADirectoryError):
            return None
        return None if found.get("type") == "directory" else int(found.get("size") or 0)

    return loc.run(info, action="check")


def describe_object(loc: Location) -> CheckpointDescription:
    """The checkpoint object at ``loc`` and its record (``<uri>.taskpoint.json``); FileNotFoundError when
    neither is there."""
    record = read_record(loc.sibling(RECORD_SUFFIX))
    size = object_size(loc)
    if record is None and size is None:
        raise FileNotFoundError(f"nothing taskpoint saved is at {loc.uri}")
    # The entry a load verifies the object against: the newest listed one of the stored size.
    visible = record.of_size(size) if record is not None and size is not None else None
    confirmed = record.confirmed if record is not None else None
    objects = tuple({**listed(entry), "current": visible is not None and entry.save_id == visible.save_id,
                     "confirmed": entry.save_id == confirmed, "size_matches": entry.size == size}
                    for entry in (record.objects if record is not None else ()))
    state = ("unrecorded" if record is None else "missing" if size is None else "damaged" if visible is None
             else "saved")
    kind = visible.kind if visible else (objects[0]["kind"] if objects else None)
    return CheckpointDescription(
        uri=loc.uri, state=state, size=size, kind=kind, created=visible.created if visible else None, objects=objects,
        record=None if record is None else loc.sibling(RECORD_SUFFIX).uri)


def verify_object(loc: Location, progress: object = None) -> CheckpointVerification:
    """Read every byte of the checkpoint object at ``loc`` against its record, keeping nothing. An object with
    no record is loaded into a temporary folder (the archive's own checks). CheckpointCorruptError when damaged
    or recorded but missing; FileNotFoundError when nothing is there."""
    record_loc = loc.sibling(RECORD_SUFFIX)
    record = read_record(record_loc)
    problem = None if record is None else document_problem(record_loc.uri, record_loc.read_small())
    if problem is not None:
        raise CheckpointCorruptError(f"{loc.uri} is damaged: {problem}")
    label = f"verify {_log.short_name(loc.uri)}"
    if record is None or not record.objects:
        if object_size(loc) is None:
            raise FileNotFoundError(f"nothing taskpoint saved is at {loc.uri}")
        scratch = Path(tempfile.mkdtemp(prefix="taskpoint-verify-"))
        try:
            with _progress.resolve(progress, label) as tracker:
                load_object(loc, scratch, tracker)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return CheckpointVerification(loc.uri, "readable", None, None)
    newest = record.of_size(None)
    assert newest is not None
    digest = "sha256" if newest.crc32 is None and newest.sha256 else "crc32"
    with _progress.resolve(progress, label) as tracker:
        try:
            size, hexdigest = hash_object(loc, digest, newest.size, tracker)
        except FileNotFoundError:
            raise CheckpointCorruptError(f"{loc.uri} is recorded as saved but its object is missing") from None
    if not any(record.matching(kind, size, hexdigest) is not None for kind in {o.kind for o in record.objects}):
        sizes = ", ".join(str(o.size) for o in record.objects)
        raise CheckpointCorruptError(f"{loc.uri} is damaged: {size} bytes that match no checksum its record lists "
                                     f"(recorded sizes {sizes})")
    return CheckpointVerification(loc.uri, "healthy", size, digest)
