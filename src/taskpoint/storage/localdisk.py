"""Local disk's backend: durable atomic writes by a temp file in the same folder, fsync, rename and fsync of the
folder; reads, ranged reads and listings straight from the files (see :mod:`.localio` for kernel copies)."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat
import time
import uuid
from collections.abc import Iterator
from typing import IO, Any

from .backends import LEFTOVER_GRACE_SECONDS, NO_HOOKS, Backend, Kind, WriteHooks, _is_absent
from .errormap import swept_while_written
from .localio import EarlyWriteback, folder_lock, fsync_dir, local_version, read_range
from .streams import VersionConflict

#: How often a local write makes its folder again when a sweep removed it, empty, before the file was created.
_FOLDER_ATTEMPTS = 3


def _create_in(folder: str, path: str) -> IO[bytes]:
    """Create the new file ``path`` in ``folder``, making the folder first. A sweep of another writer removes
    empty folders (a step folder it lists empty, a chunk folder it emptied), so the folder may vanish between
    its making and the file's creation: make it again, a few times."""
    for _ in range(_FOLDER_ATTEMPTS - 1):
        os.makedirs(folder, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            return open(path, "xb+", buffering=0)
    os.makedirs(folder, exist_ok=True)
    return open(path, "xb+", buffering=0)


class LocalBackend(Backend):
    """Local disk: durable atomic writes by temp file, fsync and rename; reads straight from the file."""

    def kind(self, path: str) -> Kind:
        # Not os.path.isfile(): it answers False on EACCES, EIO or ESTALE.
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:
            if _is_absent(exc):
                return Kind.NOTHING
            raise
        if stat.S_ISREG(mode):
            return Kind.OBJECT
        if stat.S_ISDIR(mode):
            return Kind.FOLDER
        raise OSError(errno.EINVAL, "neither a file nor a folder (a fifo, socket or device)", path)

    def size(self, path: str) -> int | None:
        try:
            st = os.stat(path)
        except OSError as exc:
            if _is_absent(exc):
                return None
            raise
        return st.st_size if stat.S_ISREG(st.st_mode) else None

    def list_tree(self, path: str, prefix: str = "") -> dict[str, dict[str, Any]]:
        """Like fsspec's ``find`` (folders included, symlinks not followed), but a folder that cannot be read
        raises instead of being left out (fsspec's walk omits it silently, as if it were empty). An entry that
        vanishes while the tree is walked is left out; the root missing is FileNotFoundError. With ``prefix``,
        only the entries of ``path`` whose names start with it are walked (the root itself is listed too)."""
        root = self.fs._strip_protocol(path)
        info = self.fs.info(root)
        if info["type"] != "directory":
            return {root: info}
        found: dict[str, dict[str, Any]] = {root: info}
        folders = [root]
        while folders:
            folder = folders.pop()
            try:
                entries = list(os.scandir(folder))
            except OSError as exc:
                if folder != root and _is_absent(exc):
                    continue  # removed meanwhile
                raise
            if folder == root and prefix:
                entries = [entry for entry in entries if entry.name.startswith(prefix)]
            for entry in entries:
                try:
                    details = self.fs.info(entry)
                except OSError as exc:
                    if _is_absent(exc):
                        continue
                    raise
                found[details["name"]] = details
                if details["type"] == "directory":
                    folders.append(entry.path)
        return dict(sorted(found.items()))

    def read_small(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    conditional = True

    def read_versioned(self, path: str) -> tuple[bytes, str | None]:
        with open(path, "rb") as f:
            return f.read(), local_version(os.fstat(f.fileno()))

    def write_versioned(self, path: str, data: bytes, expected: str | None) -> str | None:
        """Under an exclusive ``flock`` of the folder (where the file system has it): compare the file's
        identity with ``expected``, then the usual temp file, fsync and rename, which gives the file a new
        inode and so a new version."""
        folder = os.path.dirname(path) or "."
        os.makedirs(folder, exist_ok=True)
        with folder_lock(folder):
            try:
                current = local_version(os.stat(path))
            except FileNotFoundError:
                current = None
            if current != expected:
                raise VersionConflict(f"{path} changed since it was read")
            with self.open_write(path, len(data), NO_HOOKS) as f:
                f.write(data)
            return local_version(os.stat(path))

    def open_read(self, path: str, size_hint: int | None = None) -> IO[bytes]:
        """Unbuffered: its readers ask for whole gzip members, pieces of 128 KiB or more, or a tar header, each one
        read syscall into the bytes they get. Through a 1 MiB buffer, the small read of each member's header
        filled it, and the next member's bytes were copied out of it: reading a 1 GiB directory step's payload
        member by member took 0.25 CPU-s so, and 0.18 unbuffered (3 rounds each)."""
        return open(path, "rb", buffering=0)

    def read_range(self, path: str, start: int, length: int) -> bytes:
        return read_range(path, start, length)

    @contextlib.contextmanager
    def open_write(self, path: str, size_hint: int | None, hooks: WriteHooks) -> Iterator[IO[bytes]]:
        folder, name = os.path.split(path)
        tmp = os.path.join(folder, f".{name}.{uuid.uuid4().hex[:12]}.tmp")
        try:
            with _create_in(folder, tmp) as raw:
                f = EarlyWriteback(raw)
                yield f
                f.flush()
                os.fsync(raw.fileno())
            hooks.before_commit(self.deadline)
            try:
                os.replace(tmp, path)
            except FileNotFoundError:
                if os.path.lexists(tmp):
                    raise
                # The temp file was removed while it was written (with its folder, when the folder held nothing
                # else): a sweep (of another process, or with a shorter grace) took it for a dead writer's
                # leftover because this writer was stopped for that long.
                raise swept_while_written(path, f"temp file {tmp}") from None
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        fsync_dir(folder)

    def remove(self, path: str) -> None:
        os.unlink(path)

    def remove_tree(self, path: str) -> None:
        shutil.rmtree(path)

    def sweep_leftovers(self, path: str, started_before: float) -> None:
        """Temp files of killed saves, once older than :data:`LEFTOVER_GRACE_SECONDS` (a live writer keeps
        touching its own)."""
        folder, name = os.path.split(path)
        cutoff = time.time() - LEFTOVER_GRACE_SECONDS
        for entry in os.scandir(folder):
            leftover = entry.name.startswith(f".{name}.") and entry.name.endswith(".tmp")
            if leftover and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                os.unlink(entry.path)
