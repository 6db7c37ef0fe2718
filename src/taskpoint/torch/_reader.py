"""Reader: DCP's ``StorageReader`` on taskpoint's storage layer; every byte it reads is verified first.

``read_metadata`` reads the commit (``.metadata``) and taskpoint's manifest and checks the one against the
other; ``read_data`` downloads each file this rank needs whole, several at once, checks its size and sha256
against the manifest, and only then hands its items to DCP's planner. DCP swallows what ``read_metadata``
raises (it then looks for per-rank metadata and reports "metadata is None"), so the Reader keeps that error
and raises it from ``set_up_storage_reader``, the next call DCP makes.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
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
from ..manager import CheckpointManager
from ..manager.kind_api import step_folder
from ..storage import Deadline, Location, RetryPolicy
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
        threads: files downloaded at once (each whole in memory until it is verified).
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
        """Download the files this rank's items are in (whole, :attr:`threads` at once), verify each, then
        deserialize its items into the planner's tensors. Nothing of a file reaches a tensor before it
        matches the manifest; files verified earlier have been loaded when a later one fails."""
        self._raise_failure()
        per_file: dict[str, list[ReadItem]] = collections.defaultdict(list)
        for item in plan.items:
            per_file[_relative_path(self._storage[item.storage_index], self._root.uri)].append(item)
        for name, data in self._fetch_all(list(per_file)):
            for item in per_file[name]:
                self._load_item(item, data, planner)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    def _fetch_all(self, names: list[str]) -> Iterator[tuple[str, memoryview]]:
        """Each file's verified bytes, in order, with at most :attr:`threads` downloads (and files) in memory."""
        if not names:
            return
        # Its own pool, not a lane of taskpoint.executors: each file's download waits for its ranged GETs on a
        # lane of the IO pool, and waiting tasks on a shared bounded pool can deadlock it.
        with concurrent.futures.ThreadPoolExecutor(min(self.threads, len(names)),
                                                   thread_name_prefix="taskpoint-dcp-get") as pool:
            pending: collections.deque[tuple[str, concurrent.futures.Future[memoryview]]] = collections.deque()
            queue = collections.deque(names)
            try:
                while queue or pending:
                    while queue and len(pending) < self.threads:
                        name = queue.popleft()
                        pending.append((name, pool.submit(self._fetch, name)))
                    name, future = pending.popleft()
                    yield name, future.result()
            finally:
                for _, future in pending:
                    future.cancel()

    def _fetch(self, name: str) -> memoryview:
        assert self._manifest is not None
        entry = self._manifest.entry(name, self._root.uri)
        location = self._root.child(name)

        def download(deadline: Deadline) -> bytearray:
            buffer = bytearray(entry.size + 1)  # one more: a longer file shows as too long
            view, got = memoryview(buffer), 0
            with contextlib.closing(location.open_read(size_hint=entry.size, deadline=deadline)) as source:
                while got < len(buffer):
                    n = cast(io.RawIOBase, source).readinto(view[got:])
                    if not n:
                        break
                    got += n
            view.release()
            del buffer[got:]
            return buffer

        try:
            data = location.run(download, action="read")
        except FileNotFoundError as exc:
            raise CheckpointCorruptError(f"{location.uri} is missing: the checkpoint's manifest lists it "
                                         f"({entry.size} bytes), but it is not in storage") from exc
        _verify(location.uri, data, entry)
        return memoryview(data)

    def _load_item(self, item: ReadItem, data: memoryview, planner: LoadPlanner) -> None:
        info = self._storage[item.storage_index]
        if getattr(info, "transform_descriptors", None):
            raise CheckpointCorruptError(f"{self._root.uri}: item {item.storage_index.fqn} was stored through "
                                         "DCP stream extensions, which taskpoint.torch does not read")
        piece = data[info.offset:info.offset + info.length]
        if item.type == LoadItemType.BYTE_IO:
            planner.load_bytes(item, io.BytesIO(piece))
            return
        tensor = torch.load(cast(IO[bytes], _ViewReader(piece)), map_location="cpu", weights_only=True)
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


class _ViewReader(io.RawIOBase):
    """A seekable stream over a memoryview, without copying it: ``torch.load`` reads each storage straight into
    the tensor it allocates (``readinto``), where a BytesIO would first copy the whole item."""

    def __init__(self, view: memoryview) -> None:
        super().__init__()
        self._view, self._at = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        n = min(len(buffer), len(self._view) - self._at)
        if n <= 0:
            return 0
        buffer[:n] = self._view[self._at:self._at + n]
        self._at += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._at, io.SEEK_END: len(self._view)}[whence]
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
