"""The chunk store of deduplicated steps, shared by every step of one manager directory, and the tree of
files a payload is cut into (:func:`source_tree`).

Layout under the manager's directory::

    chunks/{key[:2]}/{key}     one chunk: ``key`` is ``<sha256 of its plain bytes>.<codec>``, the object
                               its bytes compressed alone with that codec (``zst``, ``gz`` or ``raw``)
    leases/save-{id}           a save in flight (written before it relies on any chunk, renewed while it runs,
                               removed after its commit); while fresh, no sweep removes a chunk
    leases/gc-{id}             a sweep in flight, renewed every few seconds (its heartbeat); saves that start
                               meanwhile wait for it to finish, or for its heartbeat to stop
    leases/epoch               rewritten by every sweep before it removes a chunk: a save that sees it change
                               between its start and its commit fails (a sweep judged its lease stale), and a
                               manager that sees it change lists the store again

A lease's body records its writer's grace: a lease is fresh while younger than the longer of that grace and
the grace of whoever judges it, so that ``gc --grace 1`` never takes a live lease of a save with a grace of
15 minutes for a dead one.

A chunk is written atomically, once, under the name of its content: two writers of the same chunk write the
same bytes, and a chunk object is complete or absent. The codec is part of the name, so a chunk compressed
differently is another object and every reader knows how to inflate what it reads.
"""

from __future__ import annotations

import contextlib
import hashlib
import re
import stat
import uuid
from pathlib import Path

from ..errors import CheckpointCorruptError
from ..format.archive import walk_source
from ..format.codecs import Codec, get_codec
from ..format.documents import EPOCH_FORMAT, small_document
from ..format.tree import TreeEntry
from ..payloads import RAW_RESULT_NAME, BytesPayload, DirectoryPayload, FilePayload, Payload
from ..storage import Deadline, Location
from ..storage.backends import modified_time
from ..storage.streams import VersionConflict
from .leases import alive, lease_body

CHUNK_FOLDER = "chunks"
LEASE_FOLDER = "leases"
EPOCH_NAME = "epoch"
#: The codecs a chunk may be stored with, by the name its key ends in.
CHUNK_CODECS = {"zstd": "zst", "gzip": "gz", "none": "raw"}
CHUNK_KEY = re.compile(r"([0-9a-f]{64})\.(zst|gz|raw)")
LEASE_NAME = re.compile(r"(save|gc)-[0-9a-f]{32}")
#: The temp file of an atomic write of a chunk or lease on local disk, left by a killed writer.
TEMP_NAME = re.compile(r"\.(?:[0-9a-f]{64}\.(?:zst|gz|raw)|(?:save|gc)-[0-9a-f]{32}|epoch)\.[0-9a-f]{12}\.tmp")


#: The codec of each chunk name's extension: chunks are read with the codec they were written with.
_CODEC_OF_EXT: dict[str, Codec] = {ext: get_codec(name) for name, ext in CHUNK_CODECS.items()}


class ChunkStore:
    """The chunks of one directory: naming, compressing, storing, fetching with verification, leases."""

    def __init__(self, root: Location, codec: str, level: int | None) -> None:
        if codec not in CHUNK_CODECS:
            raise ValueError(f"codec must be one of {sorted(CHUNK_CODECS)} for deduplicated steps, got {codec!r}")
        self.root = root
        self.ext = CHUNK_CODECS[codec]
        self.codec = get_codec(codec)
        self.level = level
        #: Chunk keys known to be stored (None until listed once); valid while :attr:`epoch` is unchanged.
        self.known: set[str] | None = None
        self.epoch: bytes | None = None

    # -- chunks --------------------------------------------------------------------------------------------

    def location(self, key: str) -> Location:
        return self.root.child(f"{CHUNK_FOLDER}/{key[:2]}/{key}")

    def uri(self, key: str) -> str:
        return self.location(key).uri

    def key_of(self, data: bytes | memoryview) -> str:
        return f"{hashlib.sha256(data).hexdigest()}.{self.ext}"

    def compress(self, data: bytes | memoryview) -> bytes:
        return self.codec.compress(data, self.level)

    def put(self, key: str, blob: bytes) -> None:
        """Store one chunk atomically (with retries)."""
        location = self.location(key)

        def write(deadline: Deadline) -> None:
            with location.open_write(size_hint=len(blob), deadline=deadline) as f:
                f.write(blob)

        location.run(write, action="save a chunk to", writing=True)

    def get(self, key: str, size: int) -> bytes:
        """The plain bytes of chunk ``key``, which must be ``size`` long and hash to its name.

        FileNotFoundError when it is not stored; CheckpointCorruptError when it does not inflate or match.
        """
        match = CHUNK_KEY.fullmatch(key)
        if match is None:
            raise CheckpointCorruptError(f"{key!r} is not a chunk name")
        blob = self.location(key).read_small()
        if blob is None:
            raise FileNotFoundError(self.uri(key))
        try:
            data = _CODEC_OF_EXT[match.group(2)].decompress(blob, size)
        except Exception as exc:
            raise CheckpointCorruptError(f"chunk {self.uri(key)} does not inflate ({exc})") from exc
        if len(data) != size or hashlib.sha256(data).hexdigest() != match.group(1):
            raise CheckpointCorruptError(f"chunk {self.uri(key)} does not match its sha256 (read {len(data)} "
                                         f"bytes, expected {size})")
        return bytes(data)

    def listing(self) -> dict[str, float | None]:
        """Every stored chunk with its modification time (one recursive listing of ``chunks/``)."""
        return self._names(CHUNK_FOLDER, CHUNK_KEY)

    def temp_files(self) -> dict[str, float | None]:
        """Temp files of chunk and lease writes that killed writers left (local disk), relative to the
        directory, with their modification times."""
        found = self._names(CHUNK_FOLDER, TEMP_NAME, relative=True)
        found.update(self._names(LEASE_FOLDER, TEMP_NAME, relative=True))
        return found

    def _names(self, folder: str, pattern: re.Pattern[str], *, relative: bool = False) -> dict[str, float | None]:
        base = self.root.child(folder)
        found = base.list_tree()
        out: dict[str, float | None] = {}
        for path, info in found.items():
            name = path.rstrip("/").rpartition("/")[2]
            if info.get("type") != "directory" and pattern.fullmatch(name):
                key = path[len(self.root.path.rstrip("/")) + 1:] if relative else name
                out[key] = modified_time(info)
        return out

    # -- leases and the epoch ------------------------------------------------------------------------------

    def new_lease(self, kind: str, grace: float, beat: float | None = None) -> str:
        name = f"{kind}-{uuid.uuid4().hex}"
        self.write_lease(name, grace, beat)
        return name

    def write_lease(self, name: str, grace: float, beat: float | None = None) -> None:
        """Write (or renew) lease ``name``, recording its writer's grace and heartbeat period (see
        :mod:`.leases`)."""
        self.root.child(f"{LEASE_FOLDER}/{name}").write_small(lease_body(grace, beat), action="write a lease at")

    def read_lease(self, name: str) -> bytes | None:
        """The body of lease ``name`` (None once it is gone)."""
        return self.root.child(f"{LEASE_FOLDER}/{name}").read_small()

    def alive(self, name: str, mtime: float | None, now: float, grace: float) -> bool:
        """Whether lease ``name``, written at ``mtime``, is fresh for a judge of ``grace`` (:func:`.leases.alive`)."""
        return alive(mtime, now, grace, self.root.child(f"{LEASE_FOLDER}/{name}").read_small)

    def remove_lease(self, name: str) -> None:
        self.root.child(f"{LEASE_FOLDER}/{name}").remove()

    def leases(self) -> dict[str, float | None]:
        """The leases present, with their modification times."""
        return self._names(LEASE_FOLDER, LEASE_NAME)

    def read_epoch(self) -> bytes | None:
        return self.root.child(f"{LEASE_FOLDER}/{EPOCH_NAME}").read_small()

    def bump_epoch(self) -> None:
        self.root.child(f"{LEASE_FOLDER}/{EPOCH_NAME}").write_small(new_epoch(), action="write the chunk epoch at")

    def fence_epoch(self) -> None:
        """Rewrite the epoch as a fence against a sweep taken for dead (which stops removing once it sees the
        epoch it wrote change): conditional on the epoch read here where the store has conditional writes, and
        a conflict means another writer moved it already, which fences as well."""
        epoch = self.root.child(f"{LEASE_FOLDER}/{EPOCH_NAME}")
        _, version = epoch.read_versioned()
        with contextlib.suppress(VersionConflict):
            epoch.write_versioned(new_epoch(), version, action="write the chunk epoch at")


def new_epoch() -> bytes:
    """A fresh chunk epoch: a :data:`~taskpoint.format.documents.EPOCH_FORMAT` document naming a new ``uuid4``. Its
    readers compare it whole with the one they read before (an older taskpoint's 32 hex digits of ASCII too), so
    it is never parsed: any change is a new epoch."""
    return small_document(EPOCH_FORMAT, {"epoch": uuid.uuid4().hex}, sort_keys=True)


def source_tree(payload: Payload) -> tuple[list[TreeEntry], dict[str, Path], memoryview | None]:
    """The entries of ``payload`` (sizes and modes, no chunks yet), where each file's bytes are, and the
    bytes of a bytes payload."""
    if isinstance(payload, FilePayload):
        path = payload.local_file()
        return [TreeEntry(RAW_RESULT_NAME, "file", size=path.stat().st_size)], {RAW_RESULT_NAME: path}, None
    if isinstance(payload, BytesPayload):
        view = payload._view
        return [TreeEntry(RAW_RESULT_NAME, "file", size=view.nbytes)], {}, view
    assert isinstance(payload, DirectoryPayload)
    entries: list[TreeEntry] = []
    files: dict[str, Path] = {}
    for entry in walk_source(payload._path):
        st, rel = entry.stat, entry.relative
        if entry.target is not None:
            entries.append(TreeEntry(rel, "link", target=entry.target))
        elif stat.S_ISDIR(st.st_mode):
            entries.append(TreeEntry(rel, "dir", mode=stat.S_IMODE(st.st_mode) & 0o777, mtime=st.st_mtime))
        else:
            entries.append(TreeEntry(rel, "file", mode=stat.S_IMODE(st.st_mode) & 0o777, size=st.st_size,
                                     mtime=st.st_mtime))
            files[rel] = Path(entry.path)
    return entries, files, None
