"""A fork server for the tests' workers: import Lightning (or torch, or the store clients) once, fork a process per run.

``import lightning`` costs 5.4 CPU-s and transformers' Trainer 2.5 on the 2-core machine, and the same-run tests
start a dozen such workers; s3fs is 0.5 of the 0.9 CPU-s of a rank or a child of tests/reliability. :func:`spawn`
asks a server (one per set of preloaded modules, per pytest process) that imported those modules and nothing of
taskpoint to fork a child that runs ``python script args`` (or ``-c CODE``, ``-m MODULE``) as python would
(``__main__``, ``sys.argv``, the given environment, stdout and stderr to a pipe of the caller's), and returns a
:class:`Forked`, a ``Popen``-like handle. The child is a real process: the test
signals its pid (SIGKILL, SIGTERM), it imports taskpoint itself, and it exits through the interpreter's own
shutdown (atexit handlers, non-daemon threads), so the status the handle reports is the one a process of its
own would end with. The server reaps it and sends that status (``-signal`` for a signal, as ``Popen``) on the
request's connection. What the child shares with the server: the modules already imported and the hash seed
(``random`` reseeds itself after a fork, and numpy's global generator is reseeded here).

Under pytest-xdist the process that hands out the tests starts the servers of :data:`SHARED` as the session starts
(:func:`start_shared`, from tests/conftest.py) and every worker forks from them: each framework is imported once
per session. Run as a script, this is the server: ``python _zygote.py SOCKET MODULE...``.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import importlib.util
import json
import os
import select
import shutil
import signal
import site
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import IO, Any

#: What a server imports ahead for the workers of each framework: the framework, never taskpoint (whose code is
#: what the tests test, imported by each child with its own environment).
TORCH = ("torch",)
DCP = ("torch", "torch.distributed.checkpoint")
LIGHTNING = ("torch", "lightning", "lightning.pytorch")
TRANSFORMERS = ("torch", "transformers", "transformers.trainer", "transformers.models.gpt2.modeling_gpt2")
#: For the tests' own taskpoint processes (workers, ranks, tests/reliability's children): the store clients, 0.5
#: of the 0.9 CPU-s of such a process started fresh. Not gcsfs, which reads its settings from the environment as it
#: is imported; what fsspec reads so is read again from the child's environment (:func:`become`).
STORES = ("fsspec", "s3fs", "aiobotocore.session", "botocore.session")
#: The bound of the server's start: importing Lightning took 5 CPU-s alone and 60 s at a load of 20.
START_TIMEOUT = 300.0
#: The servers that, under pytest-xdist, the controlling process starts as the session starts, for every worker
#: (tests/conftest.py): each framework imported once per session, not once in each worker that uses it (make
#: test uses each of them, in two or three of its workers).
SHARED = (TORCH, DCP, LIGHTNING, TRANSFORMERS, STORES)
#: The variable naming the folder where those servers listen (one socket each, named by its place in SHARED).
SHARED_ENV = "TASKPOINT_FORK_SERVERS"


class Forked:
    """A child of the server, as ``subprocess.Popen(..., text=True)`` shows a child: ``pid``, ``stdout`` and
    ``stderr`` (text; ``stderr`` None when it goes to ``stdout``), ``poll()``, ``wait(timeout)``,
    ``communicate(timeout)``, ``send_signal()``, ``kill()``, ``returncode``."""

    def __init__(self, connection: socket.socket, stdout: int, stderr: int | None) -> None:
        self._connection = connection
        self._replies = connection.makefile("r")
        self.pid: int = json.loads(self._replies.readline())["pid"]
        self.stdout: IO[str] = os.fdopen(stdout, "r", errors="replace")
        self.stderr: IO[str] | None = None if stderr is None else os.fdopen(stderr, "r", errors="replace")
        self.returncode: int | None = None
        self._readers: list[tuple[threading.Thread, list[str]]] = []

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self._connection], [], [], 0)[0]:
            self._read_status()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self._connection], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            self._read_status()
        assert self.returncode is not None
        return self.returncode

    def communicate(self, timeout: float | None = None) -> tuple[str, str | None]:
        """The rest of its output (and of its stderr, when apart), once the pipes closed and the child ended;
        ``TimeoutExpired`` past ``timeout``, after which it may be called again (as ``Popen.communicate``)."""
        end = None if timeout is None else time.monotonic() + timeout
        if not self._readers:
            for stream in (self.stdout, self.stderr):
                if stream is not None:
                    text: list[str] = []
                    thread = threading.Thread(target=lambda s=stream, t=text: t.append(s.read()), daemon=True,
                                              name=f"zygote-child-{self.pid}-output")
                    thread.start()
                    self._readers.append((thread, text))
        for thread, _ in self._readers:
            thread.join(None if end is None else max(0.0, end - time.monotonic()))
            if thread.is_alive():
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
        self.wait(None if end is None else max(0.0, end - time.monotonic()))
        outputs = ["".join(text) for _, text in self._readers]
        return outputs[0], outputs[1] if len(outputs) > 1 else None

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def _read_status(self) -> None:
        line = self._replies.readline()
        if not line:
            raise RuntimeError(f"the fork server closed the connection of child {self.pid} without its status")
        ended = json.loads(line)
        self.returncode = ended["status"]
        _ended_cpu[0] += ended["cpu"]
        self._replies.close()
        self._connection.close()


class Zygote:
    """One server process with ``modules`` imported, listening on a Unix socket: in a folder of its own, or in
    the folder of the shared servers (:func:`start_shared`)."""

    def __init__(self, modules: tuple[str, ...], shared: str | None = None) -> None:
        """Start it and wait until it listens; in the ``shared`` folder, without waiting (a worker that uses it
        waits for its socket: :func:`_shared_address`)."""
        self._folder = shared or tempfile.mkdtemp(prefix="taskpoint-zygote-")
        self._address = os.path.join(self._folder, f"{SHARED.index(modules)}.socket" if shared else "socket")
        print(f"fork server: importing {', '.join(modules)} (at most {START_TIMEOUT:.0f} s)", flush=True)
        self._server = subprocess.Popen([sys.executable, __file__, self._address, *modules], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, text=True)
        assert self._server.stdout is not None
        if shared:
            return
        if not select.select([self._server.stdout], [], [], START_TIMEOUT)[0]:
            self.close()
            raise AssertionError(f"the fork server did not import {modules} within {START_TIMEOUT} s")
        ready = self._server.stdout.readline()
        assert ready.strip() == "ready", f"the fork server failed to start (status {self._server.poll()})"

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str | os.PathLike[str] | None = None,
              apart: bool = False, faulthandler: bool = False) -> Forked:
        """A child running ``python argv...`` with ``env`` in ``cwd`` (default: this process's); its stderr in a
        pipe of its own with ``apart``, else in stdout's; with ``faulthandler``, as ``python -X faulthandler``."""
        return _request(self._address, argv, env, cwd, apart, faulthandler)

    def close(self, grace: float = 30.0) -> None:
        """End the server (its stdin closes; killed past ``grace`` seconds); children still running are the tests'
        to end."""
        with contextlib.suppress(OSError):
            assert self._server.stdin is not None
            self._server.stdin.close()
        try:
            self._server.wait(grace)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        with contextlib.suppress(OSError):
            os.unlink(self._address)
            os.rmdir(self._folder)


def _request(address: str, argv: list[str], env: dict[str, str], cwd: str | os.PathLike[str] | None, apart: bool,
             faulthandler: bool) -> Forked:
    """Ask the server listening at ``address`` for a child (as :meth:`Zygote.spawn`)."""
    pipes = [os.pipe() for _ in range(2 if apart else 1)]
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.connect(address)
        request = json.dumps({"argv": argv, "env": env, "cwd": os.fspath(cwd or os.getcwd()),
                              "faulthandler": faulthandler}).encode()
        socket.send_fds(connection, [request + b"\n"], [write for _, write in pipes])
    finally:
        for _, write in pipes:
            os.close(write)
    return Forked(connection, pipes[0][0], pipes[1][0] if apart else None)


_servers: dict[tuple[str, ...], Zygote] = {}
_ended_cpu = [0.0]


def ended_cpu() -> float:
    """CPU-seconds of this process's forked children whose end it has seen: what ``RUSAGE_CHILDREN`` counts of
    its own children, for tests/_cpu_report.py (the server, not this process, waits for them)."""
    return _ended_cpu[0]


def start_shared() -> list[Zygote]:
    """In the process that hands tests to pytest-xdist workers: start the :data:`SHARED` servers of the
    frameworks installed, without waiting for them, in a folder that the workers, started after this, find in
    :data:`SHARED_ENV`. :func:`end_shared` ends them."""
    folder = tempfile.mkdtemp(prefix="taskpoint-zygotes-")
    os.environ[SHARED_ENV] = folder
    return [Zygote(modules, folder) for modules in SHARED if _installed(modules)]


def end_shared(servers: list[Zygote]) -> None:
    """End the shared servers at once: one may still be importing (a short session), and a server leaves with
    ``os._exit`` anyway (nothing to tear down)."""
    for server in servers:
        server.close(grace=0.0)
    shutil.rmtree(os.environ.pop(SHARED_ENV), ignore_errors=True)


def _installed(modules: tuple[str, ...]) -> bool:
    return all(importlib.util.find_spec(name.split(".")[0]) for name in modules)


_listening: set[str] = set()


def _shared_address(modules: tuple[str, ...]) -> str | None:
    """The socket of the shared server of ``modules``, once it listens (waited for at most START_TIMEOUT, on first
    use in this process); None when there is none (no pytest-xdist, or a set not in SHARED)."""
    folder = os.environ.get(SHARED_ENV)
    if not folder or modules not in SHARED or not _installed(modules):
        return None
    address = os.path.join(folder, f"{SHARED.index(modules)}.socket")
    if address not in _listening:
        print(f"fork server: waiting for the shared one importing {', '.join(modules)} (at most "
              f"{START_TIMEOUT:.0f} s)", flush=True)
        end = time.monotonic() + START_TIMEOUT
        while not os.path.exists(address):
            if os.path.exists(address + ".error"):
                raise AssertionError(f"the shared fork server of {modules} failed to start:\n"
                                     + Path(address + ".error").read_text())
            if time.monotonic() > end:
                raise AssertionError(f"the shared fork server did not import {modules} within {START_TIMEOUT} s")
            time.sleep(0.1)
        _listening.add(address)
    return address


def spawn(modules: tuple[str, ...], argv: list[str], env: dict[str, str], **how: Any) -> Forked:
    """``python argv...`` forked from a server that imported ``modules``: the shared one under pytest-xdist
    (:func:`start_shared`), else this pytest process's own (started on first use, ended at exit); ``how`` as
    :meth:`Zygote.spawn`."""
    shared = _shared_address(modules)
    if shared is not None:
        return _request(shared, argv, env, how.get("cwd"), how.get("apart", False), how.get("faulthandler", False))
    if modules not in _servers:
        _servers[modules] = Zygote(modules)
        atexit.register(_servers[modules].close)
    return _servers[modules].spawn(argv, env, **how)


def run(modules: tuple[str, ...], argv: list[str], env: dict[str, str], cwd: str | os.PathLike[str],
        timeout: float) -> subprocess.CompletedProcess[str]:
    """As ``subprocess.run(capture_output=True, text=True)``: the child killed, and ``TimeoutExpired``, past
    ``timeout``."""
    child = spawn(modules, argv, env, cwd=cwd, apart=True)
    try:
        out, err = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        child.kill()
        child.communicate(timeout=60)
        raise
    return subprocess.CompletedProcess(argv, child.wait(), out, err)


# -- the server --------------------------------------------------------------------------------------------------

def serve(address: str) -> dict[str, Any] | None:
    """Accept requests until stdin closes (None); in a forked child, return its request."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address + ".new")
    listener.listen(16)
    os.rename(address + ".new", address)  # the socket is there once it listens (a worker waits for it to be)
    wakeup_read, wakeup_write = os.pipe()
    os.set_blocking(wakeup_write, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wakeup_write)
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        with contextlib.suppress(InterruptedError):
            readable = select.select([listener, wakeup_read, sys.stdin], [], [])[0]
        if sys.stdin in readable and not sys.stdin.readline():
            return None
        if wakeup_read in readable:
            os.read(wakeup_read, 4096)
        _reap(children)
        if listener in readable:
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
            while not message.endswith(b"\n"):  # a request longer than one read
                message += connection.recv(1 << 20)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (wakeup_read, wakeup_write, listener.fileno(), connection.fileno()):
                    os.close(fd)
                for other in children.values():
                    other.close()
                request: dict[str, Any] = json.loads(message)
                request["outputs"] = fds
                return request
            for fd in fds:
                os.close(fd)
            connection.sendall(json.dumps({"pid": pid}).encode() + b"\n")
            children[pid] = connection


def _reap(children: dict[int, socket.socket]) -> None:
    """Send each ended child's status (``-signal`` when a signal ended it) and CPU-seconds (its own and its
    waited-for children's) on its connection."""
    while children:
        pid, status, usage = os.wait4(-1, os.WNOHANG)
        if pid == 0:
            return
        connection = children.pop(pid)
        ended = {"status": os.waitstatus_to_exitcode(status), "cpu": usage.ru_utime + usage.ru_stime}
        with contextlib.suppress(OSError):
            connection.sendall(json.dumps(ended).encode() + b"\n")
        connection.close()


def become(request: dict[str, Any], own_path: list[str]) -> None:
    """In the child: become ``python argv...`` (stdin /dev/null, stdout and stderr the caller's pipes): a script,
    or ``-c CODE`` or ``-m MODULE`` as python runs them (``sys.argv``, ``sys.path``'s first entry, a ``__main__``
    of their own); ``own_path`` is the interpreter's own ``sys.path``, without a script's folder or a PYTHONPATH."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    outputs = request["outputs"]
    os.dup2(outputs[0], 1)
    os.dup2(outputs[-1], 2)
    for fd in {null, *outputs}:
        os.close(fd)
    if request["faulthandler"]:
        import faulthandler

        faulthandler.enable()
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy.random" in sys.modules:  # numpy does not reseed its global generator after a fork; a new process would
        sys.modules["numpy.random"].seed()
    if "fsspec.config" in sys.modules:  # fsspec read FSSPEC_* and its configuration folder when it was imported
        config = sys.modules["fsspec.config"]
        config.conf.clear()
        config.conf_dir = os.environ.get("FSSPEC_CONFIG_DIR", config.default_conf_dir)
        config.set_conf_files(config.conf_dir, config.conf)
        config.set_conf_env(config.conf, os.environ)
    argv = list(request["argv"])
    # the path python would have: the child's PYTHONPATH, then the interpreter's own, without duplicates (as
    # site.py leaves it), and first the script's folder, or for -c "" and for -m the working directory
    sys.path[:] = [*_python_path(request["env"].get("PYTHONPATH", "")), *own_path]
    site.removeduppaths()
    import builtins
    import runpy
    import types

    if argv[0] in ("-c", "-m"):
        sys.modules["__main__"] = main = types.ModuleType("__main__")  # theirs, not this server's module
        main.__dict__.update(__annotations__={}, __builtins__=builtins)  # as the interpreter makes it
    try:
        if argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), main.__dict__)  # what python -c does
        elif argv[0] == "-m":
            sys.argv = argv[1:]  # runpy puts the module's file in sys.argv[0], as python -m does
            sys.path.insert(0, os.getcwd())
            runpy._run_module_as_main(argv[1])  # type: ignore[attr-defined]  # python -m's own entry
        else:
            sys.argv = argv
            sys.path.insert(0, str(Path(argv[0]).resolve().parent))
            runpy.run_path(argv[0], run_name="__main__")
    except Exception as error:  # printed as python prints it: from the code's own frames on, not this function's
        own = error.__traceback__.tb_next if error.__traceback__ else None
        sys.excepthook(type(error), error.with_traceback(own), own)
        sys.exit(1)


def _python_path(variable: str) -> list[str]:
    return [entry for entry in variable.split(os.pathsep) if entry]


if __name__ == "__main__":
    interpreter_path = json.loads(subprocess.check_output(
        [sys.executable, "-E", "-c", "import json, sys; print(json.dumps(sys.path[1:]))"]))
    try:
        for name in sys.argv[2:]:
            importlib.import_module(name)
    except BaseException:  # said beside the socket, for the workers that wait for a shared server
        Path(sys.argv[1] + ".error").write_text(traceback.format_exc())
        raise
    job = serve(sys.argv[1])
    if job is None:  # the server ends without tearing Lightning's modules down (seconds, for nothing)
        os._exit(0)
    become(job, interpreter_path)
