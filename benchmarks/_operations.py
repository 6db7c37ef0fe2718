"""The operations being timed: one save or one load of one payload, by one method, on one store.

Methods:

* ``taskpoint`` / ``taskpoint-async``: ``Checkpoint.save_sync``/``load_sync``, or ``save``/``load`` under
  ``anyio.run`` (timed inside the event loop); ``taskpoint`` passes ``progress=False``, and
  ``taskpoint-progress`` an fsspec ``Callback`` (what progress reporting costs);
* ``baseline``, the Flyte-style way: a directory becomes ``tarfile`` ``"w:gz"`` at compresslevel 9 of its
  top-level entries in a temp file, then ``put_file``; load is ``get_file`` to a temp file, then
  ``extractall``. A file is ``put_file``/``get_file`` as it is, and bytes go through a temp file first
  (Flyte's ``SyncCheckpoint.write``) and are read back into memory after ``get_file`` (``read``);
* ``raw``, the limit: fsspec ``put``/``get`` of the same bytes with no archive (recursive for a
  directory); on local disk a plain copy (``shutil.copytree``/``copyfile``, which Linux serves with
  in-kernel copies from the page cache) with no fsync;
* ``raw-fsync`` (local disk only, for reference): the same copy, then an fsync of every file and folder
  written, the durability taskpoint's atomic local save pays for;
* ``manager`` (directory only): issue 5's background saves through ``CheckpointManager``, four operations of
  their own instead of save and load (``benchmarks/_background.py``).

Every object of a case lives under one prefix (``<store root>/<method>/<payload>/``) that the runner
deletes between runs.
"""

from __future__ import annotations

import os
import shutil
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

METHODS = ("taskpoint", "taskpoint-progress", "taskpoint-async", "baseline", "raw", "raw-fsync", "manager", "dcp",
           "preemption", "agreement", "dedup", "subset", "tiers", "lightning", "fast", "format", "broadcast",
           "latency", "throttle", "async", "async-big", "async-many")
PAYLOADS = ("directory", "file", "bytes", "small")
#: Payloads held in memory (``bytes`` objects) rather than read from a path by the save.
IN_MEMORY = ("bytes", "small")
OPS = ("save", "load")
STORES = ("local", "s3")

#: Object names under a case's prefix.
TASKPOINT_OBJECT = "checkpoint"
BASELINE_ARCHIVE = "checkpoint.tar.gz"
FILE_NAME = "model.bin"
BYTES_NAME = "payload"
#: The level of the Flyte-style baseline (Python's gzip default, which flytekit's tar keeps).
BASELINE_LEVEL = 9
_COPY_BLOCK = 1 << 20


def applies(method: str, payload: str, store: str) -> bool:
    """The async twin is only compared on the directory (the issue's async target), and so is the manager's
    background save (issue 5's target, ``benchmarks/_background.py``); raw-fsync is local only. ``dcp`` is a
    section of its own, with its own data (``benchmarks/_dcp.py``), and so are ``preemption`` (``_preemption.py``),
    ``agreement`` (``_agreement.py``), ``dedup`` (``_dedup.py``) and ``subset`` (``_subset.py``)."""
    if method in ("dcp", "preemption", "agreement", "dedup", "subset"):
        return False
    if method in ("taskpoint-async", "manager"):
        return payload == "directory"
    if method == "raw-fsync":
        return store == "local"
    return True


@dataclass
class Case:
    """What one worker does: the JSON spec the runner hands it, as an object."""

    method: str
    payload: str
    op: str
    store: str
    source: str  # the data set's payload (save) - for bytes, the file read into memory before timing
    prefix: str  # local folder path or "s3://bucket/..." of this case's objects
    workspace: str  # load: an empty folder that receives the result
    storage_options: dict[str, Any]
    codec: str = "gzip"
    level: int | None = None
    # The manager's training loop (benchmarks/_background.py): iterations, kind of work, units of work per
    # iteration (0: calibrate to ``iteration_seconds``, the blocking save's time).
    iterations: int = 0
    work: str = "numpy"
    work_units: int = 0
    iteration_seconds: float = 0.0

    @property
    def remote(self) -> bool:
        return self.store != "local"

    def url(self, name: str) -> str:
        return f"{self.prefix}/{name}"


class Operation:
    """Prepared before the clock starts; ``run`` does the timed work and returns its seconds."""

    def __init__(self, case: Case) -> None:
        import fsspec

        self.case = case
        self.fs, _ = fsspec.core.url_to_fs(case.prefix, **case.storage_options)
        self.data: bytes | None = None
        if case.op == "save" and case.payload in IN_MEMORY:
            self.data = Path(case.source).read_bytes()
        if case.remote:  # connect (session, credentials) before timing, for every method alike
            self.fs.ls(case.prefix.split("://", 1)[1].split("/", 1)[0])
        self._run: Callable[[], float] = getattr(self, f"_{case.method.replace('-', '_')}")()

    def run(self) -> float:
        return self._run()

    # -- taskpoint -------------------------------------------------------------------------------------

    def _checkpoint(self) -> Any:
        import taskpoint

        c = self.case
        obj = c.url(TASKPOINT_OBJECT)
        if c.op == "save":
            return taskpoint.Checkpoint(obj, storage_options=c.storage_options or None, codec=c.codec,
                                        level=c.level)
        return taskpoint.Checkpoint(c.url("unused-destination"), obj, storage_options=c.storage_options or None,
                                    workspace=c.workspace)

    def _save_argument(self) -> Any:
        return self.data if self.case.payload in IN_MEMORY else Path(self.case.source)

    def _taskpoint_progress(self) -> Callable[[], float]:
        """``taskpoint`` with an fsspec callback told of every update (what ``progress=`` costs)."""
        from fsspec.callbacks import Callback

        return self._taskpoint(Callback())

    def _taskpoint(self, progress: Any = False) -> Callable[[], float]:
        cp = self._checkpoint()
        arg = self._save_argument()
        if self.case.payload == "small":  # untimed first call: the steady state of frequent small saves
            if self.case.op == "save":
                cp.save_sync(arg)
            else:
                import taskpoint

                with taskpoint.Checkpoint(self.case.url("unused-destination"), self.case.url(TASKPOINT_OBJECT),
                                          storage_options=self.case.storage_options or None) as warm:
                    warm.load_sync()

        def run() -> float:
            t0 = time.perf_counter()
            if self.case.op == "save":
                cp.save_sync(arg, progress=progress)
            else:
                result = cp.load_sync(progress=progress)
                assert result is not None, "nothing to load"
            return time.perf_counter() - t0

        return run

    def _taskpoint_async(self) -> Callable[[], float]:
        import anyio

        cp = self._checkpoint()
        arg = self._save_argument()

        async def timed() -> float:
            t0 = time.perf_counter()
            if self.case.op == "save":
                await cp.save(arg)
            else:
                result = await cp.load()
                assert result is not None, "nothing to load"
            return time.perf_counter() - t0

        return lambda: anyio.run(timed)

    # -- Flyte-style baseline --------------------------------------------------------------------------

    def _baseline(self) -> Callable[[], float]:
        c = self.case
        fs = self.fs
        ws = Path(c.workspace)

        def save_directory() -> None:
            with tempfile.TemporaryDirectory() as tmp:
                archive = os.path.join(tmp, BASELINE_ARCHIVE)
                with tarfile.open(archive, "w:gz", compresslevel=BASELINE_LEVEL) as tar:
                    for entry in sorted(os.listdir(c.source)):
                        tar.add(os.path.join(c.source, entry), arcname=entry)
                fs.put_file(archive, c.url(BASELINE_ARCHIVE))

        def load_directory() -> None:
            with tempfile.TemporaryDirectory() as tmp:
                archive = os.path.join(tmp, BASELINE_ARCHIVE)
                fs.get_file(c.url(BASELINE_ARCHIVE), archive)
                with tarfile.open(archive, "r:gz") as tar:
                    tar.extractall(ws)  # what Flyte does; the data set is trusted

        def save_file() -> None:
            fs.put_file(c.source, c.url(FILE_NAME))

        def load_file() -> None:
            fs.get_file(c.url(FILE_NAME), str(ws / FILE_NAME))

        def save_bytes() -> None:
            assert self.data is not None
            with tempfile.TemporaryDirectory() as tmp:
                staged = os.path.join(tmp, BYTES_NAME)
                with open(staged, "wb") as f:
                    f.write(self.data)
                fs.put_file(staged, c.url(BYTES_NAME))

        def load_bytes() -> None:
            target = ws / BYTES_NAME
            fs.get_file(c.url(BYTES_NAME), str(target))
            target.read_bytes()

        table = {("save", "directory"): save_directory, ("load", "directory"): load_directory,
                 ("save", "file"): save_file, ("load", "file"): load_file,
                 ("save", "bytes"): save_bytes, ("load", "bytes"): load_bytes,
                 ("save", "small"): save_bytes, ("load", "small"): load_bytes}
        return _timed(table[c.op, c.payload])

    # -- raw limit -------------------------------------------------------------------------------------

    def _raw(self) -> Callable[[], float]:
        c = self.case
        fs = self.fs
        ws = Path(c.workspace)
        name = {"directory": TASKPOINT_OBJECT, "file": FILE_NAME, "bytes": BYTES_NAME, "small": BYTES_NAME}[c.payload]
        remote = c.url(name)

        def save() -> None:
            if c.payload in IN_MEMORY:
                assert self.data is not None
                if c.remote:
                    fs.pipe_file(remote, self.data)
                else:
                    with open(remote, "wb") as f:
                        f.write(self.data)
            elif c.payload == "directory":
                if c.remote:
                    fs.put(c.source, remote, recursive=True)
                else:
                    shutil.copytree(c.source, remote)
            elif c.remote:
                fs.put_file(c.source, remote)
            else:
                shutil.copyfile(c.source, remote)

        def load() -> None:
            local = str(ws / name)
            if c.payload == "directory":
                if c.remote:
                    fs.get(remote, local, recursive=True)
                else:
                    shutil.copytree(remote, local)
            elif c.remote:
                fs.get_file(remote, local)
            else:
                shutil.copyfile(remote, local)

        return _timed(save if c.op == "save" else load)

    def _raw_fsync(self) -> Callable[[], float]:
        c = self.case
        copy = self._raw()
        name = {"directory": TASKPOINT_OBJECT, "file": FILE_NAME, "bytes": BYTES_NAME, "small": BYTES_NAME}[c.payload]
        written = c.url(name) if c.op == "save" else str(Path(c.workspace) / name)

        def run() -> float:
            t0 = time.perf_counter()
            copy()
            fsync_tree(written)
            return time.perf_counter() - t0

        return run

    # -- after the clock -------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        """What the worker records after the clock: the stored bytes of a save, the loaded bytes of a load."""
        if self.case.op == "save":
            return {"stored_bytes": self.stored_bytes()}
        return {"loaded_bytes": self.loaded_bytes()}

    def stored_bytes(self) -> int:
        """Bytes now stored under the case's prefix (the archive, or the raw copy), manifests excluded."""
        if not self.case.remote:
            return sum(p.stat().st_size for p in Path(self.case.prefix).rglob("*")
                       if p.is_file() and not p.name.endswith(".taskpoint.json"))
        self.fs.invalidate_cache()
        sizes = self.fs.du(self.case.prefix, total=False)
        return sum(n for path, n in sizes.items() if not path.endswith(".taskpoint.json"))

    def loaded_bytes(self) -> int:
        """Bytes of regular files now in the workspace (the loaded result)."""
        return sum(p.stat().st_size for p in Path(self.case.workspace).rglob("*")
                   if p.is_file() and not p.is_symlink())


def fsync_tree(path: str | os.PathLike[str]) -> None:
    """fsync every file and folder at or below ``path``, and its parent folder."""
    path = os.fspath(path)
    paths = [path]
    if os.path.isdir(path):
        for folder, _, files in os.walk(path):
            paths.append(folder)
            paths.extend(os.path.join(folder, f) for f in files)
    paths.append(os.path.dirname(path))
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _timed(fn: Callable[[], None]) -> Callable[[], float]:
    def run() -> float:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return run
