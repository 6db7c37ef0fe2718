"""Writer: DCP's ``StorageWriter`` on taskpoint's storage layer (atomic uploads, hashing, one commit).

DCP calls, in order: ``reset`` and ``set_up_storage_writer`` (all ranks), ``prepare_local_plan`` (all),
``prepare_global_plan`` (the coordinator: here it checks the destination and names each rank's files),
``write_data`` (all ranks: each uploads its files in parallel, hashing them), then ``finish`` on the
coordinator once every rank's writes succeeded: the manifest, then ``.metadata``, the commit. When any rank
fails, DCP never calls ``finish``: nothing is committed, and a load finds no checkpoint there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import io
import os
import pickle
import time
import uuid
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..format.fileset import PIECE_HASH, FileEntry, FileSetManifest, PieceHasher, entry_of
from ..manager import CheckpointManager
from ..manager.kind_api import step_folder
from ..storage import Deadline, Location, RetryPolicy
from ..transfer import HashingWriter
from ._kind import FileSetStep
from ._layout import (
    DATA_FILE,
    DEFAULT_THREADS,
    MANIFEST_KIND,
    MANIFEST_NAME,
    METADATA_NAME,
    FilePrefix,
    Rooted,
    StoredItem,
    check_threads,
    root_location,
)

#: DCP's format version of ``.metadata`` written by its file writers (the same layout is written here).
DCP_VERSION = "1.0.0"
#: Bytes a serialized tensor takes beyond its data (torch.save's zip records), for size hints.
_TENSOR_OVERHEAD = 4096


class Writer(Rooted, StorageWriter):
    """Saves a DCP checkpoint to ``uri`` (a folder on any fsspec URL): ``dcp.save(state, storage_writer=
    Writer(uri, storage_options=...))``, and ``dcp.async_save`` the same way.

    Args:
        uri: the checkpoint's folder or prefix; one checkpoint per URI (``s3://bucket/run/step-100``).
        storage_options: passed to fsspec (credentials, endpoint).
        overwrite: replace a checkpoint already committed at ``uri``. Its commit is removed before any new
            file is written, so a save that then fails leaves no checkpoint there. Default False: a
            FileExistsError.
        threads: files each rank uploads at once (its items are split into that many files).
        retry: how transient storage failures are retried (each file is retried whole).
    """

    def __init__(self, uri: str | os.PathLike[str], storage_options: dict[str, Any] | None = None, *,
                 overwrite: bool = False, threads: int = DEFAULT_THREADS, retry: RetryPolicy | None = None) -> None:
        super().__init__()
        self._options = storage_options
        self._retry = retry
        self._root: Location = root_location(uri, storage_options, retry)
        self.overwrite = bool(overwrite)
        self.threads = check_threads(threads)
        self.save_id = uuid.uuid4().hex
        #: The manifest the last save committed (on the coordinator, once ``finish`` returned).
        self.committed: FileSetManifest | None = None

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._reroot(checkpoint_id)
        self.save_id = uuid.uuid4().hex
        self.committed = None

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError("taskpoint.torch.Writer commits one .metadata for all ranks; save with "
                             "use_collectives=True (the default)")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self._root.uri, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        """On the coordinator: refuse (or, with ``overwrite``, un-commit) a committed checkpoint at the URI,
        then name each rank's files after this save, so that no two saves ever share a data file."""
        commit = self._root.child(METADATA_NAME)
        if commit.exists():
            if not self.overwrite:
                raise FileExistsError(f"a checkpoint is already committed at {self._root.uri}; save to a new URI, "
                                      "or pass overwrite=True to taskpoint.torch.Writer")
            commit.remove()
            self._root.child(MANIFEST_NAME).remove()
        return [_with_prefix(plan, FilePrefix(rank, self.save_id[:12])) for rank, plan in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Upload this rank's items as up to :attr:`threads` files at once, each atomic, retried whole, hashed."""
        prefix = plan.storage_data
        if not isinstance(prefix, FilePrefix):
            raise TypeError("the save plan was not prepared by taskpoint.torch.Writer's prepare_global_plan")
        files = [(prefix.name(n), items) for n, items in enumerate(_split(plan.items, self.threads)) if items]
        results: list[WriteResult] = []
        if files:
            # Its own pool, not a lane of taskpoint.executors: each file's upload waits for its parts on a lane
            # of the IO pool, and waiting tasks on a shared bounded pool can deadlock it.
            with concurrent.futures.ThreadPoolExecutor(min(self.threads, len(files)),
                                                       thread_name_prefix="taskpoint-dcp-put") as pool:
                for done in [pool.submit(self._write_file, name, items, planner) for name, items in files]:
                    results += done.result()
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _write_file(self, name: str, items: list[WriteItem], planner: SavePlanner) -> list[WriteResult]:
        location = self._root.child(name)
        hint = sum(_item_bytes(item) for item in items)

        def write(deadline: Deadline) -> list[WriteResult]:
            placed: list[tuple[WriteItem, int, int]] = []
            with location.open_write(size_hint=hint, deadline=deadline) as sink:
                out = HashingWriter(sink, PieceHasher(PIECE_HASH))
                for item in items:
                    offset = out.size
                    _write_item(out, planner.resolve_data(item), item)
                    placed.append((item, offset, out.size - offset))
            entry = out.hasher.entry()
            return [WriteResult(index=item.index, size_in_bytes=length,
                                storage_data=StoredItem(name, offset, length, entry))
                    for item, offset, length in placed]

        return location.run(write, action="write", writing=True)

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """The commit, on the coordinator: the manifest of every file (``.metadata`` included), then
        ``.metadata``. Then data files of earlier saves to this URI go (best effort)."""
        files: dict[str, FileEntry] = {}
        storage: dict[Any, _StorageInfo] = {}
        for result in (r for rank in results for r in rank):
            stored = result.storage_data
            if not isinstance(stored, StoredItem):
                raise TypeError("a write result did not come from taskpoint.torch.Writer's write_data")
            storage[result.index] = _StorageInfo(stored.relative_path, stored.offset, stored.length)
            files[stored.relative_path] = stored.file
        metadata.version = DCP_VERSION
        metadata.storage_data = storage
        metadata.storage_meta = self.storage_meta()
        blob = pickle.dumps(metadata)
        files[METADATA_NAME] = entry_of(blob)
        manifest = self.new_manifest(files)
        self.commit(manifest, blob)
        self.committed = manifest
        self._remove_stale(files)

    def new_manifest(self, files: dict[str, FileEntry]) -> FileSetManifest:
        """The manifest of this save. A subclass may record more (a manager step's attempt and metadata)."""
        return FileSetManifest(kind=MANIFEST_KIND, save_id=self.save_id, created=time.time(), files=files)

    def commit(self, manifest: FileSetManifest, metadata_blob: bytes) -> None:
        """Write the manifest, then ``.metadata``: the commit. A subclass may extend it (a manager writes its
        step record after both, so that a step it lists is always loadable)."""
        self._root.child(MANIFEST_NAME).write_small(manifest.to_bytes(), action="commit")
        self._root.child(METADATA_NAME).write_small(metadata_blob, action="commit")

    def _remove_stale(self, kept: dict[str, FileEntry]) -> None:
        """Data files no manifest names any more (an overwritten save's, or a failed save's). Best effort."""
        with contextlib.suppress(Exception):
            for name in self._root.list_names():
                if DATA_FILE.fullmatch(name) and name not in kept:
                    self._root.child(name).remove()

    @classmethod
    def for_step(cls, manager: CheckpointManager, step: int, *, metadata: dict[str, Any] | None = None,
                 overwrite: bool = False, threads: int = DEFAULT_THREADS) -> Writer:
        """A writer that saves ``step`` of ``manager``: DCP's files go into the step's folder, and once
        ``.metadata`` is written the manager commits the step (its manifest names taskpoint's manifest of the
        files by sha256), so ``steps()``, ``latest_step()``, retention, ``delete()`` and ``gc()`` cover DCP
        checkpoints too. With a local tier (``local_dir``) the step goes there and is promoted as a save's is;
        ValueError, here, before anything is stored, when such a manager has several ranks (a rank's load reads
        files other ranks wrote, which no node's local tier holds).
        Every rank passes its own ``Writer.for_step(its_manager, step)``; only DCP's coordinator commits.
        ``metadata``: the step's JSON metadata, as ``manager.save`` takes it."""
        return _StepWriter(manager, step, metadata, overwrite=overwrite, threads=threads)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


def _with_prefix(plan: SavePlan, prefix: FilePrefix) -> SavePlan:
    return dataclasses.replace(plan, storage_data=prefix)


def _item_bytes(item: WriteItem) -> int:
    """The bytes an item will take, roughly (exact data size plus torch.save's records); 0 for bytes items."""
    if item.tensor_data is None:
        return 0
    count = 1
    for n in item.tensor_data.size:
        count *= n
    return count * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size() + _TENSOR_OVERHEAD


def _split(items: list[WriteItem], bins: int) -> list[list[WriteItem]]:
    """Items in ``bins`` groups of about equal bytes: largest tensor first into the lightest group; bytes items
    (small: the non-tensor state) go into the first group."""
    groups: list[list[WriteItem]] = [[] for _ in range(bins)]
    weights = [0] * bins
    for item in sorted(items, key=_item_bytes, reverse=True):
        lightest = 0 if item.type == WriteItemType.BYTE_IO else weights.index(min(weights))
        groups[lightest].append(item)
        weights[lightest] += _item_bytes(item)
    return groups


def _write_item(out: HashingWriter, data: Any, item: WriteItem) -> None:
    """One item as DCP's file writers store it: bytes as they are, a tensor as ``torch.save`` writes it."""
    if item.type == WriteItemType.BYTE_IO:
        if not isinstance(data, io.BytesIO):
            raise TypeError(f"DCP resolved the bytes item {item.index.fqn} to a {type(data).__name__}")
        out.write(cast(bytes, data.getbuffer()))
        return
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"DCP resolved the tensor item {item.index.fqn} to a {type(data).__name__}")
    tensor = data.detach().cpu()
    if tensor.untyped_storage().size() != tensor.nbytes:
        tensor = tensor.clone()  # a view: store only its own elements, not the whole storage behind it
    torch.save(tensor, cast(IO[bytes], out))


class _StepWriter(Writer):
    """A :class:`Writer` into a step of a :class:`~taskpoint.CheckpointManager`, which commits the step."""

    def __init__(self, manager: CheckpointManager, step: int, metadata: dict[str, Any] | None, *, overwrite: bool,
                 threads: int) -> None:
        folder = step_folder(manager, step)  # with a local tier, on it: the commit there promotes the step
        super().__init__(folder.uri, folder.storage_options, overwrite=overwrite, threads=threads,
                         retry=folder.retry)
        self._manager, self._step, self._metadata = manager, step, metadata

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if self._step in self._manager.steps():
            if not self.overwrite:
                raise FileExistsError(f"step {self._step} already exists in {self._manager.directory}; pass "
                                      "overwrite=True to Writer.for_step, or save under a new step")
            self._manager.delete(self._step, force=True)  # un-commit first: a failed overwrite leaves no half step
        return super().prepare_global_plan(plans)

    def commit(self, manifest: FileSetManifest, metadata_blob: bytes) -> None:
        super().commit(manifest, metadata_blob)
        self._manager.commit(self._step, FileSetStep(MANIFEST_NAME), metadata=self._metadata)
