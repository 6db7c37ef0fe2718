"""Small helpers shared by the test modules: build trees, snapshot them, damage stored objects."""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import fsspec

import _zygote as zygote
from taskpoint import RetryPolicy
from taskpoint.manager import staging
from taskpoint.ranks import RANK_VARIABLES
from taskpoint.storage import Deadline
from taskpoint.storage.deadline import NO_DEADLINE
from taskpoint.workspace import host_tag, process_alive

T = TypeVar("T")


#: The default bound of :func:`wait_until`: far above what a loaded machine needs (it returns as soon as the
#: predicate holds), so that a slow machine is never mistaken for a broken promise.
POLL_TIMEOUT = 60.0


def wait_until(predicate: Callable[[], object], timeout: float = POLL_TIMEOUT) -> bool:
    """Poll ``predicate`` every 5 ms until it is true (True) or ``timeout`` seconds pass (False)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (taskpoint's own check); a zombie (killed, not reaped by its parent yet) counts
    as gone."""
    if not process_alive(pid):
        return False
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return True


#: Seconds past the grace that a save process whose trainer died may take to end: its last upload and the
#: interpreter's exit. Generous, because the bound is wall-clock time: on a loaded 2-core machine (load 6) an
#: orphan took more than the 5 s this used to allow; the assertion is that it ends by itself, not how fast.
ORPHAN_EXIT_SLACK = 60.0


def slowdown(bound: float = 12.0) -> float:
    """How many times slower than on an idle machine a process runs here now, at most ``bound``: the wall time of
    a child that imports taskpoint (the start every save process and worker pays) over the CPU time it used. 1
    when idle; about the load per core under load (10 at load 20 on 2 cores). A grace a test gives a process to
    finish its work is scaled by it, so that the machine's progress, not a constant, says how long is enough."""
    start = time.monotonic()
    pid = os.posix_spawn(sys.executable, [sys.executable, "-c", "import taskpoint"],
                         {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    _, status, usage = os.wait4(pid, 0)
    wall = time.monotonic() - start
    assert os.waitstatus_to_exitcode(status) == 0, f"python -c 'import taskpoint' ended with status {status}"
    return min(bound, max(1.0, wall / max(usage.ru_utime + usage.ru_stime, 0.01)))


def process_gone(pid: int, within: float) -> bool:
    """Whether process ``pid`` has exited within ``within`` seconds."""
    return wait_until(lambda: not pid_alive(pid), within) or not pid_alive(pid)


class AcceptLoop:
    """A TCP listener on 127.0.0.1 whose accept loop runs on a daemon thread and hands each connection to
    ``handle`` (called on that thread): the part the tests' proxies share. :meth:`close` stops the loop and
    closes the listener; the connections are the handler's."""

    def __init__(self, handle: Callable[[socket.socket], None], name: str = "test-accept") -> None:
        self._handle = handle
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port: int = self._listener.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    @property
    def stopped(self) -> bool:
        return self._stop.is_set()

    def _loop(self) -> None:
        self._listener.settimeout(0.2)
        while not self._stop.is_set():
            try:
                client, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._handle(client)

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(timeout=5)


class SilentEndpoint:
    """An endpoint on 127.0.0.1 that accepts every connection, reads each request's head, keeps it (:attr:`heads`,
    in the order they came), and never answers: a stuck server, or a port that is not the storage service's."""

    def __init__(self) -> None:
        self.heads: list[str] = []
        self._held: list[socket.socket] = []
        self._lock = threading.Lock()
        self._loop = AcceptLoop(self._take, "silent-endpoint")
        self.url = self._loop.url

    def _take(self, conn: socket.socket) -> None:
        self._held.append(conn)
        threading.Thread(target=self._read, args=(conn,), daemon=True).start()

    def _read(self, conn: socket.socket) -> None:
        data = b""
        conn.settimeout(30)
        try:
            while b"\r\n\r\n" not in data:
                chunk = conn.recv(65536)
                if not chunk:
                    return
                data += chunk
        except OSError:
            return
        with self._lock:
            self.heads.append(data.split(b"\r\n\r\n", 1)[0].decode("latin-1"))

    def requests(self) -> list[str]:
        """The request line (method, target, version) of each request read so far."""
        with self._lock:
            return [head.split("\r\n", 1)[0] for head in self.heads]

    def close(self) -> None:
        self._loop.close()
        for conn in self._held:
            conn.close()


@contextlib.contextmanager
def own_staging_folder() -> Iterator[Path]:
    """A private folder for the staging segments of this process and of the processes it starts while inside
    (``TASKPOINT_STAGING_DIR``), removed at the end: a test that counts on a dead owner's segment staying until it
    sweeps is not raced by another test's sweep of the shared ``/dev/shm`` beside it (xdist)."""
    folder = Path(tempfile.mkdtemp(prefix="taskpoint-test-staging-", dir=staging.segment_folder()))
    before = os.environ.get(staging.STAGING_DIR_VARIABLE)
    os.environ[staging.STAGING_DIR_VARIABLE] = str(folder)
    try:
        yield folder
    finally:
        if before is None:
            del os.environ[staging.STAGING_DIR_VARIABLE]
        else:
            os.environ[staging.STAGING_DIR_VARIABLE] = before
        shutil.rmtree(folder, ignore_errors=True)


def count_segment_creations(monkeypatch: Any) -> list[int]:
    """The sizes of the staging segments created from now on, in order (``Segment.create`` still creates them)."""
    made: list[int] = []
    create = staging.Segment.create.__func__  # type: ignore[attr-defined]

    def counted(cls: Any, size: int, *args: Any, **kwargs: Any) -> Any:
        made.append(size)
        return create(cls, size, *args, **kwargs)

    monkeypatch.setattr(staging.Segment, "create", classmethod(counted))
    return made


def no_such_pid() -> int:
    """A pid no process of this host has or can have (past the kernel's ``pid_max``)."""
    return int(Path("/proc/sys/kernel/pid_max").read_text()) + 1


def staged_segments(*pids: int) -> list[Path]:
    """The staging segments of this host owned by ``pids`` (by any process when none is given): each by its head, the
    file at its path (a segment is several files, ``<head>.1``, ...: taskpoint.manager.segment_files), and any other
    file of a segment whose head is gone by itself, so that no file left behind goes unseen."""
    folder = staging.segment_folder()
    found = []
    for path in folder.glob(f"{staging.SEGMENT_PREFIX}{host_tag()}-*"):
        owner = int(path.name[len(staging.SEGMENT_PREFIX):].split("-")[1])
        head = path.with_name(path.name.split(".")[0])
        if (not pids or owner in pids) and (path == head or not head.exists()):
            found.append(path)
    return found


def make_tree(root: Path, *, big: int = 0) -> Path:
    """A directory with nested and empty folders, a symlink inside the tree, odd modes, and optional bulk."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "weights.bin").write_bytes(os.urandom(1000) + bytes(50_000))
    (root / "state.json").write_text('{"step": 7}')
    (root / "nested" / "deeper").mkdir(parents=True)
    (root / "nested" / "deeper" / "notes.txt").write_text("deep")
    (root / "nested" / "run.sh").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "nested" / "run.sh", 0o755)
    os.chmod(root / "state.json", 0o640)
    (root / "empty").mkdir()
    os.symlink("nested/deeper/notes.txt", root / "link-to-notes")
    os.symlink("nested", root / "link-to-dir")
    if big:
        (root / "bulk.bin").write_bytes(os.urandom(big))
    return root


def snapshot(root: Path) -> dict[str, Any]:
    """Everything a round trip must keep: kind, permission bits, content digest or link target."""
    out: dict[str, Any] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("link", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("dir", stat.S_IMODE(st.st_mode))
            else:
                out[rel] = ("file", stat.S_IMODE(st.st_mode), hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def snapshot_with_times(root: Path) -> dict[str, Any]:
    snap = snapshot(root)
    return {k: (v, os.lstat(root / k).st_mtime_ns) for k, v in snap.items()}


def fs_options(storage_options: dict[str, Any]) -> dict[str, Any]:
    """Storage options for fsspec itself: without taskpoint's own ``s3_client``."""
    return {k: v for k, v in storage_options.items() if k != "s3_client"}


def read_object(url: str, storage_options: dict[str, Any]) -> bytes:
    fs, path = fsspec.core.url_to_fs(url, **fs_options(storage_options))
    fs.invalidate_cache()
    return fs.cat_file(path)  # type: ignore[no-any-return]


def write_object(url: str, storage_options: dict[str, Any], data: bytes) -> None:
    fs, path = fsspec.core.url_to_fs(url, **fs_options(storage_options))
    fs.pipe_file(path, data)
    fs.invalidate_cache()


def object_exists(url: str, storage_options: dict[str, Any]) -> bool:
    fs, path = fsspec.core.url_to_fs(url, **fs_options(storage_options))
    fs.invalidate_cache()
    return fs.exists(path)  # type: ignore[no-any-return]


def tar_gz(members: list[tuple[tarfile.TarInfo, bytes | None]]) -> bytes:
    """A gzip tar built member by member, for hand-made (hostile) archives."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return buf.getvalue()


def member(name: str, kind: bytes = tarfile.REGTYPE, *, linkname: str = "", mode: int = 0o644) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.mode = mode
    return info


@dataclass
class Operation:
    """One storage operation a :class:`CountingRetry` ran: its action, its URI, and what each of its attempts
    raised, in order (None: the attempt succeeded)."""

    action: str
    uri: str
    outcomes: list[BaseException | None] = field(default_factory=list)

    @property
    def attempts(self) -> int:
        return len(self.outcomes)


@dataclass(frozen=True)
class CountingRetry(RetryPolicy):
    """A retry policy that counts how often it runs each operation (to prove what is retried and what is not).

    ``runs``: the action of every attempt, in the order they began. ``operations``: one :class:`Operation` per
    call, so that a test can count attempts per operation where a save sends several at once (record.py)."""

    runs: list[str] = field(default_factory=list, compare=False)
    operations: list[Operation] = field(default_factory=list, compare=False)

    def call(self, fn: Callable[[Deadline], T], *, action: str, uri: str, endpoint: str | None = None,
             outer: Deadline = NO_DEADLINE, **throttling: Any) -> T:
        operation = Operation(action, uri)
        self.operations.append(operation)

        def counted(deadline: Deadline) -> T:
            self.runs.append(action)
            try:
                result = fn(deadline)
            except BaseException as exc:
                operation.outcomes.append(exc)
                raise
            operation.outcomes.append(None)
            return result
        return super().call(counted, action=action, uri=uri, endpoint=endpoint, outer=outer, **throttling)


def fast_counting() -> CountingRetry:
    """A :class:`CountingRetry` that retries quickly."""
    return CountingRetry(attempts=3, initial_delay=0.01, max_delay=0.02)


@contextlib.contextmanager
def mounted_tmpfs(folder: Path, options: str) -> Iterator[Path]:
    """A real tmpfs at ``folder`` with mount ``options``; skips the test where mounting is not allowed."""
    import pytest

    folder.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], capture_output=True,
                             text=True, check=False)
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({mounted.stderr.strip() or 'mount failed'}); run as root to test "
                    "a full or read-only disk")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


class RankProcess:
    """One rank of a job: ``tests/_rank_worker.py`` in a real process with ``RANK``/``WORLD_SIZE`` set (forked from
    a server that imported the store clients: tests/_zygote.py), its JSON events collected from stdout by a
    thread."""

    def __init__(self, mode: str, args: dict[str, Any], rank: int, world_size: int,
                 env: dict[str, str] | None = None) -> None:
        self.rank = rank
        child_env = {k: v for k, v in os.environ.items() if k not in RANK_VARIABLES}
        child_env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), **(env or {}))
        worker = Path(__file__).with_name("_rank_worker.py")
        self.process = zygote.spawn(zygote.STORES, [str(worker), mode, json.dumps(args)], child_env, apart=True)
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()

        def read() -> None:
            assert self.process.stdout is not None
            for line in self.process.stdout:
                with self._changed:
                    self.events.append(json.loads(line))
                    self._changed.notify_all()

        self._reader = threading.Thread(target=read, daemon=True)
        self._reader.start()

    def wait_for(self, event: str, timeout: float = 60, **fields: Any) -> dict[str, Any]:
        """The first event of this kind (with these fields); AssertionError after ``timeout`` or if the process
        ended without it."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while True:
                for found in self.events:
                    if found["event"] == event and all(found.get(k) == v for k, v in fields.items()):
                        return found
                if self.process.poll() is not None and not self._reader.is_alive():
                    break
                if time.monotonic() > deadline:
                    break
                self._changed.wait(0.05)
        raise AssertionError(f"rank {self.rank} never printed {event} {fields}: {self.events}; "
                             f"stderr: {self.stderr_tail()}")

    def stderr_tail(self) -> str:
        if self.process.poll() is None or self.process.stderr is None:
            return "(running)"
        return self.process.stderr.read()[-3000:]

    def finish(self, timeout: float = 60) -> int:
        """Wait for the process to end; its exit status."""
        status = self.process.wait(timeout)
        self._reader.join(5)
        return status

    def kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
        self.process.wait(30)
        self._reader.join(5)


class LazyModule:
    """A module imported on first attribute access, so that collecting a test module costs no framework import.

    ``torch = LazyModule("torch")`` at module level, then ``torch.zeros(3)`` in a test: each pytest-xdist worker
    collects every module, and importing Lightning, torch and JAX there took 20-30 s of CPU per worker. Pair it
    with :func:`requires` for the skip that ``pytest.importorskip`` gave. Private names are not forwarded: pytest
    looks for ``_mock_name`` and the like on every attribute of a test module.
    """

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attribute: str) -> Any:
        import importlib

        if attribute.startswith("_"):  # collection probes module attributes (fixtures, mocks): never import for it
            raise AttributeError(attribute)
        return getattr(importlib.import_module(self._name), attribute)

    def __repr__(self) -> str:
        return f"LazyModule({self._name!r})"


def requires(*modules: str) -> Any:
    """A ``skipif`` mark for a test module whose ``modules`` are not installed, found without importing them."""
    import importlib.util

    import pytest

    def missing(name: str) -> bool:
        try:
            return importlib.util.find_spec(name) is None
        except ModuleNotFoundError:  # a parent package is missing
            return True

    absent = [name for name in modules if missing(name)]
    return pytest.mark.skipif(bool(absent), reason=f"{', '.join(absent)} not installed")


#: The real launcher, installed beside python with torch.
TORCHRUN = Path(sys.executable).with_name("torchrun")


def run_torchrun(worker: Path, world: int, argument: str, within: float) -> tuple[int, str, str]:
    """Run ``worker`` with one ``argument`` on ``world`` ranks under the real ``torchrun --standalone``, to its end:
    its exit status, stdout and stderr. The ranks see this process's import path and use one OpenMP thread each. A
    job not ended within ``within`` seconds (or whose test is interrupted) is SIGKILLed whole, torchrun's agent and
    every rank (its own session), and fails the test with the tail of its stderr."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    job = subprocess.Popen([str(TORCHRUN), "--standalone", f"--nproc-per-node={world}", str(worker), argument],
                           env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = job.communicate(timeout=within)
    except BaseException as exc:
        os.killpg(job.pid, signal.SIGKILL)
        _, err = job.communicate(timeout=30)
        if isinstance(exc, subprocess.TimeoutExpired):
            raise AssertionError(f"torchrun did not end within {within:g} s:\n{err[-4000:]}") from None
        raise
    return job.returncode, out, err


class WorkerProcess:
    """A test worker script in a real process, given one JSON argument, printing one JSON event a line; its
    events collected on a thread as they come (``events``), its stderr read once it has ended. The process is
    forked from a server that imported ``modules`` once (tests/_zygote.py; none: a worker of taskpoint alone)."""

    def __init__(self, worker: Path, args: dict[str, Any], modules: tuple[str, ...] = ()) -> None:
        self.process = zygote.spawn(modules, [str(worker), json.dumps(args)], dict(os.environ), apart=True)
        self.events: list[dict[str, Any]] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.events.append(json.loads(line))

    def stopped(self) -> bool:
        """Whether the process is stopped (state T in /proc)."""
        stat = Path(f"/proc/{self.process.pid}/stat").read_text()
        return stat.rpartition(")")[2].split()[0] in ("T", "t")

    def wait_for(self, event: str, *, stopped: bool = False) -> None:
        """Until the worker has printed ``event`` (and, with ``stopped``, is stopped): at most 120 s."""
        assert wait_until(lambda: any(e["event"] == event for e in self.events) and (not stopped or self.stopped()),
                          120), (self.events, self.process.poll(), self.stderr())

    def resume(self) -> dict[str, Any]:
        """SIGCONT, then the worker's last event, once it has ended with status 0."""
        os.kill(self.process.pid, signal.SIGCONT)
        assert self.process.wait(120) == 0, self.stderr()
        self._reader.join(10)
        return self.events[-1]

    def stderr(self) -> str:
        """Its stderr once it has ended ("" while it runs); read once."""
        return self.process.stderr.read() if self.process.poll() is not None and self.process.stderr else ""

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


def flip_byte_at(path: Path, offset: int) -> None:
    """Flip every bit of the byte at ``offset`` of the file ``path`` (flipping it again mends it)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))
