"""Folder-style checkpoints: a source that is a folder (local disk) or a prefix with objects under it.

flytekit 1.x's ``SyncCheckpoint`` saves a folder as separate objects under a prefix, one per file. Such a
source loads here as a directory checkpoint: the prefix is listed once, every object is downloaded and checked
against its listed size (a size that differs, or an object that vanished meanwhile, is
:class:`~taskpoint.errors.CheckpointCorruptError`), written below a staging folder inside the workspace (a key
with ``..``, an empty or ``.`` part, or an absolute path is :class:`~taskpoint.errors.UnsafeArchiveError`,
before anything is written), and published into the workspace only when complete, as a directory checkpoint's
load is. A destination that is such a folder or prefix is refused before anything is written: a save would put
one object beside it (object stores) or fail halfway (local disk).

:mod:`taskpoint.checkpoint` calls in here from ``Checkpoint.prev_exists``, ``save_sync`` and ``load_sync``.
"""

from __future__ import annotations

import concurrent.futures
import os
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ._progress import NO_PROGRESS, Progress
from .errors import CheckpointCorruptError, CheckpointError, UnsafeArchiveError
from .format.archive import link_leaves
from .payloads import DirectoryPayload
from .signals import uninterrupted
from .storage import WRITE_PIECE, Deadline, Location, copy_fd_in_kernel
from .storage.backends import Kind
from .workspace import Staging

#: Objects downloaded at once from an object store.
DOWNLOADS_IN_FLIGHT = 8


def source_exists(src: Location) -> bool:
    """True when ``src`` holds an object, or is a folder or prefix with objects under it (which loads as a
    directory checkpoint). Only "not found" is False; a source that cannot be read raises a StorageError."""
    return src.kind() is not Kind.NOTHING


def refuse_folder_destination(dest: Location) -> None:
    """Raise :class:`~taskpoint.errors.CheckpointError` when ``dest`` is a folder or a prefix with objects under
    it (one ``stat`` on local disk, a HEAD and a listing elsewhere: the caller decides how often to ask, see
    :class:`taskpoint.save_memory.SaveMemory`)."""
    if dest.kind() is Kind.FOLDER:
        raise CheckpointError(
            f"checkpoint_dest {dest.uri} is a folder (or a prefix with objects under it), not an object. taskpoint "
            "saves a checkpoint as one object, which would land beside that folder or shadow it; nothing was "
            f"written. Save to a name that is not a folder (for instance {dest.uri.rstrip('/')}.tar.gz), or "
            "remove the folder. A folder or prefix still loads as checkpoint_src.")


@dataclass(frozen=True)
class _Entry:
    parts: tuple[str, ...]
    kind: str  # "file", "folder" or "link"
    size: int
    info: dict[str, Any]

    @property
    def relative(self) -> str:
        return "/".join(self.parts)


def load_folder(src: Location, workspace: Path, progress: Progress = NO_PROGRESS) -> Path:
    """Load the folder or prefix ``src`` into ``workspace`` as a directory checkpoint; return ``workspace``.
    ``progress`` counts the bytes of the files (the listed sizes are the total)."""
    listing = src.list_tree()  # the one listing; every size below is checked against it
    root = src.path.rstrip("/")
    if not listing:
        raise CheckpointCorruptError(f"the folder at {src.uri} vanished while it was being loaded; load it again")
    entries = _plan(listing, root, src)
    workspace.mkdir(parents=True, exist_ok=True)
    with Staging(workspace) as staging:
        folders = [e for e in entries if e.kind == "folder"]
        for entry in folders:
            os.makedirs(staging.joinpath(*entry.parts), exist_ok=True)
        files = [e for e in entries if e.kind == "file"]
        for entry in files:
            os.makedirs(staging.joinpath(*entry.parts[:-1]), exist_ok=True)
        progress.set_total(sum(e.size for e in files))
        _download_all(src, files, staging, progress)
        # Links last, so that nothing is ever written through one; then each must still resolve inside.
        root_real = os.path.realpath(staging)
        links = [e for e in entries if e.kind == "link"]
        for entry in links:
            os.symlink(entry.info["destination"], staging.joinpath(*entry.parts))
        for entry in links:
            if not _inside(root_real, os.path.realpath(staging.joinpath(*entry.parts))):
                raise _unsafe(src, entry.relative, f"a symlink to {entry.info['destination']!r} that leads outside")
        for entry in reversed(folders):
            _copy_metadata(staging.joinpath(*entry.parts), entry.info, src.is_local)
        with uninterrupted():  # a signal waits until every entry has landed
            return DirectoryPayload.publish(staging, workspace)


def _inside(root: str, target: str) -> bool:
    return target == root or target.startswith(root + os.sep)


def _unsafe(src: Location, name: str, why: str) -> UnsafeArchiveError:
    return UnsafeArchiveError(
        f"the folder checkpoint at {src.uri} holds an unsafe entry {name!r}: {why}. Nothing is written outside the "
        "workspace; the load was refused. Only load checkpoints from sources you trust.")


def _plan(listing: dict[str, dict[str, Any]], root: str, src: Location) -> list[_Entry]:
    """Every entry below ``root`` as relative parts, checked before anything is written."""
    entries: list[_Entry] = []
    for name, info in listing.items():
        name = str(name)
        if name.rstrip("/") == root:
            continue  # the folder itself (or its own marker object)
        if not name.startswith(root + "/"):
            raise _unsafe(src, name, "it is not below the folder that was listed")
        relative = name[len(root) + 1:]
        marker = relative.endswith("/")  # a zero-byte "folder marker" object of an object store
        kind = info.get("type")
        body = relative[:-1] if marker else relative
        parts = tuple(body.split("/"))
        if relative.startswith("/") or os.path.isabs(body):
            raise _unsafe(src, relative, "an absolute path")
        if any(p in ("", ".", "..") for p in parts) or any("\0" in p for p in parts):
            raise _unsafe(src, relative, "'..', '.' or an empty part in its path")
        size = int(info.get("size") or 0)
        if marker or kind == "directory":
            entries.append(_Entry(parts, "folder", 0, info))
        elif kind == "file":
            entries.append(_Entry(parts, "file", size, info))
        elif info.get("islink") and src.is_local:
            target = str(info.get("destination", ""))
            if link_leaves(len(parts) - 1, target):
                raise _unsafe(src, relative, f"a symlink to {target!r} that leads outside")
            entries.append(_Entry(parts, "link", 0, info))
        else:
            warnings.warn(f"taskpoint skipped {relative!r} in the folder checkpoint at {src.uri}: only files, "
                          "folders and symlinks are loaded", stacklevel=4)
    files = {e.parts for e in entries if e.kind != "folder"}
    parents = {e.parts[:i] for e in entries for i in range(1, len(e.parts))}
    parents |= {e.parts for e in entries if e.kind == "folder"}
    clash = sorted(files & parents)
    if clash:
        raise CheckpointCorruptError(
            f"the folder checkpoint at {src.uri} holds both an object and a folder named {'/'.join(clash[0])!r}; "
            "it cannot be loaded as a folder. Remove one of them.")
    return sorted(entries, key=lambda e: e.parts)


def _download_all(src: Location, files: list[_Entry], staging: Path, progress: Progress) -> None:
    if not files:
        return
    workers = min(len(files), DOWNLOADS_IN_FLIGHT if not src.is_local else 4)
    # Its own pool, not a lane of the shared ones (taskpoint.executors): each download reads through a lane of the
    # IO pool (ranged GETs) and waits for it, and waiting tasks on a bounded shared pool can deadlock it.
    with concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="taskpoint-folder") as pool:
        jobs = [pool.submit(_download, src, entry, staging, progress) for entry in files]
        try:
            for job in concurrent.futures.as_completed(jobs):
                job.result()
        finally:
            for job in jobs:
                job.cancel()


def _download(src: Location, entry: _Entry, staging: Path, progress: Progress) -> None:
    """One object into its place below ``staging``, retried as a whole on transient failures."""
    child = src.child(entry.relative)
    target = staging.joinpath(*entry.parts)
    counter = progress.piece()

    def once(deadline: Deadline) -> None:
        counter.restart()
        try:
            raw = child.open_read(deadline=deadline)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError) as exc:
            raise CheckpointCorruptError(
                f"{child.uri} was listed in the folder checkpoint at {src.uri} but vanished (or changed into a "
                "folder) before it was loaded; load it again") from exc
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | getattr(os, "O_NOFOLLOW", 0)
        with raw, os.fdopen(os.open(target, flags, 0o644), "wb", buffering=0) as out:
            if child.is_local:
                copied = copy_fd_in_kernel(raw.fileno(), out.fileno(),
                                           on_copied=counter.update if progress.active else None)
            else:
                copied = 0
                while chunk := raw.read(WRITE_PIECE):
                    out.write(chunk)
                    copied += len(chunk)
                    counter.update(len(chunk))
        if copied != entry.size:
            raise CheckpointCorruptError(
                f"{child.uri} in the folder checkpoint at {src.uri} holds {copied} bytes but was listed with "
                f"{entry.size}; it changed or is damaged. Load it again once nothing writes to it.")

    child.run(once, action="load the checkpoint from")
    _copy_metadata(target, entry.info, src.is_local)


def _copy_metadata(path: Path, info: dict[str, Any], local: bool) -> None:
    """Permission bits and modification time of a local source's entry (object stores have neither)."""
    if not local:
        return
    mode, mtime = info.get("mode"), info.get("mtime")
    if isinstance(mode, int):
        os.chmod(path, mode & 0o777)
    if isinstance(mtime, (int, float)):
        os.utime(path, (mtime, mtime))
