"""The manifest of a file set: a folder of files saved together, each listed with its size and sha256.

A file larger than :data:`PIECE_SIZE` may be listed by the digest of each of its pieces instead (its ``sha256``
is then the sha256 of those digests, :func:`pieces_digest`): one digest of a large file is computed on one core,
in series, while its pieces hash on every core at once. Version 2 of the manifest lists pieces by sha256;
version 3 names the hash of each file's pieces (``piece_hash``), and taskpoint writes BLAKE3 (:data:`PIECE_HASH`):
a cryptographic hash like sha256, at 5.0 GB/s per core here against sha256's 1.15 GB/s, so that checking every
byte of a step before it is read costs a fifth of what it did (a PyTree's check, the state dict a load hands
``torch.load``). Each version is written only when needed, so that older taskpoints read what they can, and
refuse the rest as newer than they are rather than as damaged. Version 4 is version 3 for a DCP checkpoint
(:data:`PIECES_READ_SINCE`): it lists every one of its files by BLAKE3 pieces (a file under a piece, by one),
which DCP readers of version 3 would check as one sha256 of the whole file and call damaged.

A file set is committed by a file its writer's format names (``taskpoint.torch`` names PyTorch DCP's), written
after this manifest, which lists that commit file too: every byte a load reads is checked against
it. The manifest guards itself with ``check``, the sha256 of the rest of the document (as every manifest does,
:func:`~taskpoint.format.records.sealed`), so a flipped byte in the manifest reads as damage, never as a file
that seems damaged.
"""

from __future__ import annotations

import hashlib
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import blake3

from ..errors import CheckpointCorruptError
from .legacy import UNNAMED_PIECE_HASH
from .names import DCP_FILESET_KIND, FILESET_FORMAT
from .sealing import parse, sealed

#: Newest version of the file-set manifest this taskpoint reads; it writes 4 for a DCP set with a file listed by
#: pieces (:data:`PIECES_READ_SINCE`), 3 for another set with a file listed by pieces (each naming its hash), and 1
#: for whole files only, which every taskpoint reads. Version 2 (sha256 pieces, their hash unnamed) is only read.
FILESET_VERSION = 4
#: The first version whose readers of a set of this ``kind`` check a file listed by pieces: before version 4,
#: taskpoint's DCP reader checked every file whole by sha256.
PIECES_READ_SINCE = {DCP_FILESET_KIND: 4}
#: Bytes per hashed piece of a file listed by pieces (the last piece is shorter).
PIECE_SIZE = 16 << 20
#: The hashes pieces may be listed by, by the name a manifest gives (``piece_hash``; sha256 when it names none).
PIECE_HASHES: dict[str, Callable[[], Any]] = {"sha256": hashlib.sha256, "blake3": blake3.blake3}
#: The hash taskpoint lists new pieces by (see the module).
PIECE_HASH = "blake3"


def piece_hasher(name: str) -> Any:
    """A new hasher of the piece hash ``name`` (``update``, ``hexdigest``); ValueError for an unknown name."""
    make = PIECE_HASHES.get(name)
    if make is None:
        raise ValueError(f"pieces hashed by {name!r}, which this taskpoint does not know")
    return make()


def file_hasher(piece_hash: str | None) -> Any:
    """A new hasher of a piece by ``piece_hash``, or with None of a whole file (sha256)."""
    return hashlib.sha256() if piece_hash is None else piece_hasher(piece_hash)


def piece_hash_field(name: str) -> dict[str, str]:
    """The ``piece_hash`` field a document of pieces by ``name`` carries: none for :data:`UNNAMED_PIECE_HASH`."""
    return {} if name == UNNAMED_PIECE_HASH else {"piece_hash": name}


def read_piece_hash(doc: dict[str, Any]) -> str:
    """The hash a document's pieces are by, which it names (the older forms that name none reach here named by
    :mod:`.legacy`); ValueError for one this taskpoint does not know."""
    name = str(doc["piece_hash"])
    piece_hasher(name)
    return name


#: The prefix of the :data:`~taskpoint.digests.DIGESTS` name of a :class:`PieceHasher` by a piece hash
#: (``pieces:blake3``): its ``hexdigest`` is the ``sha256`` field of a file entry listed by pieces.
PIECES_DIGEST_PREFIX = "pieces:"


def pieces_digest(digests: list[str] | tuple[str, ...]) -> str:
    """The sha256 of a file's piece digests in order: one value that changes with any piece."""
    return hashlib.sha256(b"".join(bytes.fromhex(each) for each in digests)).hexdigest()


def piece_spans(size: int, piece_size: int = PIECE_SIZE) -> list[tuple[int, int]]:
    """(start, length) of each piece of a file of ``size`` bytes (one empty piece for an empty file)."""
    return [(start, min(piece_size, size - start)) for start in range(0, size, piece_size)] or [(0, 0)]


@dataclass(frozen=True)
class FileEntry:
    """One stored file of a set: its size in bytes and the sha256 (hex) of its bytes; or, with ``pieces``, the
    digest (by ``piece_hash``) of each ``piece_size`` piece of it, and as ``sha256`` the sha256 of those
    (:func:`pieces_digest`). A file-set manifest lists pieces of :data:`PIECE_SIZE` only; a state dict's step
    names its own size."""

    size: int
    sha256: str
    pieces: tuple[str, ...] = ()
    #: The hash of the pieces (:data:`PIECE_HASHES`); "" for a file listed whole.
    piece_hash: str = ""
    piece_size: int = PIECE_SIZE

    @classmethod
    def of_pieces(cls, size: int, pieces: list[str] | tuple[str, ...], piece_hash: str,
                  piece_size: int = PIECE_SIZE) -> FileEntry:
        return cls(size, pieces_digest(pieces), tuple(pieces), piece_hash, piece_size)

    @property
    def digest(self) -> str:
        """The :data:`~taskpoint.digests.DIGESTS` name whose ``hexdigest`` of the file's bytes is its ``sha256``."""
        return f"{PIECES_DIGEST_PREFIX}{self.piece_hash}" if self.pieces else UNNAMED_PIECE_HASH

    @property
    def checked_pieces(self) -> tuple[tuple[str, ...], int]:
        """The digests a reader checks the file by, and the bytes each covers: its pieces, or, for a file listed
        whole, its sha256 as one piece of the whole file (of at least one byte, so that offsets map to it)."""
        if self.pieces:
            return self.pieces, self.piece_size
        return (self.sha256,), max(1, self.size)

    @property
    def hash_name(self) -> str:
        """The hash its digests are of, for messages: its pieces' hash, or sha256."""
        return self.piece_hash or UNNAMED_PIECE_HASH

    def to_json(self) -> dict[str, Any]:
        if not self.pieces:
            return {"size": self.size, "sha256": self.sha256}
        return {"size": self.size, "sha256": self.sha256, "piece_size": self.piece_size,
                "piece_hash": self.piece_hash, "pieces": list(self.pieces)}

    @classmethod
    def from_json(cls, value: dict[str, Any]) -> FileEntry:
        size, sha256 = int(value["size"]), str(value["sha256"])
        if "pieces" not in value:
            return cls(size, sha256)
        piece_hash = read_piece_hash(value)
        pieces = tuple(str(each) for each in value["pieces"])
        if int(value["piece_size"]) != PIECE_SIZE or len(pieces) != len(piece_spans(size)):
            raise ValueError(f"a file of {size} bytes is listed by {len(pieces)} pieces of {value['piece_size']}")
        if pieces_digest(pieces) != sha256:
            raise ValueError("a file's piece digests do not match its sha256")
        return cls(size, sha256, pieces, piece_hash)


class PieceHasher:
    """The :class:`FileEntry` of bytes fed in order (a download, an upload, a save): by ``piece_size`` pieces
    hashed by ``piece_hash`` (:data:`PIECE_HASHES`), or with None one sha256 of them all. :meth:`spans` hands out
    the pieces' hashers with what each is to be fed, for a writer that feeds them on threads
    (:class:`taskpoint.pieces.PieceWriter`)."""

    def __init__(self, piece_hash: str | None, piece_size: int = PIECE_SIZE) -> None:
        self._piece_hash, self._size = piece_hash, 0
        self._piece_size = piece_size if piece_hash is not None else sys.maxsize  # a whole file: one endless piece
        #: One hasher per piece begun: an empty file is one piece, of no bytes.
        self._hashers = [file_hasher(piece_hash)]

    def spans(self, data: bytes | bytearray | memoryview) -> list[tuple[Any, memoryview]]:
        """Take ``data`` as the next bytes: each hasher it reaches with the stretch of it that hasher is to be fed
        (in order; one thread at a time per hasher)."""
        view, spans = memoryview(data).cast("B"), []
        while view.nbytes:
            index, within = divmod(self._size, self._piece_size)
            take = min(view.nbytes, self._piece_size - within)
            if index == len(self._hashers):
                self._hashers.append(file_hasher(self._piece_hash))
            spans.append((self._hashers[index], view[:take]))
            self._size += take
            view = view[take:]
        return spans

    def update(self, data: bytes | bytearray | memoryview) -> None:
        for hasher, span in self.spans(data):
            hasher.update(span)

    def hexdigest(self) -> str:
        """The ``sha256`` field of :meth:`entry`: one digest of what was fed, which changes with any piece."""
        return self.entry().sha256

    def entry(self) -> FileEntry:
        digests = [hasher.hexdigest() for hasher in self._hashers]
        if self._piece_hash is None:
            return FileEntry(self._size, digests[0])
        return FileEntry.of_pieces(self._size, digests, self._piece_hash, self._piece_size)


def entry_of(data: bytes | bytearray | memoryview, piece_hash: str | None = PIECE_HASH) -> FileEntry:
    """The entry of a file holding ``data``: by ``piece_hash`` pieces (None: one sha256 of it whole)."""
    hasher = PieceHasher(piece_hash)
    hasher.update(data)
    return hasher.entry()


@dataclass(frozen=True)
class FileSetManifest:
    """Every file of a saved set by name (relative, ``/``-separated), what wrote it, and who saved it.

    ``kind`` names the writer's format (``"torch.dcp"``); ``attempt`` and ``metadata`` are what a
    :class:`~taskpoint.CheckpointManager` step records (the task attempt, the user's JSON metadata).
    """

    kind: str
    save_id: str
    created: float
    files: dict[str, FileEntry]
    attempt: int | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_bytes(self) -> bytes:
        hashes = {e.piece_hash for e in self.files.values() if e.pieces}
        version = 1 if not hashes else max(3, PIECES_READ_SINCE.get(self.kind, 3))
        doc: dict[str, Any] = {
            "format": FILESET_FORMAT, "version": version, "kind": self.kind, "save_id": self.save_id,
            "created": self.created, "attempt": self.attempt, "metadata": self.metadata,
            "files": {name: e.to_json() for name, e in sorted(self.files.items())},
        }
        return sealed(doc)

    @classmethod
    def from_bytes(cls, data: bytes, uri: str) -> FileSetManifest:
        def build(doc: dict[str, Any], checked: bool) -> FileSetManifest:
            files = {str(name): FileEntry.from_json(e) for name, e in doc["files"].items()}
            attempt, metadata = doc.get("attempt"), doc.get("metadata", {})
            if not isinstance(metadata, dict):
                raise TypeError("metadata is not a JSON object")
            return cls(kind=str(doc["kind"]), save_id=str(doc["save_id"]), created=float(doc["created"]),
                       files=files, attempt=None if attempt is None else int(attempt), metadata=metadata)

        return parse(data, FILESET_FORMAT, uri, build, FILESET_VERSION,
                      "the checkpoint cannot be verified; save it again")

    def entry(self, name: str, where: str) -> FileEntry:
        """The entry of ``name``; CheckpointCorruptError when the manifest does not list it."""
        found = self.files.get(name)
        if found is None:
            raise CheckpointCorruptError(f"{where}/{name} is not listed in the checkpoint's manifest, so it cannot "
                                         "be verified: the checkpoint was changed after its save; save it again")
        return found
