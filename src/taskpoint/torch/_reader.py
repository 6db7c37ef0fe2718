"""Reader: DCP's ``StorageReader`` on taskpoint's storage layer; every byte it reads is verified first.

``read_metadata`` reads the commit (``.metadata``) and taskpoint's manifest and checks the one against the
other; ``read_data`` reads each item from its file as DCP's own ``FileSystemReader`` does, through a reader that
checks the file's pieces against the manifest on other threads ahead of the reads and returns no byte before its
piece matched (:class:`~taskpoint.pieces.PieceReader`): the check runs beside the load rather than before
it. A load of some of the items checks the pieces they lie in; a full load, every piece. DCP swallows what
``read_metadata`` raises (it then looks for per-rank metadata and reports "metadata is None"), so the Reader keeps
that error and raises it from ``set_up_storage_reader``, the next call DCP makes.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import uuid
from collections.abc import Iterator
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import CheckpointCorruptError, StorageNotFound
from ..format.fileset import FileEntry, FileSetManifest, entry_of
from ..format.pieces import entry_damage
from ..manager import CheckpointManager
from ..manager.kind_api import step_folder
from ..pieces import PieceReader
from ..storage import Location, RetryPolicy
from ._layout import (
    DEFAULT_THREADS,
    MANIFEST_KIND,
    MANIFEST_NAME,
    METADATA_NAME,
    Rooted,
    check_threads,
    root_location,
)


class Reader(Rooted, StorageReader):
    """Loads a DCP checkpoint saved by :class:`~taskpoint.torch.Writer`: ``dcp.load(state, storage_reader=
    Reader(uri, storage_options=...))``, on any number of ranks (DCP reshards).

    A file whose bytes differ from the manifest (truncated, a flipped byte) raises
    :class:`~taskpoint.errors.CheckpointCorruptError` naming it, and so does a listed file that is missing;
    a URI without ``.metadata`` (never saved, or its save did not finish) raises FileNotFoundError. DCP hands
    these to the caller inside its ``CheckpointException`` (``exc.failures[rank][0]``).

    Args:
        uri: the checkpoint's folder or prefix, as given to the Writer.
        storage_options: passed to fsspec (credentials, endpoint).
        threads: files read at once: their pieces checked (local disk) or fetched and checked (elsewhere, each file
            whole in memory until its items are loaded) ahead of the one whose items load.
        retry: how transient storage failures are retried.
    """

    def __init__(self, uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
                 threads: int = DEFAULT_THREADS, retry: RetryPolicy | None = None) -> None:
        super().__init__()
        self._options = storage_options
        self._retry = retry
        self._root: Location = root_location(uri, storage_options, retry)
        self.threads = check_threads(threads)
        self.load_id = uuid.uuid4().hex
        self._manifest: FileSetManifest | None = None
        self._storage: dict[MetadataIndex, Any] = {}
        self._failure: BaseException | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._reroot(checkpoint_id)
        self.load_id = uuid.uuid4().hex
        self._manifest, self._storage, self._failure = None, {}, None

    # -- the commit ----------------------------------------------------------------------------------------

    @classmethod
    def for_step(cls, manager: CheckpointManager, step: int | None = None, *, threads: int = DEFAULT_THREADS) -> Reader:
        """A reader of ``step`` of ``manager`` (the newest when None) saved with ``Writer.for_step``: a step the
        manager lists is committed, and its files are verified as any Reader verifies them. With a local tier it
        reads the local copy when a restore would (the committed step's), else the remote one."""
        chosen = manager.latest_step() if step is None else step
        if chosen is None:
            raise FileNotFoundError(f"there is no committed step in {manager.directory}")
        folder = step_folder(manager, chosen, reading=True)
        return cls(folder.uri, folder.storage_options, threads=threads, retry=folder.retry)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The checkpoint's metadata, verified against the manifest. Never raises (see the module): a failure
        returns empty metadata and is raised by :meth:`set_up_storage_reader`."""
        try:
            return self._read_commit()
        except Exception as exc:
            self._failure = exc
            return Metadata(state_dict_metadata={})

    def _read_commit(self) -> Metadata:
        self._failure = None
        commit = self._root.child(METADATA_NAME)
        blob = commit.read_small()
        if blob is None:
            if self._root.container_missing():
                raise StorageNotFound(f"could not read {self._root.uri}: the bucket or container does not exist")
            raise FileNotFoundError(f"there is no committed checkpoint at {self._root.uri} (no {METADATA_NAME}: "
                                    "never saved there, or its save did not finish)")
        found = self._root.child(MANIFEST_NAME).read_small()
        if found is None:
            raise CheckpointCorruptError(
                f"{commit.uri} has no taskpoint manifest ({MANIFEST_NAME}) beside it, so nothing in it can be "
                "verified: it was not saved by taskpoint.torch.Writer, or the manifest was deleted")
        manifest = FileSetManifest.from_bytes(found, self._root.uri + "/" + MANIFEST_NAME)
        if manifest.kind != MANIFEST_KIND:
            raise CheckpointCorruptError(f"{self._root.uri}/{MANIFEST_NAME} describes a {manifest.kind!r}, not a "
                                         "DCP checkpoint")
        _verify(commit.uri, blob, manifest.entry(METADATA_NAME, self._root.uri))
        try:
            metadata = pickle.loads(blob)
        except Exception as exc:
            raise CheckpointCorruptError(f"{commit.uri} matches its manifest but cannot be read ({exc}); "
                                         "it was written by a newer or different torch") from exc
        if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
            raise CheckpointCorruptError(f"{commit.uri} holds no DCP metadata with storage data")
        for info in metadata.storage_data.values():
            manifest.entry(_relative_path(info, commit.uri), self._root.uri)  # every data file is listed
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        self._manifest = manifest
        return metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._raise_failure()
        self._storage = dict(metadata.storage_data or {})

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure
        if self._manifest is None:
            raise RuntimeError("taskpoint.torch.Reader: read_metadata was not called before the load")

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    # -- the data ------------------------------------------------------------------------------------------

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Load this rank's items, file by file and by offset in each, as DCP's ``FileSystemReader`` does, through
        a :class:`~taskpoint.pieces.PieceReader` of each file: the pieces the items lie in are checked on
        other threads ahead of the reads, and no byte reaches ``torch.load`` (or the planner) before its piece
        matches the manifest. Up to :attr:`threads` files are open at once (checked, or fetched, ahead); files
        loaded before a damaged one keep what they loaded."""
        self._raise_failure()
        per_file: dict[str, list[ReadItem]] = collections.defaultdict(list)
        for item in plan.items:
            per_file[_relative_path(self._storage[item.storage_index], self._root.uri)].append(item)
        for items in per_file.values():
            items.sort(key=lambda item: self._storage[item.storage_index].offset)
        for name, reader in self._open_ahead(per_file):
            with reader:
                for item in per_file[name]:
                    self._load_item(item, reader, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _open_ahead(self, per_file: dict[str, list[ReadItem]]) -> Iterator[tuple[str, PieceReader]]:
        """A reader of each file, in order, with the next ones (:attr:`threads` in all) opened ahead, so that
        their pieces are checked or fetched while the items of the one before load; every one closed at the end."""
        names = collections.deque(per_file)
        opened: collections.deque[tuple[str, PieceReader]] = collections.deque()
        try:
            while names or opened:
                while names and len(opened) < self.threads:
                    name = names.popleft()
                    opened.append((name, self._open(name, per_file[name])))
                yield opened.popleft()
        finally:
            for _, reader in opened:
                reader.close()

    def _open(self, name: str, items: list[ReadItem]) -> PieceReader:
        """A reader of the data file ``name`` that checks ahead the pieces ``items`` (by offset) lie in. A file
        listed whole (a manifest of version 3 or older) is one piece, checked by its sha256."""
        assert self._manifest is not None
        entry = self._manifest.entry(name, self._root.uri)
        location = self._root.child(name)
        digests, piece_size = entry.checked_pieces  # a file listed whole: one piece
        pieces = len(digests)
        spans = [(info.offset, info.length) for info in (self._storage[item.storage_index] for item in items)]
        order = sorted({index for start, length in spans
                        for index in range(start // piece_size, (start + max(length, 1) - 1) // piece_size + 1)
                        if index < pieces})

        def damaged(index: int) -> CheckpointCorruptError:
            return CheckpointCorruptError(entry_damage(location.uri, entry, index))

        def missing() -> CheckpointCorruptError:
            return CheckpointCorruptError(f"{location.uri} is missing: the checkpoint's manifest lists it "
                                          f"({entry.size} bytes), but it is not in storage")

        if location.is_local:
            try:
                fd = os.open(location.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                raise missing() from None
            return PieceReader(entry, damaged, fd=fd, name=location.path, order=order)

        def fetch(start: int, length: int) -> bytes:
            try:
                return location.read_range(start, length)
            except FileNotFoundError:
                raise missing() from None

        return PieceReader(entry, damaged, fetch=fetch, order=order)

    def _load_item(self, item: ReadItem, reader: PieceReader, planner: LoadPlanner) -> None:
        info = self._storage[item.storage_index]
        if getattr(info, "transform_descriptors", None):
            raise CheckpointCorruptError(f"{self._root.uri}: item {item.storage_index.fqn} was stored through "
                                         "DCP stream extensions, which taskpoint.torch does not read")
        piece = _Span(reader, info.offset, info.length)
        try:
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(piece.read()))
                return
            tensor = torch.load(cast(IO[bytes], piece), map_location="cpu", weights_only=True)
        except Exception:
            # torch.load reads through C++, which does not always pass on what a read raised: the piece's own
            # error when one differs.
            reader.verify_span(info.offset, info.length)
            raise
        for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths, strict=True)):
            if start != 0 or length != tensor.size(dim):
                tensor = tensor.narrow(dim, start, length)
        target = planner.resolve_tensor(item).detach()
        if target.size() != tensor.size():
            raise CheckpointCorruptError(f"{self._root.uri}: item {item.storage_index.fqn} has shape "
                                         f"{tuple(tensor.size())} where the plan expects {tuple(target.size())}")
        target.copy_(tensor)
        planner.commit_tensor(item, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


class _Span(io.RawIOBase):
    """``length`` bytes of ``reader`` from ``start``, as a seekable file of their own (one item of a DCP data file,
    for ``torch.load``); reads go straight into the caller's buffer."""

    def __init__(self, reader: PieceReader, start: int, length: int) -> None:
        super().__init__()
        self._reader, self._start, self._length, self._at = reader, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        out = memoryview(buffer).cast("B")
        want = min(out.nbytes, self._length - self._at)
        if want <= 0:
            return 0
        self._reader.seek(self._start + self._at)
        done = self._reader.readinto(out[:want])
        self._at += done
        return done

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: self._length}[whence]
        self._at = max(0, base + offset)
        return self._at

    def tell(self) -> int:
        return self._at


def _relative_path(info: Any, where: str) -> str:
    path = getattr(info, "relative_path", None)
    if not isinstance(path, str) or not path or "/" in path or path.startswith("."):
        raise CheckpointCorruptError(f"{where}: the metadata names a data file {path!r} outside the checkpoint")
    return path


def _verify(uri: str, data: bytes | bytearray, entry: FileEntry) -> None:
    """Raise CheckpointCorruptError naming ``uri`` unless ``data`` has the manifest's size and digests (BLAKE3
    pieces, or a sha256 of the whole file in a manifest of version 3 or older)."""
    if len(data) != entry.size:
        raise CheckpointCorruptError(f"{uri} is damaged: {len(data)} bytes where the manifest says {entry.size} "
                                     "(truncated or extended after the save)")
    if entry_of(data, entry.piece_hash or None) != entry:
        raise CheckpointCorruptError(f"{uri} is damaged: its {entry.hash_name} differs from the one recorded when it "
                                     "was saved (a changed byte)")
