"""Step kinds: what a step holds and how it is saved, restored, verified, listed and deleted, one module each.

A step's manifest stores its kind's name and that kind's own content (:class:`~taskpoint.format.records.
StepManifest`); the manager's commit, restore, retention and gc look the kind up here and call it, and know no
kind themselves. A kind stores the objects of a step and returns what it stored (:class:`Stored`); the manager
checks them and writes the manifest, last (:mod:`..step_commit`): a kind never writes one. Everything a kind
needs from the manager is in one module, :mod:`taskpoint.manager.kind_api`. The kinds of the core are
:mod:`.payload` (one payload object), :mod:`.chunked` (a deduplicated tree in the chunk store) and
:mod:`.sharded` (ranks around any kind); :mod:`.files` is the kind of file sets that the extras' ``jax.pytree``
(Orbax's files) and ``fileset`` (DCP's) are, registered by ``taskpoint.jax`` and ``taskpoint.torch``. Another package
adds a kind by registering an object that follows :class:`StepKind` with :func:`register_step_kind` when its
module is imported, and by naming that module in the entry-point group :data:`ENTRY_POINT_GROUP`, so that a
process reading such a step imports it (as payload kinds are found, :mod:`taskpoint.payloads`)::

    [project.entry-points."taskpoint.step_kinds"]
    notes = "my_package.kind"
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar, cast

from ... import _progress
from ..._progress import Progress
from ...errors import CheckpointCorruptError, CheckpointError
from ...format.codecs import Codec
from ...format.fileset import PIECES_DIGEST_PREFIX
from ...format.pieces import PAYLOAD_PIECES, pieces_damage, split_pieces
from ...format.records import ObjectRecord, StepContent, StepManifest
from ...payloads import Payload, payload_class
from ...transfer import hash_object, read_payload
from ..background import Handover
from ..dedup import Dedup
from ..rebuild import Rebuilder
from ..shards import RankPlan
from ..step_commit import Stored
from ..steps import StepObjects, StepStore

#: What removes an object a committed step names. taskpoint's own retention and sweeps never do: a save that a
#: sweep took for dead fails before (or takes back) its commit, and a sweep reads the manifests again after its
#: epoch. A taskpoint without those checks could, for a save stalled past the grace period.
GONE_HOW = (", which taskpoint's retention and sweeps never do: by hand, by a bucket lifecycle rule, or by a "
            "sweep of a taskpoint without these checks while the save was stalled")
#: Entry-point group of step kinds that other packages provide (name: the kind, value: the module to import).
ENTRY_POINT_GROUP = "taskpoint.step_kinds"


@dataclass(frozen=True)
class StepContext:
    """What the manager hands a step kind on every call: its step store (the objects of each step's folder), the
    payloads' codec and level, the grace period of leftovers, the ranks, and the chunk store's reads and saves."""

    steps: StepStore
    codec: Codec
    level: int | None
    grace: float
    plan: RankPlan
    #: Reads and checks the chunks of deduplicated steps (whether or not this manager deduplicates its saves).
    rebuilder: Rebuilder
    #: The chunk store's saves, when this manager deduplicates (``dedup=True``); else None.
    dedup: Dedup | None = None
    #: Told the step on every listing while rank 0 waits for the shards of a step (the preemption agreement);
    #: answers the ranks known gone.
    waiting: Callable[[int], set[int]] | None = None


@dataclass(frozen=True)
class SaveJob:
    """One save of ``payload`` as ``step``: what the kind stores, for the manager to commit."""

    step: int
    metadata: dict[str, Any]
    attempt: int | None
    #: A payload to store (the core's kinds), or the content of a step whose objects another writer stored.
    payload: Payload | StepContent
    saver: Handover | None
    progress: Progress
    #: What the kind holds from its store until the commit is over, entered on this stack (a deduplicated save's
    #: lease on the chunk store; rank 0's lease on the folder of a step of several ranks).
    until_committed: contextlib.ExitStack[bool | None]
    #: Nobody checked that ``step`` is not committed yet: the commit creates the manifest only where there is
    #: none (:func:`~taskpoint.manager.step_commit.commit`). Only for kinds that say so (:func:`commits_exclusively`).
    exclusive: bool = False


@dataclass(frozen=True)
class Checked:
    """A kind's verification of a step: the bytes of data it holds, and what matched (``4 shards, sha256
    matches its manifest``)."""

    size: int
    detail: str


@dataclass(frozen=True)
class Described:
    """What a kind adds to a step's description: the object that holds its payload (empty when none), its
    size when it differs from the commit record's, and its own fields (shards, files, chunks)."""

    payload: str
    details: dict[str, Any]


class StepKind(Protocol):
    """One kind of step. ``name`` is what manifests record; ``helper`` says whether its saves may upload from
    the manager's save process (False: they run in this process, as deduplicated saves do)."""

    name: str
    helper: bool

    def decode(self, body: dict[str, Any]) -> StepContent:
        """The content of this kind from its fields in a manifest; ValueError (TypeError, KeyError) when
        malformed: the manifest is then reported damaged."""
        ...

    def accepts(self, payload: Payload, context: StepContext) -> bool:
        """Whether :meth:`CheckpointManager.save <taskpoint.CheckpointManager.save>` saves ``payload`` as this
        kind (asked in the order kinds were given to the manager)."""
        ...

    def store(self, context: StepContext, job: SaveJob) -> Stored:
        """Store the payload's objects in the step's folder and say what was stored: the manager then checks
        them and commits the step with its manifest, written last (a kind never writes one)."""
        ...

    def restore(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                progress: Progress) -> Path:
        """Restore the step into ``workspace``, every byte verified; what a load returns. :class:`Gone` when
        an object it names is missing (the caller tells an overwrite from damage)."""
        ...

    def verify(self, context: StepContext, step: int, manifest: StepManifest, progress: object) -> Checked:
        """Read every byte the step holds against its checksum, keeping nothing (``progress``: the caller's
        ``progress=`` value). CheckpointCorruptError when damaged; FileNotFoundError when an object is missing."""
        ...

    def objects(self, steps: StepStore, step: int, manifest: StepManifest) -> StepObjects:
        """What the manifest names (objects of the step's folder, chunks of the chunk store)."""
        ...

    def delete(self, steps: StepStore, step: int, manifest: StepManifest) -> set[str]:
        """Remove what the step holds besides its manifest (removed already); the names it removed."""
        ...

    def describe(self, context: StepContext, step: int, manifest: StepManifest) -> Described:
        """The kind's part of the step's description (``taskpoint show``), read without the payload."""
        ...

    def owns(self, name: str, committed: bool) -> bool:
        """Whether ``name`` in a step folder is an object this kind's saves write: a sweep removes it once
        older than the grace period when no manifest names it (``committed``: the folder has a manifest)."""
        ...


class PartialKind(Protocol):
    """What a step kind adds to read part of a step (optional: a kind without these methods raises a clear error
    for ``restore(paths=...)`` and ``open()``). ``paths`` are normalized relative paths
    (:func:`~taskpoint.format.index.normalize_paths`); each read is verified before its bytes are used."""

    def restore_paths(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                      paths: Sequence[str], progress: Progress) -> Path:
        """Restore only ``paths`` of the step (folders with what lies below them) into ``workspace``; KeyError
        naming a path the step lacks; :class:`Gone` as :meth:`StepKind.restore`."""
        ...

    def open_file(self, context: StepContext, step: int, manifest: StepManifest, path: str) -> io.BufferedReader:
        """A read-only binary file of the step's file ``path``, read on demand; KeyError when there is none."""
        ...


class InPlaceKind(Protocol):
    """What a step kind adds to be read where it lies, without a copy (optional: a step of a kind without it is
    restored as :meth:`StepKind.restore` does). Only the manager's own reads use it, while they hold the step
    against retention and deletion; committed objects are never rewritten, so what was verified stays so."""

    def restore_in_place(self, context: StepContext, step: int, manifest: StepManifest, progress: Progress
                         ) -> Path | None:
        """The folder inside the step's own folder that holds what :meth:`StepKind.restore` would return, every
        byte verified there first (the same errors, :class:`Gone` included); None when the step cannot be read
        where it lies (not on local disk, say): the caller then restores a copy."""
        ...


def in_place_folder(kind: StepKind, context: StepContext, step: int, manifest: StepManifest, progress: Progress
                    ) -> Path | None:
    """The step's folder verified where it lies by ``kind`` (an :class:`InPlaceKind`), or None when ``kind``
    cannot read steps in place or this one not."""
    if not hasattr(kind, "restore_in_place"):
        return None
    return cast(InPlaceKind, kind).restore_in_place(context, step, manifest, progress)


def commits_exclusively(kind: StepKind) -> bool:
    """Whether the commit of ``kind``'s steps may be create-only (:attr:`SaveJob.exclusive`; optional: a kind
    says so with ``exclusive = True``; the manager reads the manifest before the save of any other kind)."""
    return getattr(kind, "exclusive", False) is True


def store(kind: StepKind, context: StepContext, job: SaveJob) -> Stored:
    """What ``kind`` stored of ``job`` (:meth:`StepKind.store`). CheckpointError for a kind written for taskpoints
    whose kinds committed their steps themselves (a ``save`` method and no ``store``): it reads, it cannot save."""
    if not hasattr(kind, "store"):
        raise CheckpointError(
            f"step kind {kind.name!r} cannot save with this taskpoint: it commits its steps itself (save()), and step "
            "kinds now store their objects and return what they stored (store()), which the manager commits. Its "
            "steps still load; upgrade the package that provides it")
    return kind.store(context, job)


def partial_kind(kind: StepKind) -> PartialKind:
    """``kind`` as a :class:`PartialKind`; CheckpointError when it cannot read part of a step."""
    if not (hasattr(kind, "restore_paths") and hasattr(kind, "open_file")):
        raise CheckpointError(f"steps of kind {kind.name!r} cannot be read in part (paths= or open()); restore the "
                              "whole step instead")
    return kind  # type: ignore[return-value]


class Gone(Exception):
    """An object a step names is missing while the step is restored; ``message`` is the error to raise when
    the manifest, read again, still commits the same save (damage, not an overwrite)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class StepKinds:
    """The registry of step kinds: by name, loading the package an entry point names when a manifest names a
    kind not registered yet."""

    def __init__(self) -> None:
        self._kinds: dict[str, StepKind] = {}

    def register(self, kind: StepKind) -> StepKind:
        """Add ``kind`` (replacing one of the same name: a module imported again)."""
        self._kinds[kind.name] = kind
        return kind

    def loaded(self) -> Iterable[StepKind]:
        """The kinds registered in this process."""
        return tuple(self._kinds.values())

    def kind(self, name: str, where: str) -> StepKind:
        """The kind ``name``, imported through its entry point when needed. CheckpointCorruptError naming it when
        no installed package provides it (the step at ``where`` cannot be read, listed as damaged)."""
        found = self._kinds.get(name)
        if found is None:
            from importlib.metadata import entry_points

            for point in entry_points(group=ENTRY_POINT_GROUP, name=name):
                try:
                    point.load()
                except ImportError as exc:
                    raise CheckpointCorruptError(
                        f"{where} is a step of kind {name!r}, whose module {point.value} cannot be imported ({exc}); "
                        "install what it needs") from exc
            found = self._kinds.get(name)
        if found is None:
            raise CheckpointCorruptError(
                f"{where} is a step of kind {name!r}, which no installed package provides (no step kind of that "
                f"name registered, none in the entry-point group {ENTRY_POINT_GROUP!r}); install the package that "
                "saved it, or upgrade taskpoint")
        return found


#: The process's step kinds: the core's register themselves when :mod:`taskpoint.manager` is imported.
KINDS = StepKinds()


def register_step_kind(kind: StepKind) -> StepKind:
    """Register ``kind`` (an object following :class:`StepKind`) under ``kind.name``; returns it."""
    return KINDS.register(kind)


def step_kind(name: str, where: str = "a step") -> StepKind:
    """The registered step kind ``name`` (see :meth:`StepKinds.kind`)."""
    return KINDS.kind(name, where)


C = TypeVar("C")


def content_of(manifest: StepManifest, content_class: type[C]) -> C:
    """The manifest's content as ``content_class``, the class its kind decodes (a kind is handed only the
    manifests that name it, so anything else is a bug)."""
    content = manifest.content
    assert isinstance(content, content_class)
    return content


def stored_part(context: StepContext, step: int, name: str, size: int | None, sha256: str | None, progress: object,
                label: str, digest: str = "sha256") -> int:
    """Hash the object ``name`` of ``step``'s folder and compare it with the ``size`` and ``sha256`` its
    manifest records (the hexdigest of ``digest``, a :data:`~taskpoint.digests.DIGESTS` name: a file-set's file
    listed by pieces names its piece hash); its size. CheckpointCorruptError when it differs, FileNotFoundError
    when it is missing."""

    steps = context.steps
    with _progress.resolve(progress, label) as tracker:
        try:
            found, hexdigest = hash_object(steps.object(step, name), digest, size, tracker)
        except FileNotFoundError:
            raise FileNotFoundError(f"its payload {name} is missing") from None
    if (found, hexdigest) != (size, sha256):
        by = digest.removeprefix(PIECES_DIGEST_PREFIX)
        subject = f"step {step} in {steps.directory}"
        raise CheckpointCorruptError(
            _by_pieces(subject, digest, sha256, hexdigest, found, size, name)
            or f"{subject} is damaged: read {found} bytes of {name} that do not match the {by} of its manifest "
               f"(recorded size {size})")
    return found


def _by_pieces(subject: str, digest: str, recorded: str | None, hexdigest: str, found: int, size: int | None,
               name: str) -> str | None:
    """:func:`~taskpoint.format.pieces.pieces_damage` of an object recorded by pieces (``digest``
    :data:`~taskpoint.format.pieces.PAYLOAD_PIECES`); None for another digest, or when every piece matches."""
    if digest != PAYLOAD_PIECES or recorded is None or size is None:
        return None
    return pieces_damage(subject, split_pieces(recorded), hexdigest, found, size, name)


def stored_object(context: StepContext, step: int, name: str, record: ObjectRecord, progress: object, label: str
                  ) -> int:
    """:func:`stored_part` of the payload object ``name``, against the size and digest (BLAKE3, or sha256 in
    older steps) its ``record`` holds."""
    hash_name, hexdigest = record.digest or (record.hash_name, None)
    return stored_part(context, step, name, record.size, hexdigest, progress, label, hash_name)


def read_object(context: StepContext, step: int, name: str, record: ObjectRecord, workspace: Path, progress: Progress,
                only: Sequence[str] | None = None) -> Path:
    """Restore the payload object ``name`` of ``step``'s folder into ``workspace``, checked against ``record``
    (kind, size, BLAKE3 or an older step's sha256) while it streams; ``only``: just these paths of a directory (the
    rest is streamed, verified and skipped). :class:`Gone` when the object is missing."""
    steps = context.steps
    src = steps.object(step, name)

    def verify(kind: str, size: int, digest: str) -> None:
        if (kind, size, (record.hash_name, digest)) != (record.kind, record.size, record.digest):
            recorded = record.digest[1] if record.digest is not None else None
            subject = f"step {step} in {steps.directory}"
            raise CheckpointCorruptError(
                (_by_pieces(subject, record.hash_name, recorded, digest, size, record.size, name)
                 or f"{subject} does not match the {record.hash_name} recorded when it was saved (read {size} bytes "
                    f"of {name}, expected {record.size}); it is damaged")
                + ". Restore an older step (fallback=True), or save it again.")

    gone = Gone(f"step {step} in {steps.directory} is committed but its payload {name} is missing: it was removed "
                f"after the commit{GONE_HOW}. Restore an older step (fallback=True), or delete this one.")
    try:
        result = read_payload(src, workspace, lambda head, size: payload_class(record.kind, src.uri), verify,
                              record.hash_name, size_hint=record.size, progress=progress, only=only, hashed=True)
    except FileNotFoundError:  # deleted under a streaming read (object stores)
        raise gone from None
    except CheckpointCorruptError as exc:
        if f"step {step} " in str(exc):
            raise
        raise type(exc)(f"step {step} in {steps.directory} is damaged: {exc}") from exc
    if result is None:
        raise gone
    return result
