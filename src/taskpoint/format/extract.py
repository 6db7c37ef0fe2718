"""Extraction that cannot escape its folder, and the space a load may take.

Every member is checked before anything touches the disk and extracted relative to open folder descriptors,
one path component at a time, never following a symlink (``openat`` with ``O_NOFOLLOW``): absolute names,
``..``, a path through any symlink, links that resolve outside, device or fifo members raise
:class:`~taskpoint.errors.UnsafeArchiveError`, and nothing is created outside the staging folder given by the
caller, folders included. What an archive may expand to is bounded by the free space of that folder's file
system and by :data:`MAX_EXPAND` (:class:`~taskpoint.errors.StorageFull` before the disk fills); what may follow
the end of the archive by :data:`MAX_TRAILING`.
"""

from __future__ import annotations

import errno
import os
import stat
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, NoReturn, TypeVar

from ..errors import CheckpointCorruptError, CheckpointError, StorageFull, UnsafeArchiveError
from .archive import MAX_DEPTH, MAX_PATH_BYTES, _TarReader, link_leaves
from .codecs import BLOCK_SIZE, DECODE_ERRORS
from .filegzip import DestinationError
from .index import covered
from .space import SpaceBudget

#: Largest number of bytes a directory checkpoint may expand to when it is loaded (the sum of its files'
#: sizes), or None for no fixed limit. Whatever this says, a load also stops with StorageFull before it
#: would fill the file system it extracts to. The default of ``extract_tar(max_expand=...)``, read at
#: each call, so setting ``taskpoint.format.extract.MAX_EXPAND`` applies to every later load.
MAX_EXPAND: int | None = None
#: Most bytes (all zero: tar's padding to its record size) that may follow the end-of-archive marker.
MAX_TRAILING = 16 << 20
#: Symlinks followed while checking where one link leads (the kernel's limit); more is refused.
MAX_LINK_HOPS = 40

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})

T = TypeVar("T")


class _Blocked(Exception):
    """A component of a member's path exists and is not a folder (``link``: it is a symlink)."""

    def __init__(self, parts: tuple[str, ...], link: bool) -> None:
        super().__init__("/".join(parts))
        self.parts = parts
        self.link = link


class _Folders:
    """Descriptors of the folders below the extraction root, opened one component at a time with
    ``O_NOFOLLOW``, creating missing ones; the most recent :attr:`KEEP` stay open for the next members."""

    KEEP = 64

    def __init__(self, root_fd: int) -> None:
        self.root = root_fd
        self._open: dict[tuple[str, ...], int] = {}

    def get(self, parts: tuple[str, ...], *, create: bool = True) -> int:
        """The descriptor of the folder ``parts`` below the root. _Blocked when a component is a symlink or
        not a folder; FileNotFoundError when one is missing and not ``create``."""
        if not parts:
            return self.root
        fd = self._open.get(parts)
        if fd is not None:
            return fd
        depth = len(parts) - 1
        while depth and parts[:depth] not in self._open:
            depth -= 1
        fd = self._open[parts[:depth]] if depth else self.root
        for i in range(depth, len(parts)):
            fd = self._child(fd, parts[: i + 1], create)
            self._open[parts[: i + 1]] = fd
        return fd

    @staticmethod
    def _child(parent: int, parts: tuple[str, ...], create: bool) -> int:
        name = parts[-1]
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except FileNotFoundError:
            if not create:
                raise
            os.mkdir(name, 0o777, dir_fd=parent)
            return os.open(name, _DIR_FLAGS, dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                raise
            mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
            raise _Blocked(parts, stat.S_ISLNK(mode)) from None

    def forget(self, parts: tuple[str, ...]) -> None:
        """Close the descriptors of ``parts`` and of everything below it (it was removed)."""
        n = len(parts)
        for key in [k for k in self._open if k[:n] == parts]:
            os.close(self._open.pop(key))

    def trim(self) -> None:
        if len(self._open) > self.KEEP:
            for key in list(self._open)[: len(self._open) - self.KEEP // 2]:
                os.close(self._open.pop(key))

    def close(self) -> None:
        for fd in self._open.values():
            os.close(fd)
        self._open.clear()
        os.close(self.root)


def _remove_at(parent: int, name: str) -> None:
    """Remove the entry ``name`` of the folder ``parent`` and, for a folder, everything below it (no links
    followed; the depth is bounded by MAX_DEPTH)."""
    if not stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
        os.unlink(name, dir_fd=parent)
        return
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    try:
        with os.scandir(fd) as entries:
            names = [entry.name for entry in entries]
        for child in names:
            _remove_at(fd, child)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=parent)


def _raise_local(exc: OSError, uri: str, what: str) -> NoReturn:
    """Raise what a failure of the local disk while extracting is: StorageFull for a full disk or quota; the
    error itself for permissions (the storage error map makes it StorageAccessDenied); otherwise a
    CheckpointError. None of them is retried or reported as trouble with the network."""
    if exc.errno in _DENIED_ERRNOS:
        raise exc
    if exc.errno in _FULL_ERRNOS:
        raise StorageFull(f"could not load {uri}: no space left on the local disk a load extracts to while "
                          f"writing {what!r} ({type(exc).__name__}: {exc.strerror}). Free some space and try "
                          "again; nothing was lost.") from exc
    raise CheckpointError(f"could not extract {what!r} of the checkpoint at {uri} into the local workspace "
                          f"({type(exc).__name__}: {exc}); the local file system cannot hold it.") from exc


def extract_tar(source: IO[bytes], staging: Path, uri: str, *, max_expand: int | None = None,
                only: Sequence[str] | None = None) -> None:
    """Extract the tar stream ``source`` (already decompressed) below ``staging``, refusing unsafe members.

    Nothing is created outside ``staging``: every member is written relative to a descriptor of its folder,
    opened one component at a time without following links; a member whose path passes through a symlink
    (even one that stays inside) is refused. ``max_expand`` (the load's ``Checkpoint(max_expand=...)``;
    None: :data:`MAX_EXPAND`) caps the bytes
    the archive may expand to; the free space of ``staging``'s file system caps them too (StorageFull).
    The stream is read to its end, so that the codec verifies its trailing checksums. ``only`` (normalized
    relative paths, :func:`~.index.normalize_paths`): extract just the entries they name, folders with what lies
    below them, skipping the others' data (an archive without an index); KeyError naming a path that matched
    nothing.
    """
    root = os.path.realpath(staging)
    budget = SpaceBudget(root, uri, max_expand if max_expand is not None else MAX_EXPAND)
    folders = _Folders(os.open(root, _DIR_FLAGS))
    dir_modes: list[tuple[tuple[str, ...], int, float]] = []
    links: list[tuple[str, ...]] = []
    try:
        reader = _TarReader(source)
        matched: set[str] = set()
        while (member := reader.next()) is not None:
            folders.trim()
            if only is not None:
                chosen = covered("/".join(_member_parts(uri, member)), only)
                if chosen is None:
                    reader.skip(member.size if member.isreg() else 0)
                    continue
                matched.add(chosen)
            _extract_member(reader, member, folders, uri, budget, dir_modes, links)
        _check_trailing(source)
        missing = [p for p in only or () if p not in matched]
        if missing:
            raise KeyError(f"not in the checkpoint at {uri}: {', '.join(map(repr, missing))}")
        try:
            # A link created early can point through a link created later; check where each one ends up now.
            for parts in links:
                if not _resolves_inside(root, parts):
                    raise UnsafeArchiveError(
                        f"the checkpoint at {uri} holds a symlink {'/'.join(parts)!r} that resolves outside the "
                        "workspace (or through more than 40 links); nothing was extracted outside, and the "
                        "archive was refused")
            _apply_dir_modes(folders, dir_modes)
        except OSError as exc:
            _raise_local(exc, uri, "the extracted tree")
    except (tarfile.TarError, ValueError, OverflowError, RecursionError, *DECODE_ERRORS) as exc:  # type: ignore[misc]
        raise CheckpointCorruptError(
            f"the checkpoint at {uri} is damaged ({type(exc).__name__}: {exc}); it could not be extracted. "
            "Save a new checkpoint, or load an older one."
        ) from exc
    finally:
        folders.close()


def _check_trailing(source: IO[bytes]) -> None:
    """Read to the end of the stream (the codec checks its checksums): only zeros, at most MAX_TRAILING."""
    seen = 0
    while data := source.read(BLOCK_SIZE):
        seen += len(data)
        if seen > MAX_TRAILING or data.strip(b"\0"):
            raise tarfile.ReadError("data after the end-of-archive marker")


def _apply_dir_modes(folders: _Folders, dir_modes: list[tuple[tuple[str, ...], int, float]]) -> None:
    """Folders get their modes and times last (deepest first), so that a read-only folder could be filled."""
    for parts, mode, mtime in reversed(dir_modes):
        try:
            fd = os.open(parts[-1], _DIR_FLAGS, dir_fd=folders.get(parts[:-1], create=False))
        except (_Blocked, FileNotFoundError, NotADirectoryError):
            continue  # replaced by a later member
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            continue
        try:
            os.chmod(fd, mode)
            os.utime(fd, (mtime, mtime))
        finally:
            os.close(fd)


def _resolves_inside(root: str, parts: tuple[str, ...]) -> bool:
    """Whether the symlink ``parts`` below ``root`` leads to a place below ``root``, resolving every link on
    the way as the kernel would (a missing component leaves the rest lexical); False beyond MAX_LINK_HOPS."""
    todo = list(reversed(parts))
    done: list[str] = []
    hops = 0
    while todo:
        part = todo.pop()
        if part in ("", "."):
            continue
        if part == "..":
            if not done:
                return False
            done.pop()
            continue
        path = os.path.join(root, *done, part)
        try:
            is_link = stat.S_ISLNK(os.lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            is_link = False
        if not is_link:
            done.append(part)
            continue
        hops += 1
        target = os.readlink(path)
        if hops > MAX_LINK_HOPS or target.startswith("/"):
            return False
        todo.extend(reversed(target.split("/")))
    return True


def _unsafe(uri: str, member: tarfile.TarInfo, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(
        f"the checkpoint at {uri} holds an unsafe member {member.name!r}: {why}. Nothing is written outside "
        "the workspace; the archive was refused. Only load checkpoints from sources you trust."
    )


def _member_parts(uri: str, member: tarfile.TarInfo) -> tuple[str, ...]:
    name = member.name
    # POSIX names: only "/" separates, and only a leading "/" is absolute. A backslash or "C:" is part of a
    # name here (extraction needs openat and O_NOFOLLOW, so it runs on POSIX only), and escapes nothing.
    if name.startswith("/") or os.path.isabs(name):
        raise _unsafe(uri, member, "absolute path")
    parts = tuple(p for p in name.split("/") if p not in ("", "."))
    if ".." in parts:
        raise _unsafe(uri, member, "'..' in its path")
    if len(parts) > MAX_DEPTH or len(name) > MAX_PATH_BYTES or len(os.fsencode(name)) > MAX_PATH_BYTES:
        raise _unsafe(uri, member, f"its path is deeper than {MAX_DEPTH} folders or longer than {MAX_PATH_BYTES} "
                                   "bytes")
    return parts


def _extract_member(tar: _TarReader, member: tarfile.TarInfo, folders: _Folders, uri: str, budget: SpaceBudget,
                    dir_modes: list[tuple[tuple[str, ...], int, float]], links: list[tuple[str, ...]]) -> None:
    parts = _member_parts(uri, member)
    if not (member.isreg() or member.isdir() or member.issym() or member.islnk()):
        raise _unsafe(uri, member, "device, fifo or special file")
    if not parts:
        if member.isdir():
            return  # the archive's root folder itself
        raise _unsafe(uri, member, "it names the workspace folder itself")
    name, parent_parts = parts[-1], parts[:-1]
    if member.issym():
        link = member.linkname
        if not link or link.startswith(("/", "\\")) or os.path.isabs(link) or len(link) > MAX_PATH_BYTES:
            raise _unsafe(uri, member, f"symlink to an absolute or empty path {link!r}")
        if link_leaves(len(parent_parts), link):
            raise _unsafe(uri, member, f"symlink {link!r} leads outside")
    budget.charge(member.size if member.isreg() else 0, what=member.name, folder=member.isdir())
    try:
        parent = folders.get(parent_parts)
        if member.isdir():
            _make_dir(parent, name, parts, folders)
            dir_modes.append((parts, member.mode & 0o777, member.mtime))
            return
        if member.issym():
            _place(lambda: os.symlink(member.linkname, name, dir_fd=parent), parent, parts, folders)
            links.append(parts)
            return
        if member.islnk():
            _hard_link(member, uri, parent, parts, folders)
            return
        fd = _place(lambda: os.open(name, _FILE_FLAGS, 0o600, dir_fd=parent), parent, parts, folders)
    except _Blocked as blocked:
        where = "/".join(blocked.parts)
        if blocked.link:
            raise _unsafe(uri, member, f"its path goes through the symlink {where!r}; nothing is written "
                                       "through a link") from None
        raise CheckpointCorruptError(f"the checkpoint at {uri} is damaged: member {member.name!r} lies below "
                                     f"{where!r}, which is not a folder") from None
    except OSError as exc:
        _raise_local(exc, uri, member.name)
    try:
        try:
            tar.copy_data(fd, member.size)  # storage errors while reading pass unchanged: the caller retries them
        except DestinationError as exc:
            _raise_local(exc.original, uri, member.name)
        try:
            os.fchmod(fd, member.mode & 0o777)  # setuid, setgid and sticky bits are dropped
            os.utime(fd, (member.mtime, member.mtime))
        except OSError as exc:
            _raise_local(exc, uri, member.name)
    finally:
        os.close(fd)


def _place(create: Callable[[], T], parent: int, parts: tuple[str, ...], folders: _Folders) -> T:
    """``create()`` the entry ``parts`` in ``parent``; whatever a previous member left under that name is
    removed first (a later member replaces an earlier one, as tar does)."""
    try:
        return create()
    except FileExistsError:
        _remove_at(parent, parts[-1])
        folders.forget(parts)
        return create()


def _make_dir(parent: int, name: str, parts: tuple[str, ...], folders: _Folders) -> None:
    try:
        os.mkdir(name, 0o700, dir_fd=parent)
    except FileExistsError:
        if stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode):
            return  # a folder listed twice, or created for an earlier member below it
        _remove_at(parent, name)
        folders.forget(parts)
        os.mkdir(name, 0o700, dir_fd=parent)


def _hard_link(member: tarfile.TarInfo, uri: str, parent: int, parts: tuple[str, ...], folders: _Folders) -> None:
    link = member.linkname
    link_parts = tuple(p for p in link.split("/") if p not in ("", "."))
    if link.startswith("/") or ".." in link_parts or not link_parts or len(link_parts) > MAX_DEPTH:
        raise _unsafe(uri, member, f"hard link to {link!r} outside the archive")

    def create() -> None:
        # Resolved again after a removal: the source's folder may have been below the replaced entry.
        try:
            source_dir = folders.get(link_parts[:-1], create=False)
            is_file = stat.S_ISREG(os.stat(link_parts[-1], dir_fd=source_dir, follow_symlinks=False).st_mode)
        except (FileNotFoundError, _Blocked):
            is_file = False
        if not is_file:
            raise _unsafe(uri, member, f"hard link to {link!r}, which is not a file extracted before it (through "
                                       "no symlink)")
        os.link(link_parts[-1], parts[-1], src_dir_fd=source_dir, dst_dir_fd=parent, follow_symlinks=False)

    _place(create, parent, parts, folders)
