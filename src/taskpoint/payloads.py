"""Payload kinds: what a checkpoint can hold, how it is written to storage and brought back.

Each kind is a small class behind one registry (the pattern of Orbax's handlers): ``bytes``, ``file`` and
``directory`` live here; an extra (for example the JAX PyTree kind) adds its own with
:func:`register_payload` and touches nothing else.
"""

from __future__ import annotations

import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any, ClassVar

from .errors import CheckpointError
from .format.archive import skip_special, tree_file_bytes, write_tar
from .format.codecs import BLOCK_SIZE, Codec
from .format.extract import extract_tar
from .format.index import ArchiveIndex
from .storage import WRITE_PIECE
from .storage.localio import ParallelCopy, copy_with_metadata

#: Name of the file that holds a bytes or file checkpoint after load (Flyte's convention).
RAW_RESULT_NAME = "payload"

ACCEPTED = "bytes, bytearray, memoryview, or a str or os.PathLike naming a file or directory"


class Payload(ABC):
    """One piece of data to save. Subclasses claim the inputs they handle and say how to store them."""

    kind: ClassVar[str]
    #: True when stored as an archive (a codec applies); False when the object holds the raw bytes.
    archived: ClassVar[bool]
    #: The file a load of a raw kind writes into the workspace (and returns).
    result_name: ClassVar[str] = RAW_RESULT_NAME
    #: True when :meth:`write` reports the source bytes it reads itself (it is then called with
    #: ``on_read=``, where a save's progress counts); else a save's progress counts the stored bytes written.
    counts_source: ClassVar[bool] = False
    #: The index of the archive the last :meth:`write` produced (:mod:`taskpoint.format.index`), recorded with
    #: the object so that partial restores read only what they need; None for raw kinds and unindexed codecs.
    written_index: ArchiveIndex | None = None
    #: The module a save process imports to write a payload of this kind staged in shared memory (imported when
    #: the process starts, so that the first staged save does not wait for it); None for kinds never staged.
    staged_by: ClassVar[str | None] = None

    @classmethod
    @abstractmethod
    def claim(cls, data: object) -> Payload | None:
        """A payload for ``data`` when this kind handles it, else None."""

    def size(self) -> int | None:
        """The stored size in bytes when known before writing (raw kinds), else None."""
        return None

    def progress_size(self) -> int | None:
        """The total a save's progress counts up to, when known before writing (the stored size by default)."""
        return self.size()

    def local_file(self) -> Path | None:
        """A local file whose bytes are exactly the stored form, if any: saved to local disk by the kernel."""
        return None

    @abstractmethod
    def write(self, sink: IO[bytes], codec: Codec, level: int | None) -> None:
        """Stream the stored form into ``sink``. Kinds with :attr:`counts_source` also take ``on_read``: a
        function told each count of source bytes read (None when nothing listens)."""

    def snapshot(self, scratch: Path) -> Payload | None:
        """A payload that no longer reads the caller's data, copying what it needs below ``scratch``.

        Background saves write the snapshot while the caller goes on changing its data. None when this kind
        cannot be snapshotted; it is then saved in the foreground.
        """
        return None

    @classmethod
    @abstractmethod
    def materialize(cls, source: IO[bytes], staging: Path, uri: str) -> None:
        """Write the stored form read from ``source`` (decompressed for archived kinds) below ``staging``.
        :attr:`archived` kinds also take ``max_expand``: the most bytes the load may write (None: the default
        of :func:`~taskpoint.format.extract.extract_tar`)."""

    @classmethod
    def publish(cls, staging: Path, workspace: Path) -> Path:
        """Move a verified result from ``staging`` into ``workspace``; return what load returns."""
        for entry in os.listdir(staging):
            target = workspace / entry
            if target.is_dir() and not target.is_symlink():
                shutil.rmtree(target)
            elif target.exists() or target.is_symlink():
                target.unlink()
            os.replace(staging / entry, target)
        return workspace


class BytesPayload(Payload):
    kind = "bytes"
    archived = False
    #: The step kind that writes bytes staged by a background save (:meth:`stage`): one payload object.
    staged_kind = "payload"

    def __init__(self, data: bytes | bytearray | memoryview) -> None:
        # A snapshot: the caller may reuse its buffer as soon as save returns.
        self._view = memoryview(bytes(data) if not isinstance(data, bytes) else data).cast("B")

    @classmethod
    def claim(cls, data: object) -> Payload | None:
        return cls(data) if isinstance(data, (bytes, bytearray, memoryview)) else None

    def size(self) -> int:
        return self._view.nbytes

    def snapshot(self, scratch: Path) -> Payload:
        return self  # the constructor already copied anything mutable

    def staging_size(self) -> int | None:
        """The bytes a background save stages these in (:meth:`stage`)."""
        return self._view.nbytes

    def stage(self, segment: Any) -> Payload:
        """Copy the bytes into ``segment`` (a :class:`taskpoint.manager.staging.Segment` of :meth:`staging_size`
        bytes, from the layer above this module); what the save then writes, from the segment."""
        segment.fill([(0, self._view)])
        return StagedBytes(str(segment.path), self._view.nbytes)

    def __reduce__(self) -> tuple[Any, ...]:  # a memoryview does not pickle; its bytes do
        whole = isinstance(self._view.obj, bytes) and len(self._view.obj) == self._view.nbytes
        return BytesPayload, (self._view.obj if whole else self._view.tobytes(),)

    def write(self, sink: IO[bytes], codec: Codec, level: int | None) -> None:
        for start in range(0, self._view.nbytes, BLOCK_SIZE * 8):
            sink.write(self._view[start:start + BLOCK_SIZE * 8])

    @classmethod
    def materialize(cls, source: IO[bytes], staging: Path, uri: str) -> None:
        with open(staging / cls.result_name, "wb") as out:
            shutil.copyfileobj(source, out, WRITE_PIECE)

    @classmethod
    def publish(cls, staging: Path, workspace: Path) -> Path:
        target = workspace / cls.result_name
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(staging / cls.result_name, target)
        return target


class StagedBytes(BytesPayload):
    """Bytes a background save staged in a segment (:meth:`BytesPayload.stage`), saved and restored as the bytes
    they are: written from the segment by the ``payload`` step kind, through the manager's save process (or a
    thread of this process when there is none)."""

    def __init__(self, segment: str, size: int) -> None:
        self.segment, self._size = segment, size

    def size(self) -> int:
        return self._size

    def staging_size(self) -> None:
        return None  # staged already

    def write(self, sink: IO[bytes], codec: Codec, level: int | None) -> None:
        raise TypeError("staged bytes are written by the payload step kind, from their segment")


class FilePayload(BytesPayload):
    kind = "file"

    def __init__(self, path: Path) -> None:
        self._path = path
        self._size = path.stat().st_size

    def __reduce__(self) -> tuple[Any, ...]:
        return FilePayload, (self._path,)

    @classmethod
    def claim(cls, data: object) -> Payload | None:
        path = _existing_path(data)
        return cls(path) if path is not None and path.is_file() else None

    def size(self) -> int:
        return self._size

    def local_file(self) -> Path:
        return self._path

    def staging_size(self) -> None:
        return None  # a file's snapshot is an in-kernel copy

    def snapshot(self, scratch: Path) -> Payload:
        copy = scratch / self._path.name
        copy_with_metadata(self._path, copy)
        return FilePayload(copy)

    def write(self, sink: IO[bytes], codec: Codec, level: int | None) -> None:
        written = 0
        with open(self._path, "rb", buffering=0) as f:
            while chunk := f.read(BLOCK_SIZE * 8):
                sink.write(chunk)
                written += len(chunk)
        if written != self._size:
            raise RuntimeError(f"{self._path} changed size while it was being saved "
                               f"({self._size} -> {written} bytes); save it again once it is complete")


class DirectoryPayload(Payload):
    kind = "directory"
    archived = True
    counts_source = True  # a save's progress counts the bytes of the files, before compression

    def __init__(self, path: Path) -> None:
        self._path = path

    @classmethod
    def claim(cls, data: object) -> Payload | None:
        path = _existing_path(data)
        return cls(path) if path is not None and path.is_dir() else None

    def progress_size(self) -> int:
        """The bytes of the regular files below the folder (what the archive holds, before compression)."""
        return tree_file_bytes(self._path)

    def write(self, sink: IO[bytes], codec: Codec, level: int | None,
              on_read: Callable[[int], None] | None = None) -> None:
        self.written_index = write_tar(self._path, sink, codec, level, on_read=on_read)

    def snapshot(self, scratch: Path) -> Payload:
        copy = scratch / "tree"
        with ParallelCopy() as copier:  # waits for every copy, even when copytree raises
            shutil.copytree(self._path, copy, symlinks=True, ignore=special_entries, copy_function=copier)
        return DirectoryPayload(copy)

    @classmethod
    def materialize(cls, source: IO[bytes], staging: Path, uri: str, *, max_expand: int | None = None,
                    only: Sequence[str] | None = None) -> None:
        extract_tar(source, staging, uri, max_expand=max_expand, only=only)


def special_entries(folder: str, names: list[str]) -> set[str]:
    return {name for name in names
            if skip_special(os.path.join(folder, name), os.lstat(os.path.join(folder, name)).st_mode, stacklevel=6)}


def _existing_path(data: object) -> Path | None:
    if isinstance(data, (str, os.PathLike)) and not isinstance(data, bytes):
        path = Path(os.fspath(data))
        return path if path.exists() else None
    return None


_REGISTRY: list[type[Payload]] = [BytesPayload, FilePayload, DirectoryPayload]


def register_payload(cls: type[Payload]) -> type[Payload]:
    """Add a payload kind; it is asked before the built-in ones. Usable as a class decorator."""
    if any(existing.kind == cls.kind for existing in _REGISTRY):
        raise ValueError(f"a payload kind named {cls.kind!r} is already registered")
    _REGISTRY.insert(0, cls)
    return cls


def registered_payloads() -> tuple[type[Payload], ...]:
    """The payload kinds registered in this process, the last registered first."""
    return tuple(_REGISTRY)


def payload_for(data: Any) -> Payload:
    """The payload that stores ``data``; FileNotFoundError or TypeError saying what is accepted."""
    for cls in _REGISTRY:
        payload = cls.claim(data)
        if payload is not None:
            return payload
    if isinstance(data, str):
        raise FileNotFoundError(
            f"save() got the str {data[:80]!r}, which names no existing file or directory. A str is "
            "taken as a path; to save text, pass bytes, e.g. save(text.encode()).")
    if isinstance(data, os.PathLike):
        path = Path(os.fspath(data))
        if not path.exists():
            raise FileNotFoundError(f"save() got {os.fspath(data)!r}, which names no existing file or directory")
        raise ValueError(f"save() got {os.fspath(data)!r}, which is neither a regular file nor a directory "
                         "(a fifo, socket or device cannot be saved)")
    raise TypeError(f"save() accepts {ACCEPTED}; got {type(data).__name__}")


#: Entry-point group of payload kinds that extras provide (``pytree = "taskpoint.jax:PyTree"`` in pyproject.toml).
#: Loading such a checkpoint imports the module that registers the kind, so a process need not import the
#: extra first; the core never names an extra's module.
ENTRY_POINT_GROUP = "taskpoint.payloads"


def payload_class(kind: str, uri: str) -> type[Payload]:
    """The payload class recorded as ``kind``; imports the extra that provides it when needed."""
    cls = _registered(kind)
    if cls is None:
        from importlib.metadata import entry_points

        for point in entry_points(group=ENTRY_POINT_GROUP, name=kind):
            try:
                point.load()
            except ImportError as exc:
                extra = point.module.split(".")[-1]  # taskpoint's extras are named after their module
                raise CheckpointError(f"the checkpoint at {uri} holds a payload of kind {kind!r}; loading it needs "
                                      f'pip install "taskpoint[{extra}]" ({exc})') from exc
        cls = _registered(kind)
    if cls is None:
        raise CheckpointError(f"the checkpoint at {uri} holds a payload of kind {kind!r}, which this taskpoint "
                              "does not know; install the extra that provides it (e.g. taskpoint[jax]).")
    return cls


def _registered(kind: str) -> type[Payload] | None:
    return next((cls for cls in _REGISTRY if cls.kind == kind), None)
