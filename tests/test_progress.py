"""progress= on saves and loads: exact totals from taskpoint's own pipeline, regular updates, the bar on a terminal.

Callbacks are real ``fsspec.callbacks.Callback`` subclasses that record every call; transfers are real (local
disk, the S3 server, through the fault proxy for retries and for a slow network); the bar is looked for on a
real pseudo-terminal.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import threading
import time
from pathlib import Path

import fsspec
import pytest
from fsspec.callbacks import Callback

from _fault_proxy import fault_proxy
from taskpoint import Checkpoint, CheckpointManager, _progress
from taskpoint.format.records import RECORD_SUFFIX

LOCAL_AND_S3 = pytest.mark.parametrize("store", ["local", "s3"], indirect=True)


class Recorder(Callback):
    """Records every set_size and relative_update, in the order they came (no times: no test here times
    anything; when a count is handed over is the ticker's, checked tick by tick with :class:`ManualTicks`)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def set_size(self, size: int) -> None:
        with self._lock:
            self.events.append(("size", size))
        super().set_size(size)

    def relative_update(self, inc: int = 1) -> None:
        with self._lock:
            self.events.append(("update", inc))
        super().relative_update(inc)

    def updates(self) -> list[int]:
        return [n for kind, n in self.events if kind == "update"]

    def assert_exact(self, total: int) -> None:
        """set_size(total) before the first update, updates summing to it, and value == size at the end."""
        assert self.events, "the callback was never called"
        assert self.events[0] == ("size", total), self.events[:3]
        assert sum(self.updates()) == total
        assert self.value == self.size == total


def _tree(root: Path) -> int:
    """A folder of a few files (one incompressible); returns the bytes of its files."""
    (root / "sub").mkdir(parents=True)
    (root / "weights.bin").write_bytes(os.urandom(3 << 20))
    (root / "sub" / "notes.txt").write_bytes(b"step 10, loss 0.25\n" * 5000)
    (root / "empty").write_bytes(b"")
    os.symlink("weights.bin", root / "link")
    return (3 << 20) + 19 * 5000


def _stored_size(url: str, options: dict) -> int:
    fs, path = fsspec.core.url_to_fs(url, **options)
    return int(fs.size(path))


@pytest.fixture
def data_of(tmp_path):
    """The data of each payload kind, and the total a save's progress counts for it."""

    def make(kind: str) -> tuple[object, int]:
        if kind == "bytes":
            data = os.urandom(5 << 20)
            return data, len(data)
        if kind == "file":
            path = tmp_path / "state.bin"
            path.write_bytes(os.urandom(5 << 20))
            return path, 5 << 20
        return tmp_path / "tree", _tree(tmp_path / "tree")

    return make


@pytest.mark.parametrize("kind", ["bytes", "file", "directory"])
def test_save_and_load_report_exact_totals(store, data_of, tmp_path, kind):
    data, source_bytes = data_of(kind)
    url = store.url("ckpt")
    saved = Recorder()
    with Checkpoint(url, storage_options=store.storage_options) as cp:
        cp.save_sync(data, progress=saved)
    saved.assert_exact(source_bytes)  # a directory: the bytes of its files, before compression

    stored = _stored_size(url, store.storage_options)
    loaded = Recorder()
    with Checkpoint(store.url("next"), url, storage_options=store.storage_options) as cp:
        assert cp.load_sync(progress=loaded) is not None
    loaded.assert_exact(stored)  # a load: the stored bytes (for a directory, the compressed archive)
    if kind != "directory":
        assert stored == source_bytes


@LOCAL_AND_S3
@pytest.mark.parametrize("dedup", [False, True], ids=["payload", "dedup"])
@pytest.mark.parametrize("blocking", [True, False], ids=["blocking", "background"])
@pytest.mark.e2e("starts a save process")
def test_manager_save_and_restore_report_exact_totals(store, tmp_path, dedup, blocking):
    source_bytes = _tree(tmp_path / "tree")
    with CheckpointManager(store.url("steps"), storage_options=store.storage_options, dedup=dedup) as manager:
        saved = Recorder()
        manager.save(tmp_path / "tree", 1, progress=saved, blocking=blocking)
        manager.wait_until_finished()
        saved.assert_exact(source_bytes)

        restored = Recorder()
        manager.restore(1, into=tmp_path / "out", progress=restored)
        # A deduplicated step counts the bytes of its files; a payload step its stored (compressed) object.
        restored.assert_exact(source_bytes if dedup else manager.last_save.bytes)
    assert (tmp_path / "out" / "weights.bin").read_bytes() == (tmp_path / "tree" / "weights.bin").read_bytes()


@pytest.mark.e2e("starts a save process")
def test_a_background_save_from_the_save_process_relays_its_progress(tmp_path):
    source_bytes = _tree(tmp_path / "tree")
    with CheckpointManager(tmp_path / "steps") as manager:
        saved = Recorder()
        manager.save(tmp_path / "tree", 1, progress=saved, blocking=False)
        manager.wait_until_finished()
        assert manager._background.saver is not None  # the save process wrote it, and told this process
    saved.assert_exact(source_bytes)


def test_the_jax_handler_passes_progress_to_its_saves_and_restores(tmp_path):
    pytest.importorskip("jax")
    import numpy as np

    from taskpoint.jax import OrbaxCheckpointHandler

    weights = np.arange(200_000, dtype=np.float32)
    with OrbaxCheckpointHandler() as handler:
        saved = Recorder()
        handler.save(tmp_path / "ckpts", {"w": weights}, step=1, progress=saved)
        restored = Recorder()
        tree = handler.restore(tmp_path / "ckpts", step=1, progress=restored)
    assert np.array_equal(np.asarray(tree["w"]), weights)
    saved.assert_exact(saved.size)
    assert saved.size > 100_000  # the bytes of the files Orbax wrote for the tree, before taskpoint's compression
    # The step holds the files Orbax wrote, in place (issue 26's jax.pytree kind): a restore reads each once.
    (tree_folder,) = (p for p in (tmp_path / "ckpts" / "ckpt-1").glob("pytree-*") if p.is_dir())
    restored.assert_exact(sum(f.stat().st_size for f in tree_folder.rglob("*") if f.is_file()))


def test_a_transfer_that_starts_over_reports_only_bytes_beyond_the_furthest_point_reached():
    # What write_payload and read_payload do when a transient failure makes them start the object over.
    recorder = Recorder()
    with _progress.resolve(recorder, "save ckpt") as progress:
        progress.set_total(1000)
        progress.update(600)
        progress.restart()  # the second attempt: its first 600 bytes were counted already
        for _ in range(10):
            progress.update(100)
    recorder.assert_exact(1000)
    assert all(n > 0 for n in recorder.updates())  # never backwards


def test_a_restore_that_falls_back_counts_the_older_step_from_zero(tmp_path):
    with CheckpointManager(tmp_path / "steps") as manager:
        manager.save(b"a" * 300_000, 1)
        manager.save(os.urandom(200_000), 2)
        payload = next((tmp_path / "steps" / "ckpt-2").glob("payload-*"))
        payload.write_bytes(payload.read_bytes()[:-10] + b"0123456789")  # damaged: same size, wrong sha256
        restored = Recorder()
        with pytest.warns(UserWarning, match="step 2"):
            assert manager.restore(progress=restored, fallback=True).read_bytes() == b"a" * 300_000
    assert restored.value == restored.size == 300_000
    assert sum(restored.updates()) == 300_000


class ManualTicks(_progress.Ticks):
    """The tracker's ticks given by the test: :meth:`tick` lets the ticker thread hand the count over once and
    returns when it has; no tick comes otherwise (no clock)."""

    def __init__(self) -> None:
        super().__init__()
        self._go = threading.Semaphore(0)
        self._done = threading.Semaphore(0)
        self._waiting = False

    def wait(self) -> bool:
        if self._waiting:
            self._done.release()  # the tick before this one is handed over
        self._waiting = True
        self._go.acquire()
        return not self.stopped.is_set()

    def tick(self) -> None:
        self._go.release()
        assert self._done.acquire(timeout=60), "the ticker thread did not come back"

    def stop(self) -> None:
        super().stop()
        self._go.release()


def test_each_tick_hands_the_callback_all_that_was_counted_since_the_tick_before():
    """What the ticker promises, tick by tick: counts reach the callback at the next tick, all of them, in one
    call; a tick with nothing new calls nothing; the end hands over the rest."""
    ticks, recorder = ManualTicks(), Recorder()
    with _progress._Tracker(recorder, owned=False, ticks=ticks) as progress:
        progress.set_total(1000)
        progress.update(100)
        progress.update(50)
        assert recorder.updates() == []  # nothing before a tick
        ticks.tick()
        assert recorder.updates() == [150]
        ticks.tick()
        assert recorder.updates() == [150]  # nothing new: no call
        piece = progress.piece()
        piece.update(600)
        progress.update(100)
        ticks.tick()
        assert recorder.updates() == [150, 700]
        progress.update(150)
    recorder.assert_exact(1000)  # the last 150 at the end, without a tick


class Counted(_progress.Progress):
    """Where a transfer reports: records each count the pipeline makes, in the order it makes them."""

    active = True

    def __init__(self) -> None:
        self.counts: list[int] = []
        self._lock = threading.Lock()

    def update(self, n: int) -> None:
        with self._lock:
            self.counts.append(n)

    def _add(self, n: int) -> None:  # from the pieces of a folder's files
        self.update(n)


def test_a_slow_save_is_counted_as_its_source_is_read(tmp_path):
    """A large folder at gzip's highest level (slow on purpose): the save counts each piece of the source as it
    reads it, so that with the ticks above, updates keep coming while it runs (a count at the end only would
    leave the bar still until then)."""
    from taskpoint.format.codecs import BLOCK_SIZE, get_codec
    from taskpoint.payloads import payload_for
    from taskpoint.storage import Location
    from taskpoint.transfer import write_payload

    (tmp_path / "tree").mkdir()
    for i in range(3):
        (tmp_path / "tree" / f"part{i}.bin").write_bytes(os.urandom(32 << 20))
    saved = Recorder()
    with Checkpoint(tmp_path / "ckpt", level=9) as cp:
        cp.save_sync(tmp_path / "tree", progress=saved)
    saved.assert_exact(96 << 20)
    counted = Counted()
    write_payload(Location(str(tmp_path / "again"), {}), payload_for(tmp_path / "tree"), get_codec("gzip"), 9,
                  progress=counted)
    assert sum(counted.counts) == 96 << 20
    assert max(counted.counts) <= BLOCK_SIZE and len(counted.counts) >= 96  # a MiB at most at a time


@pytest.mark.e2e("starts the S3 server")
def test_a_slow_load_is_counted_as_each_object_arrives(tmp_path, s3_server):
    # A folder checkpoint (flytekit's layout: one object per file) read through a throttled network: the count
    # moves as each object arrives (from an object store, each request's bytes count when it completes).
    from taskpoint.folders import load_folder
    from taskpoint.storage import Location

    prefix = f"taskpoint-tests/progress-slow-{os.getpid()}-{time.monotonic_ns()}"
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    for i in range(40):
        fs.pipe(f"{prefix}/shard{i:02d}.bin", os.urandom(256 << 10))
    with fault_proxy(s3_server.endpoint, throttle=512 << 10) as proxy:
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        loaded = Recorder()
        with Checkpoint(tmp_path / "unused", f"s3://{prefix}", storage_options=options) as cp:
            assert cp.load_sync(progress=loaded) is not None
        counted = Counted()
        load_folder(Location(f"s3://{prefix}", options), tmp_path / "again", counted)
    loaded.assert_exact(40 * (256 << 10))
    assert sum(counted.counts) == 40 * (256 << 10) and len(counted.counts) >= 40
    assert max(counted.counts) <= 256 << 10  # never more than one object at a time


@pytest.mark.parametrize("client", ["s3fs", "obstore"])
@pytest.mark.e2e("starts the S3 server")
def test_a_large_object_read_through_a_slow_network_is_counted_as_its_ranges_arrive(tmp_path, s3_server, client):
    # Above 16 MiB an object comes down as 8 MiB ranges, several at once; each is counted as it streams in.
    from taskpoint.record import load_object
    from taskpoint.storage import Location
    from taskpoint.storage._s3 import RECEIVED_PIECE

    url = f"s3://taskpoint-tests/progress-ranges-{os.getpid()}-{time.monotonic_ns()}/ckpt"
    data = os.urandom(24 << 20)
    with Checkpoint(url, storage_options=s3_server.storage_options) as cp:
        cp.save_sync(data)
    with fault_proxy(s3_server.endpoint, throttle=4 << 20) as proxy:  # ~2 s for the three ranges in parallel
        options = {**s3_server.storage_options, "endpoint_url": proxy.url, "s3_client": client}
        loaded = Recorder()
        with Checkpoint(tmp_path / "unused", url, storage_options=options) as cp:
            assert cp.load_sync(progress=loaded).read_bytes() == data
        counted = Counted()
        assert load_object(Location(url, options), tmp_path / "again", counted) is not None
    loaded.assert_exact(len(data))
    assert sum(counted.counts) == len(data)
    # Each 8 MiB range counted in pieces of about RECEIVED_PIECE as it streams in (obstore's are at least that).
    assert max(counted.counts) <= 2 * RECEIVED_PIECE and len(counted.counts) >= len(data) // (2 * RECEIVED_PIECE)


# -- the bar --------------------------------------------------------------------------------------------------


def _cli_env(options: dict) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parents[1] / "src"), env.get("PYTHONPATH", "")])
    env["TASKPOINT_STORAGE_OPTIONS"] = json.dumps(options)
    env["COLUMNS"] = "100"
    return env


def _run_on_terminal(args: list[str], env: dict[str, str], timeout: float = 120) -> tuple[int, str]:
    """Run ``args`` with stdin, stdout and stderr on a new pseudo-terminal; its exit code and what it printed."""
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 40 rows, 120 columns
    process = subprocess.Popen(args, stdin=terminal, stdout=terminal, stderr=terminal, env=env, close_fds=True)
    os.close(terminal)
    out = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            try:
                chunk = os.read(controller, 4096)
            except OSError as exc:  # EIO: the terminal's other end closed (the process exited)
                if exc.errno != errno.EIO:
                    raise
                break
            if not chunk:
                break
            out += chunk
    finally:
        os.close(controller)
        code = process.wait(timeout=30)
    return code, out.decode(errors="replace").replace("\r\n", "\n")  # the terminal turns \n into \r\n


@pytest.fixture
def slow_s3(s3_server):
    """Storage options for the S3 server behind a proxy that passes 2 MiB/s per connection."""
    with fault_proxy(s3_server.endpoint, throttle=2 << 20) as proxy:
        yield {**s3_server.storage_options, "endpoint_url": proxy.url}


class HandClock:
    """A monotonic clock that moves only when the test sets :attr:`now`."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _read_available(controller: int) -> str:
    """What the pseudo-terminal's other end has printed so far."""
    os.set_blocking(controller, False)
    out = bytearray()
    while True:
        try:
            chunk = os.read(controller, 4096)
        except BlockingIOError:
            break
        if not chunk:
            break
        out += chunk
    return out.decode(errors="replace")


def test_a_bar_appears_on_a_terminal_only_once_a_transfer_has_lasted_auto_delay(tmp_path):
    """progress=None with a real terminal: ticks while the transfer has lasted less than AUTO_DELAY seconds, and
    its end, draw nothing (a quick transfer shows no bar); once it has lasted AUTO_DELAY the bar is drawn, and the
    end shows the whole transfer. The clock and the ticks are the test's: nothing here is timed."""
    from taskpoint.format.codecs import get_codec
    from taskpoint.payloads import payload_for
    from taskpoint.record import save_object
    from taskpoint.storage import Location

    data = os.urandom(1 << 20)
    controller, terminal = pty.openpty()
    fcntl.ioctl(terminal, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))  # 40 rows, 120 columns
    try:
        with os.fdopen(terminal, "w") as stream:
            for lasted, drawn in ((_progress.AUTO_DELAY - 0.001, False), (_progress.AUTO_DELAY, True)):
                clock, ticks = HandClock(), ManualTicks()
                tracker = _progress.resolve(None, "save ckpt", stream=stream, clock=clock, ticks=ticks)
                with tracker:
                    ticks.tick()  # at the start
                    save_object(Location(str(tmp_path / "ckpt"), {}), payload_for(data), get_codec("gzip"), None,
                                tracker)
                    clock.now += lasted
                    ticks.tick()
                out = _read_available(controller)
                if drawn:
                    assert "save ckpt" in out and "100%" in out, out
                else:
                    assert out == "", out
        assert _progress.resolve(None, "save ckpt", stream=open(os.devnull, "w")) is _progress.NO_PROGRESS  # noqa: SIM115
    finally:
        os.close(controller)


@pytest.mark.e2e("starts the S3 server")
def test_push_shows_a_bar_on_a_terminal_when_the_transfer_is_slow(tmp_path, slow_s3):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(os.urandom(8 << 20))  # ~4 s at 2 MiB/s
    url = f"s3://taskpoint-tests/progress-pty-{os.getpid()}-{time.monotonic_ns()}/ckpt"
    code, out = _run_on_terminal([sys.executable, "-m", "taskpoint", "push", str(tmp_path / "model"), url],
                                 _cli_env(slow_s3))
    assert code == 0, out
    assert "pushed" in out
    bar = [line for line in out.replace("\r", "\n").splitlines() if line.startswith("save ckpt: ")]
    assert bar, out
    assert any("100%" in line and "8.00M" in line for line in bar), bar


@pytest.mark.e2e("starts the S3 server")
def test_no_bar_when_stderr_is_not_a_terminal(tmp_path, slow_s3):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(os.urandom(8 << 20))
    url = f"s3://taskpoint-tests/progress-pipe-{os.getpid()}-{time.monotonic_ns()}/ckpt"
    done = subprocess.run([sys.executable, "-m", "taskpoint", "push", str(tmp_path / "model"), url],
                          env=_cli_env(slow_s3), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert "pushed" in done.stdout and "\r" not in done.stdout


@pytest.mark.e2e("runs the CLI as a process")
def test_a_quick_transfer_on_a_terminal_shows_no_bar(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(os.urandom(1 << 20))
    code, out = _run_on_terminal([sys.executable, "-m", "taskpoint", "push", str(tmp_path / "model"),
                                  str(tmp_path / "ckpt")], _cli_env({}))
    assert code == 0, out
    assert "pushed" in out and "\r" not in out and "%" not in out


@pytest.mark.e2e("starts a python process")
def test_progress_forces_a_bar_and_without_tqdm_it_is_one_line(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights.bin").write_bytes(os.urandom(1 << 20))
    script = ("import sys; sys.modules['tqdm'] = None; from taskpoint.cli import main; "
              "sys.exit(main(sys.argv[1:]))")
    done = subprocess.run([sys.executable, "-c", script, "push", "--progress", str(tmp_path / "model"),
                           str(tmp_path / "ckpt")], env=_cli_env({}), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    line = done.stderr.replace("\r", "\n").strip().splitlines()[-1]
    assert line.startswith("save ") and "100%" in line and "1.0 MiB/1.0 MiB" in line, done.stderr
    pulled = subprocess.run([sys.executable, "-m", "taskpoint", "pull", "--no-progress", str(tmp_path / "ckpt"),
                             str(tmp_path / "out")], env=_cli_env({}), capture_output=True, text=True, timeout=120)
    assert pulled.returncode == 0 and pulled.stderr == "", pulled.stderr


@pytest.mark.e2e("runs the CLI as a process")
def test_verify_takes_progress_too(tmp_path):
    with Checkpoint(tmp_path / "ckpt") as cp:
        cp.save_sync(os.urandom(1 << 20))
    done = subprocess.run([sys.executable, "-m", "taskpoint", "verify", "--progress", str(tmp_path / "ckpt")],
                          env=_cli_env({}), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "healthy" in done.stdout and "100%" in done.stderr


@pytest.mark.parametrize("failing", ["set_size", "relative_update"])
def test_a_callback_that_raises_is_dropped_with_a_warning_and_the_save_goes_on(tmp_path, failing):
    class Broken(Recorder):
        def set_size(self, size: int) -> None:
            if failing == "set_size":
                raise ValueError("a bug in the callback")
            super().set_size(size)

        def relative_update(self, inc: int = 1) -> None:
            super().relative_update(inc)
            if failing == "relative_update":
                raise ValueError("a bug in the callback")

    broken = Broken()
    data = os.urandom(3 << 20)
    with Checkpoint(tmp_path / "ckpt") as cp, pytest.warns(RuntimeWarning, match="a bug in the callback"):
        cp.save_sync(data, progress=broken)
    assert len(broken.updates()) <= 1  # not called again after it raised
    with Checkpoint(tmp_path / "other", tmp_path / "ckpt") as cp:
        assert cp.load_sync().read_bytes() == data


# -- wrong values ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [1, "yes", object(), Callback])
def test_a_wrong_progress_value_is_a_type_error_and_nothing_is_saved(tmp_path, value):
    with Checkpoint(tmp_path / "ckpt") as cp, pytest.raises(TypeError, match=r"progress must be True, False, "
                                                            r"None or an fsspec\.callbacks\.Callback"):
        cp.save_sync(b"data", progress=value)
    assert not (tmp_path / "ckpt").exists() and not (tmp_path / f"ckpt{RECORD_SUFFIX}").exists()
    with Checkpoint(tmp_path / "other", tmp_path / "ckpt") as cp, pytest.raises(TypeError, match="progress must"):
        cp.load_sync(progress=value)
    with CheckpointManager(tmp_path / "steps") as manager:
        with pytest.raises(TypeError, match="progress must be"):
            manager.save(b"data", 1, progress=value)
        assert manager.steps() == []
        manager.save(b"data", 1)
        with pytest.raises(TypeError, match="progress must be"):
            manager.restore(1, progress=value)
