"""The small record kept beside each checkpoint object: what kind it is and its checksum.

The checkpoint object itself stays in Flyte's format (raw bytes, or a tar.gz), so other tools can read it. The
record lives in a second object, ``<destination>.taskpoint.json``. Format 2 lists every object that may be visible
at the destination, newest first, each with kind, size and CRC32. A save computes the new object's digest while it
writes the object's temp file or parts, and writes the record listing the new object beside the previous ones
*before* the object becomes visible (the rename, the PUT, the multipart completion). So every object a reader can
see has a digest to check, whenever the saver is killed; a load accepts whichever listed object it finds, verified.
Format 1 (``committed`` and ``pending``) is still read, through its older reader (:mod:`.legacy`).

The versioned manager (:mod:`taskpoint.manager`) keeps a :class:`StepManifest` in each step's folder instead,
written once, after the payload: the step's commit. It records payload objects by BLAKE3 (:data:`PAYLOAD_HASH`).

Every document here guards itself: :func:`sealed` writes it with a ``check``, the digest of the rest of it
(canonical JSON), and :func:`~.sealing.parse` refuses one that fails it as damaged. Manifests (a step's, a rank's
record, a file set's, :mod:`.fileset`) use sha256: a step's manifest can reach megabytes and vouches for every other
byte. The record beside a checkpoint keeps CRC32 (a few kB: every burst of up to 32 bits is caught), a field it does
not know counted as damage. Step manifests and rank records written before they carried a check still read
(:mod:`.legacy`), marked unchecked (:attr:`StepManifest.checked`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, fields, replace
from typing import Any, ClassVar, Protocol

from .index import ArchiveIndex
from .legacy import PENDING
from .names import CHECKPOINT_FORMAT as FORMAT
from .names import SHARD_FORMAT, STEP_FORMAT
from .pieces import PAYLOAD_PIECES, pieces_json, read_pieces, split_pieces
from .sealing import CHECK, CRC32, parse, sealed

RECORD_SUFFIX = ".taskpoint.json"
#: The codec of a manager step whose files another writer stored (taskpoint.torch): its manifest names their
#: own file-set manifest (:mod:`taskpoint.format.fileset`) by size and sha256.
FILESET_CODEC = "fileset"
#: Newest version of the checkpoint record (format 1 is still read). Version 3 is version 2 whose entries may
#: carry an archive's index (:mod:`.index`); a record without one is still written as version 2, which older
#: taskpoints read, and one with an index asks them to upgrade rather than calling it damaged.
RECORD_VERSION = 3
#: The version of a record none of whose entries has an index.
RECORD_VERSION_UNINDEXED = 2
#: Newest version of a manager step's manifest this taskpoint reads. Version 1 names one payload object;
#: version 2 (written only for deduplicated steps) lists a tree of files and the chunks that hold them;
#: version 3 (written only for steps saved by several ranks) names one payload object per rank; version 4
#: names its step kind (:data:`STEP_KIND`) and holds that kind's content (:data:`CONTENT`); version 5 is version 4
#: whose content a version-4 reader would misread (a state dict's pieces hashed by BLAKE3, which it would check
#: as sha256 and call damaged), written only for such content (its ``manifest_version``), so that older
#: taskpoints ask to be upgraded instead; version 6 is version 4 recording a payload object (its own, or a
#: shard's) by BLAKE3 (:data:`BLAKE3_VERSION`), which readers of 1 to 5 would check as sha256, now written only for
#: a promoted copy of such a step (:mod:`.legacy`); version 7 is version 6 recording payload objects (its own, or
#: its shards') by the BLAKE3 of each of their pieces (:data:`PIECES_VERSION`).
FORMAT_VERSION = PIECES_VERSION = 7
BLAKE3_VERSION = 6
#: The hash the shards of multi-rank steps were recorded by until manifest version 7 (:attr:`ObjectRecord.blake3`;
#: a copy of such a shard still is): cryptographic as sha256
#: is, at 3.9 GB/s a core here against sha256's 1.15 GB/s, so that saves, restores and verifies hash at the speed of
#: the disk.
PAYLOAD_HASH = "blake3"
#: The version of a manifest that names its step kind, unless its content asks for a newer one.
KIND_VERSION = 4
#: The step kinds written in the layout of the version that introduced them, so that older taskpoints read them.
LEGACY_VERSIONS = {"payload": 1, "chunked": 2, "sharded": 3, FILESET_CODEC: 1}
#: The fields of a version-4 manifest that name its step kind and hold the kind's content.
STEP_KIND, CONTENT = "step_kind", "content"
#: Objects a record keeps besides the confirmed one: the newest few, in case saves failed after their
#: object may have become visible (a lost answer to the final PUT).
RECORD_KEEPS = 3
#: Entries younger than this (seconds) stay too, at most :data:`RECORD_RECENT_MAX` of them: with two writers at
#: one destination, one may list several saves while the other's object is still on its way (a slow PUT).
RECORD_RECENT_SECONDS = 60.0
RECORD_RECENT_MAX = 32


@dataclass(frozen=True)
class ObjectRecord:
    """One saved object: the payload kind, the archive codec ("raw" for bytes and files) and its digest."""

    kind: str
    codec: str
    save_id: str
    created: float
    size: int | None = None
    sha256: str | None = None
    #: CRC32 of the stored bytes (hex); single checkpoints record this instead of a sha256.
    crc32: str | None = None
    #: BLAKE3 of the stored bytes (hex): payload objects of manager steps record this instead of a sha256 (from
    #: manifest version 6, shard record version 2, on); absent from the document when None.
    blake3: str | None = None
    #: The BLAKE3 (hex) of each :data:`~.fileset.PIECE_SIZE` piece of the stored bytes, in order: a payload step's
    #: object records these instead of one digest (from manifest version 7, :data:`PIECES_VERSION`, on); absent
    #: from the document when empty.
    pieces: tuple[str, ...] = ()
    #: Where each entry of a directory archive lies (:mod:`.index`): partial restores read only their members.
    #: None for raw objects, codecs without independent members, and archives saved before indexes existed.
    index: ArchiveIndex | None = field(default=None, compare=False, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The record's fields as a document stores them (no ``index``, ``blake3`` or pieces when there are none;
        pieces as a file set lists them: ``piece_size``, ``piece_hash``, ``pieces``)."""
        doc = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in _OPTIONAL}
        if self.blake3 is not None:
            doc["blake3"] = self.blake3
        if self.pieces:
            doc.update(pieces_json(self.pieces))
        if self.index is not None:
            doc["index"] = self.index.to_json()
        return doc

    @property
    def digest(self) -> tuple[str, str] | None:
        """The stored bytes' digest a manifest records, as (hash, hex): BLAKE3 pieces, else BLAKE3, else sha256;
        None when none."""
        hexdigest = "".join(self.pieces) if self.pieces else self.blake3 if self.blake3 is not None else self.sha256
        return None if hexdigest is None else (self.hash_name, hexdigest)

    @property
    def hash_name(self) -> str:
        """The hash the stored bytes are recorded by (or read against): BLAKE3 pieces, BLAKE3 (shards, and payload
        steps of manifest version 6), or sha256 in older steps."""
        return PAYLOAD_PIECES if self.pieces else PAYLOAD_HASH if self.blake3 is not None else "sha256"

    def with_digest(self, size: int, hash_name: str, hexdigest: str) -> ObjectRecord:
        """This record of an object stored with ``size`` bytes whose ``hash_name`` digest is ``hexdigest``."""
        if hash_name == PAYLOAD_PIECES:
            return replace(self, size=size, pieces=split_pieces(hexdigest, size))
        by_blake3 = hash_name == PAYLOAD_HASH
        return replace(self, size=size, blake3=hexdigest) if by_blake3 else replace(self, size=size, sha256=hexdigest)


@dataclass(frozen=True)
class Record:
    """The record beside one checkpoint object: every object that may be visible there, newest first."""

    objects: tuple[ObjectRecord, ...] = ()
    #: The save id of the newest object known to have become visible (its save returned); always kept.
    confirmed: str | None = None
    #: A save may have left parts or temp files (a multipart upload began, or a save failed): the next save
    #: sweeps them.
    sweep: bool = False
    #: Format 1 only: a save that stopped before recording its digest (a checkpoint written by an older
    #: taskpoint); its object can only be checked by the archive's own checksums.
    unverified: ObjectRecord | None = None

    def to_bytes(self) -> bytes:
        version = RECORD_VERSION if any(o.index is not None for o in self.objects) else RECORD_VERSION_UNINDEXED
        doc: dict[str, Any] = {"format": FORMAT, "version": version,
                               "objects": [o.to_json() for o in self.objects], "confirmed": self.confirmed}
        if self.sweep:
            doc["sweep"] = True
        return sealed(doc, CRC32)

    def with_new(self, entry: ObjectRecord, *, sweep: bool) -> Record:
        """This record with ``entry`` first; older entries beyond :data:`RECORD_KEEPS` go unless they are recent
        (:data:`RECORD_RECENT_SECONDS`, at most :data:`RECORD_RECENT_MAX`), never the confirmed."""
        older = [o for o in self.objects if o.save_id != entry.save_id]
        kept = older[:RECORD_KEEPS - 1]
        recent = [o for o in older[RECORD_KEEPS - 1:] if entry.created - o.created < RECORD_RECENT_SECONDS]
        kept += recent[:RECORD_RECENT_MAX]
        kept += [o for o in older[RECORD_KEEPS - 1:] if o.save_id == self.confirmed and o not in kept]
        return Record(objects=(entry, *kept), confirmed=self.confirmed, sweep=sweep)

    def matching(self, kind: str, size: int, digest: str) -> ObjectRecord | None:
        """The listed object with this kind, size and digest (CRC32, or sha256 in old records), if any."""
        return next((o for o in self.objects
                     if (o.kind, o.size) == (kind, size) and digest in (o.crc32, o.sha256)), None)

    def of_size(self, size: int | None) -> ObjectRecord | None:
        """The newest listed object of ``size`` (of any size when None)."""
        return next((o for o in self.objects if size is None or o.size == size), None)

    @classmethod
    def from_bytes(cls, data: bytes, uri: str) -> Record:
        def build(doc: dict[str, Any], checked: bool) -> Record:
            # Unchecked: a version-1 record, as its older reader handed it on (:mod:`.legacy`), with its pending
            # entry.
            unknown = set(doc) - (_RECORD_KEYS if checked else _RECORD_KEYS | {PENDING})
            if unknown or int(doc["version"]) < 2:
                raise ValueError(f"unknown fields {sorted(unknown)} or version {doc['version']}")
            if any(e is not None and set(e) - _ENTRY_KEYS for e in doc["objects"]):
                raise ValueError("an entry has fields this taskpoint does not know")
            objects = tuple(_record(o) for o in doc["objects"])
            confirmed = doc.get("confirmed")
            return cls(objects=tuple(o for o in objects if o is not None),
                       confirmed=None if confirmed is None else str(confirmed), sweep=bool(doc.get("sweep", False)),
                       unverified=_record(doc.get(PENDING)))

        return parse(data, FORMAT, uri, build, RECORD_VERSION,
                      "delete it to load the checkpoint without verification, or save a new checkpoint", CRC32)


class StepContent(Protocol):
    """What one kind of step holds, as its manifest records it: the kind's own content (see
    :mod:`taskpoint.manager.kinds`). ``kind`` names the step kind that reads it back."""

    kind: ClassVar[str]

    def to_json(self) -> dict[str, Any]:
        """The content as JSON fields of the manifest."""
        ...


#: Decodes the content of a step kind from its JSON fields: given the kind's name, the function that builds it.
ContentDecoder = Callable[[str], Callable[[dict[str, Any]], StepContent]]


@dataclass(frozen=True)
class StepManifest:
    """The commit of one manager step: its kind and that kind's content, the commit's record (save id, time,
    payload kind, size), the task attempt and the user's metadata.

    The manifest stores ``kind`` plus the kind's own content. The kinds that shipped before kinds were named
    keep the layout of the format version that introduced them (:data:`LEGACY_VERSIONS`), so that older
    taskpoints still read what is written now; any other kind is written as version 4, its content under
    ``content`` (or as the newer version its content's ``manifest_version`` names, :data:`FORMAT_VERSION`). A
    manifest whose record holds a BLAKE3 digest is version 6 (:data:`BLAKE3_VERSION`), in version 4's layout,
    whatever its kind: a reader of versions 1 to 5 would check that digest as sha256 and call the step damaged.
    """

    step: int
    record: ObjectRecord
    #: The task attempt that saved it (from ``taskpoint.ctx()``), None outside a task.
    attempt: int | None
    metadata: dict[str, Any]
    content: StepContent
    #: Whether the manifest as read carried its check (False: written by a taskpoint before manifests carried
    #: one, so damage to the manifest itself cannot be told). Every manifest written now carries one.
    checked: bool = True

    @property
    def kind(self) -> str:
        """The step kind (``payload``, ``chunked``, ``sharded``, ``ranks``, or a plug-in's)."""
        return self.content.kind

    def to_bytes(self) -> bytes:
        header: dict[str, Any] = {"format": STEP_FORMAT, "step": self.step, **self.record.to_json(),
                                  "attempt": self.attempt, "metadata": self.metadata}
        by_digest = (PIECES_VERSION if self.record.pieces else BLAKE3_VERSION if self.record.blake3 is not None
                     else KIND_VERSION)
        needs = max(getattr(self.content, "manifest_version", KIND_VERSION), by_digest)
        version = LEGACY_VERSIONS.get(self.kind)
        if version is not None and needs == KIND_VERSION:
            return sealed({**header, "version": version, **self.content.to_json()})
        return sealed({**header, "version": needs, STEP_KIND: self.kind, CONTENT: self.content.to_json()})

    def same_save(self, other: StepManifest | None) -> bool:
        """Whether ``other`` (the step's manifest read again) is the commit of the same save as this one: not
        deleted, not overwritten since."""
        return other is not None and other.record.save_id == self.record.save_id

    @classmethod
    def from_bytes(cls, data: bytes, uri: str, contents: ContentDecoder) -> StepManifest:
        """The manifest in ``data``; ``contents`` gives the decoder of its kind (an unknown kind raises there)."""
        def build(doc: dict[str, Any], checked: bool) -> StepManifest:
            attempt, metadata, record = doc.get("attempt"), doc["metadata"], _record(doc)
            if not isinstance(metadata, dict) or record is None:
                raise TypeError("metadata is not a JSON object")
            kind, body = _kind_and_body(doc)
            return cls(step=int(doc["step"]), record=record, attempt=None if attempt is None else int(attempt),
                       metadata=metadata, content=contents(kind)(body), checked=checked)

        return parse(data, STEP_FORMAT, uri, build, FORMAT_VERSION,
                      "delete the step, or save it again with overwrite=True")


def _kind_and_body(doc: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The step kind a manifest names and its content: named in version 4; in versions 1 to 3 told by the
    version (and a version-1 manifest with codec :data:`FILESET_CODEC` is a file set), the content being the
    fields besides the common ones."""
    version = int(doc["version"])
    if version >= 4:
        body = doc[CONTENT]
        if not isinstance(body, dict):
            raise TypeError("the content is not a JSON object")
        return str(doc[STEP_KIND]), body
    kind = next(k for k, v in LEGACY_VERSIONS.items() if v == version and k != FILESET_CODEC)
    if version == 1 and doc.get("codec") == FILESET_CODEC:
        kind = FILESET_CODEC
    return kind, {k: v for k, v in doc.items() if k not in _HEADER_KEYS}


@dataclass(frozen=True)
class Shard:
    """One rank's part of a step: the payload object it stored and its record; or a part of another step kind."""

    rank: int
    payload: str
    record: ObjectRecord
    #: The step kind of a part that is not one payload object, and its content as that kind's manifest holds it.
    step_kind: str | None = None
    content: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        part = {} if self.step_kind is None else {STEP_KIND: self.step_kind, CONTENT: self.content}
        return {"rank": self.rank, "payload": self.payload, **self.record.to_json(), **part}

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Shard:
        record, kind, content = _record(doc), doc.get(STEP_KIND), doc.get(CONTENT)
        if record is None or record.size is None or (record.digest is None and kind is None):
            raise ValueError("a shard has no size or digest (sha256 or BLAKE3)")
        if kind is not None and not (isinstance(kind, str) and isinstance(content, dict)):
            raise ValueError("a part names no step kind and content")
        return cls(rank=int(doc["rank"]), payload=str(doc["payload"]), record=record, step_kind=kind, content=content)


@dataclass(frozen=True)
class ShardRecord:
    """What rank ``shard.rank`` writes beside its shard of ``step``: rank 0 commits the step once it holds one
    of these from every rank of ``world_size`` with its own ``round`` (the launch of the job that saves)."""

    step: int
    world_size: int
    round: str
    shard: Shard

    def to_bytes(self) -> bytes:
        record = self.shard.record
        version = SHARD_VERSION if record.pieces else BLAKE3_SHARD_VERSION if record.blake3 is not None else 1
        doc = {"format": SHARD_FORMAT, "version": version, "step": self.step, "world_size": self.world_size,
               "round": self.round, "shard": self.shard.to_json()}
        return sealed(doc)

    @classmethod
    def from_bytes(cls, data: bytes, uri: str) -> ShardRecord:
        def build(doc: dict[str, Any], checked: bool) -> ShardRecord:
            return cls(step=int(doc["step"]), world_size=int(doc["world_size"]), round=str(doc["round"]),
                       shard=Shard.from_json(doc["shard"]))

        return parse(data, SHARD_FORMAT, uri, build, SHARD_VERSION,
                      "it is removed by gc() once older than the grace period")


#: Newest version of a rank's record of its shard: 3 records it by BLAKE3 pieces (every shard saved now, and a
#: rank's payload step of a local tier, promoted), 2 by one BLAKE3 (only a copy of such an older shard; a shard by
#: sha256 is written as 1).
SHARD_VERSION = 3
BLAKE3_SHARD_VERSION = 2


#: The fields of a checkpoint's record (versions 2 and 3); any other is damage.
_RECORD_KEYS = frozenset({"format", "version", "objects", "confirmed", "sweep", CHECK})
#: Fields written only when set. A checkpoint's record holds neither BLAKE3 nor pieces: there, either is damage.
_OPTIONAL = frozenset({"index", "blake3", "pieces"})
_ENTRY_KEYS = frozenset(f.name for f in fields(ObjectRecord)) - {"blake3", "pieces"}
#: The fields every step's manifest has; in versions 1 to 3 the others are its kind's content.
_HEADER_KEYS = frozenset({"format", "version", "step", "attempt", "metadata", CHECK,
                          *(f.name for f in fields(ObjectRecord))})


def _record(value: Any) -> ObjectRecord | None:
    if value is None:
        return None
    index, size = value.get("index"), value.get("size")
    pieces = read_pieces(value, size) if "pieces" in value else ()
    return ObjectRecord(kind=str(value["kind"]), codec=str(value["codec"]), save_id=str(value["save_id"]),
                        created=float(value["created"]), size=size, sha256=value.get("sha256"),
                        crc32=value.get("crc32"), blake3=value.get("blake3"), pieces=pieces,
                        index=None if index is None else ArchiveIndex.from_json(index))
