"""The local folder where loads land: a private temp folder, or one the caller chose, never shared.

Also the one place that knows how taskpoint names what a process owns on this host (``<prefix><host>-<pid>-<random>``,
or with an :func:`owner_tag`, ``<prefix><host>-<pid>-<start>-<random>``) and how to remove what killed processes
left behind (:func:`sweep_dead`): temp folders (:func:`sweep_dead_folders`: private workspaces here,
background-save snapshots in the manager) and staging segments (:func:`taskpoint.manager.staging.sweep_dead_segments`).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

from .errors import CheckpointError
from .signals import register_leftovers, uninterrupted
from .storage import normalize_uri
from .storage.backends import LEFTOVER_GRACE_SECONDS

#: Prefix of the folders where a load is staged until it is verified; they live inside the workspace.
STAGING_PREFIX = ".taskpoint-staging-"
#: Start of the names of private workspaces in the temp folder: ``taskpoint-<host>-<pid>-<random>``.
WORKSPACE_PREFIX = "taskpoint-"
#: A process sweeps a temp folder for dead processes' workspaces at most this often (a listing of it).
SWEEP_INTERVAL_SECONDS = 60.0


class Staging:
    """``with Staging(workspace) as staging:`` a new folder in ``workspace`` where a load is staged until it is
    verified, removed when the block ends however it ends. Made and removed :func:`uninterrupted
    <taskpoint.signals.uninterrupted>`, so that a signal ending the load (SIGTERM in the command line, Ctrl-C)
    never leaves it behind halfway removed, nor between its creation and the block (a class, so that nothing
    runs in between). A signal can still land as the block's end begins, before the removal starts: the
    folders not yet removed are kept here, process-wide like the signal, and :meth:`remove_all` removes them
    (:func:`taskpoint.signals.remove_leftovers`: the command line when a command ends; and this process's exit)."""

    _open: set[Path] = set()
    _guard = threading.Lock()
    _exit_hook = False

    def __init__(self, workspace: Path) -> None:
        self._workspace = workspace
        self._path: Path | None = None

    def __enter__(self) -> Path:
        try:
            with uninterrupted():
                self._path = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self._workspace))
                with self._guard:
                    if not Staging._exit_hook:
                        atexit.register(Staging.remove_all)
                        register_leftovers(Staging.remove_all)
                        Staging._exit_hook = True
                    self._open.add(self._path)
        except BaseException:
            self._remove()  # a signal held meanwhile ends the load here
            raise
        return self._path

    def __exit__(self, *exc: object) -> None:
        self._remove()

    def _remove(self) -> None:
        with uninterrupted():
            if self._path is not None:
                shutil.rmtree(self._path, ignore_errors=True)
                with self._guard:
                    self._open.discard(self._path)

    @classmethod
    def remove_all(cls) -> None:
        """Remove the staging folders of this process that a signal kept from their removal."""
        with uninterrupted():
            with cls._guard:
                paths, cls._open = list(cls._open), set()
            for path in paths:
                shutil.rmtree(path, ignore_errors=True)


def host_tag() -> str:
    """This host, as 8 hex digits in the names of the folders its processes own."""
    return f"{zlib.crc32(socket.gethostname().encode()):08x}"


def process_start(pid: int) -> int:
    """When process ``pid`` started (clock ticks since boot, ``/proc/<pid>/stat``); 0 where that is unknown
    (no ``/proc``), and -1 when there is no such process, or only its zombie (killed, not reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()
        return -1 if fields[0] == b"Z" else int(fields[19])  # state, starttime: fields 3 and 22 of the file
    except FileNotFoundError:
        return -1 if os.path.isdir("/proc") else 0
    except (OSError, IndexError, ValueError):
        return 0


def owner_tag(pid: int) -> str:
    """``<host>-<pid>-<start>``: the part of a name that says which process owns it; the start time tells a dead
    owner from another process that reuses its pid."""
    return f"{host_tag()}-{pid}-{max(process_start(pid), 0)}"


def process_alive(pid: int) -> bool:
    """True when a process ``pid`` exists (ours or someone else's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # someone else's process
    return True


def how_it_ended(process: subprocess.Popen[bytes], within: float) -> str:
    """How ``process`` ended, for a message (``killed by SIGKILL``, ``exit status 1``), waited for up to ``within``
    seconds: a killed process closes its pipes before it can be reaped, and the rest of a process whose main thread
    ended goes on for a while. ``still ending`` when it has not ended by then."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(within)
    code = process.poll()
    if code is None:
        return "still ending"
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"killed by signal {-code}"


def owner_gone(pid: int, start: int | None) -> bool:
    """Whether the process that named something is gone: no process ``pid`` runs, or one started at another time
    than ``start`` (None: a name without it)."""
    running = process_start(pid) if start is not None else 0
    return not (running == start or (running == 0 and process_alive(pid)))


def sweep_dead(folder: str | os.PathLike[str], prefix: str, remove: Callable[[str], None],
               keep: Callable[[os.DirEntry[str]], bool] | None = None) -> list[Path]:
    """Remove with ``remove`` the entries of ``folder`` named ``<prefix><owner tag>-<random>`` (or
    ``<prefix><host>-<pid>-<random>``, without the owner's start) by processes of this host that are gone
    (:func:`owner_gone`), unless ``keep`` keeps them; return those removed. An entry whose owner runs is never
    touched. Best effort: what cannot be listed or removed (``remove`` raised OSError) stays."""
    pattern = re.compile(re.escape(prefix) + r"(?P<host>[0-9a-f]{8})-(?P<pid>\d+)-(?:(?P<start>\d+)-)?[^/]+")
    host = host_tag()
    try:
        entries = list(os.scandir(folder))
    except OSError:
        return []
    removed: list[Path] = []
    for entry in entries:
        match = pattern.fullmatch(entry.name)
        if match is None or match["host"] != host:
            continue
        try:
            if not owner_gone(int(match["pid"]), None if match["start"] is None else int(match["start"])) or (
                    keep is not None and keep(entry)):
                continue
            remove(entry.path)
        except OSError:
            continue
        removed.append(Path(entry.path))
    return removed


def owned_folder(prefix: str, parent: str | os.PathLike[str] | None = None) -> Path:
    """A new private folder ``<prefix><host>-<pid>-<random>`` in ``parent`` (the temp folder by default), named so
    that :func:`sweep_dead_folders` can tell whether its process is gone (a documented name, without the start
    time an :func:`owner_tag` adds: the sweep's grace covers a reused pid)."""
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{host_tag()}-{os.getpid()}-", dir=parent))


def sweep_dead_folders(folder: str | os.PathLike[str], prefix: str) -> list[Path]:
    """Remove the folders named by :func:`owned_folder` with ``prefix`` in ``folder`` that killed processes of
    this host left; return them. Only folders whose process is gone and that are older than
    :data:`LEFTOVER_GRACE_SECONDS`: a pid namespace that shares the folder but not our view of its processes keeps
    its live ones."""
    cutoff = time.time() - LEFTOVER_GRACE_SECONDS

    def young(entry: os.DirEntry[str]) -> bool:
        return not entry.is_dir(follow_symlinks=False) or entry.stat(follow_symlinks=False).st_mtime > cutoff

    return sweep_dead(folder, prefix, lambda path: shutil.rmtree(path, ignore_errors=True), young)


class Workspace:
    """The local folder of one Checkpoint: private temp folder, or one the caller chose.

    A private folder is created when :attr:`path` is first read, not before: a Checkpoint that only saves
    never makes one. It is made in the temp folder, after removing the workspaces that killed processes of
    this host left there (:func:`sweep_dead_folders`). A folder the caller chose is made at once.
    """

    _in_use: set[str] = set()
    _to_remove: set[str] = set()
    _swept: dict[str, float] = {}
    _guard = threading.Lock()
    _exit_hook = False

    def __init__(self, folder: str | os.PathLike[str] | None) -> None:
        self._lock = threading.Lock()
        self._path: Path | None = None
        self._closed = False
        self.owned = folder is None
        self._key: str | None = None
        if folder is not None:
            # The caller's own folder: made at once (it is kept after close, and never piles up).
            chosen = Path(normalize_uri(folder, "workspace")).absolute()
            chosen.mkdir(parents=True, exist_ok=True)
            self._claim(str(chosen.resolve()))  # refused when another open Checkpoint uses it
            self._path = chosen

    @property
    def created(self) -> bool:
        """True once the folder exists (once :attr:`path` was read)."""
        return self._path is not None

    @property
    def path(self) -> Path:
        """The folder, created on first use. CheckpointError when closed before it was ever used."""
        with self._lock:
            if self._path is None:
                if self._closed:
                    raise CheckpointError("this workspace was closed before it was used; it has no folder")
                self._path = self._create()
            return self._path

    def _create(self) -> Path:
        parent = tempfile.gettempdir()
        self._sweep(parent)
        path = owned_folder(WORKSPACE_PREFIX, parent)
        self._claim(str(path.resolve()), remove_at_exit=True)
        return path

    @classmethod
    def _sweep(cls, parent: str) -> None:
        """Remove dead processes' workspaces from ``parent``, at most every SWEEP_INTERVAL_SECONDS."""
        now = time.monotonic()
        with cls._guard:
            last = cls._swept.get(parent)
            if last is not None and now - last < SWEEP_INTERVAL_SECONDS:
                return
            cls._swept[parent] = now
        sweep_dead_folders(parent, WORKSPACE_PREFIX)

    def _claim(self, key: str, *, remove_at_exit: bool = False) -> None:
        with self._guard:
            if not Workspace._exit_hook:
                atexit.register(Workspace.remove_all)
                Workspace._exit_hook = True
            if key in self._in_use:
                raise ValueError(f"workspace {key} is already used by another open Checkpoint")
            self._in_use.add(key)
            if remove_at_exit:
                self._to_remove.add(key)
        self._key = key

    def close(self) -> None:
        with self._lock:
            self._closed = True
            path = self._path
        if self._key is not None:
            with self._guard:
                self._in_use.discard(self._key)
                self._to_remove.discard(self._key)
        if path is None:
            return
        if self.owned:
            shutil.rmtree(path, ignore_errors=True)
        else:
            for leftover in path.glob(STAGING_PREFIX + "*"):
                shutil.rmtree(leftover, ignore_errors=True)

    @classmethod
    def remove_all(cls) -> None:
        with cls._guard:
            paths, cls._to_remove = list(cls._to_remove), set()
        for path in paths:
            shutil.rmtree(path, ignore_errors=True)
