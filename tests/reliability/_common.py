"""What every scenario of the campaign shares: results, the table, servers, self-identifying states, children.

A *state* is a folder whose content proves itself: ``identity.json`` names the writer, the version and the
sha256 of every other file (with its size), so a loader can tell the complete state of one save from a
partial one or a mix of two, without knowing in advance what was saved.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
TESTS_DIR = REPO_ROOT / "tests"
RESULTS_DIR = Path(__file__).resolve().parent / "results"

if str(TESTS_DIR) not in sys.path:  # the suite's helpers (_servers, helpers, _fault_proxy) are top-level modules
    sys.path.insert(0, str(TESTS_DIR))

import _servers  # noqa: E402
import _zygote as zygote  # noqa: E402

_servers.apply_default_environment()  # before anything imports gcsfs

#: How many error texts a result keeps (the count is always exact).
MAX_ERRORS = 12


@dataclass
class Result:
    """One row of the table: a scenario on one store, its trials and failures, and what the failures said."""

    scenario: str
    store: str
    trials: int = 0
    failures: int = 0
    notes: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    skipped: bool = False
    #: Counts a scenario reports beyond trials and failures (the JSON results keep them).
    figures: dict[str, Any] = field(default_factory=dict)

    def trial(self, error: str | None = None) -> None:
        """Count one trial; a failure when ``error`` says what went wrong."""
        self.trials += 1
        if error is not None:
            self.fail(error)

    def fail(self, error: str) -> None:
        """Count a failure (without a trial: for checks that follow all trials, such as leak counts)."""
        self.failures += 1
        if len(self.errors) < MAX_ERRORS:
            self.errors.append(error)

    def note(self, text: str) -> None:
        self.notes.append(text)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def table(results: list[Result]) -> str:
    """The results as a Markdown table (the same text is printed and goes into docs/reliability.md)."""
    rows = [("scenario", "store", "trials", "failures", "notes")]
    for r in results:
        trials = "-" if r.skipped else str(r.trials)
        failures = "-" if r.skipped else str(r.failures)
        notes = "; ".join(r.notes)
        if len(notes) > 420:  # the JSON results keep every note
            notes = notes[:420] + "… (more in the JSON results)"
        if r.failures:
            notes = ("**FAILS** " + notes).strip()
        rows.append((r.scenario, r.store, trials, failures, notes.replace("|", "/")))
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    lines = []
    for n, row in enumerate(rows):
        cells = [row[i].ljust(widths[i]) if i < 2 else row[i].rjust(widths[i]) for i in range(4)] + [row[4]]
        lines.append("| " + " | ".join(cells) + " |")
        if n == 0:
            lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|---|")
    return "\n".join(lines)


def first_line(text: str, limit: int = 600) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit] + "…"


def describe_exception(exc: BaseException) -> str:
    return first_line(f"{type(exc).__module__}.{type(exc).__qualname__}: {exc}")


# -- servers -----------------------------------------------------------------------------------------------


class Servers:
    """The object-store servers of one campaign run, each started on first use and stopped at the end."""

    def __init__(self, running: Callable[[str], _servers.RunningServer] | None = None) -> None:
        """``running``, when given, returns the server of a kind that runs already (the test suite's session
        servers, shared by its workers): a scenario inside ``make test`` then starts no server of its own."""
        self._stack = contextlib.ExitStack()
        self._running: dict[str, _servers.RunningServer] = {}
        self._failed: dict[str, str] = {}
        self._provided = running

    def get(self, kind: str) -> _servers.RunningServer:
        if kind in self._failed:
            raise _servers.ServerStartError(self._failed[kind])
        if kind not in self._running:
            start = {"s3": _servers.running_s3_server, "gcs": _servers.running_gcs_server,
                     "azure": _servers.running_azure_server}[kind]
            try:
                if self._provided is not None:
                    self._running[kind] = self._provided(kind)
                    return self._running[kind]
                self._running[kind] = self._stack.enter_context(start())
            except Exception as exc:
                self._failed[kind] = f"the {kind} server did not start: {describe_exception(exc)}"
                raise _servers.ServerStartError(self._failed[kind]) from exc
        return self._running[kind]

    def location(self, kind: str, local_root: Path) -> _servers.StoreLocation:
        """A fresh, empty place on ``kind`` (``local`` under ``local_root``, ``memory``, or a server's)."""
        if kind == "local":
            base = local_root / f"store-{os.urandom(6).hex()}"
            base.mkdir(parents=True)
            return _servers.StoreLocation("local", str(base), {})
        if kind == "memory":
            return _servers.StoreLocation("memory", f"memory://tp-{os.urandom(8).hex()}", {})
        return self.get(kind).new_location()

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def remove_location(location: _servers.StoreLocation) -> None:
    """Delete what a scenario left at ``location`` (best effort; memory and servers hold it in RAM)."""
    import shutil

    import fsspec

    if location.kind == "local":
        shutil.rmtree(location.base, ignore_errors=True)
        return
    with contextlib.suppress(Exception):
        fs = fsspec.filesystem(location.protocol, skip_instance_cache=True, **location.storage_options)
        try:
            if fs.exists(location.base):
                fs.rm(location.base, recursive=True)
        finally:
            _servers.close_filesystem(fs)


def s3_client(server: _servers.RunningServer) -> Any:
    import boto3

    return boto3.client("s3", endpoint_url=server.endpoint, aws_access_key_id=_servers.S3_KEY,
                        aws_secret_access_key=_servers.S3_SECRET, region_name=_servers.S3_REGION)


def unfinished_uploads(server: _servers.RunningServer, prefix: str) -> list[str]:
    """Keys of the multipart uploads under ``prefix`` (a key prefix in the bucket) never completed or aborted."""
    client = s3_client(server)
    found: list[str] = []
    markers: dict[str, str] = {}
    while True:
        page = client.list_multipart_uploads(Bucket=server.bucket, Prefix=prefix, **markers)
        found += [u["Key"] for u in page.get("Uploads", [])]
        if not page.get("IsTruncated"):
            return found
        markers = {"KeyMarker": page["NextKeyMarker"], "UploadIdMarker": page["NextUploadIdMarker"]}


def key_prefix(location: _servers.StoreLocation) -> str:
    """The key prefix (inside the bucket) of a server location, with a trailing slash."""
    return location.base.split("://", 1)[1].split("/", 1)[1] + "/"


def list_objects(location: _servers.StoreLocation, under: str = "") -> list[str]:
    """Every object (file) below ``location`` (or its ``under`` folder), as paths relative to ``location``."""
    if location.kind == "local":
        root = Path(location.base)
        start = root / under if under else root
        return sorted(str(p.relative_to(root)) for p in start.rglob("*") if p.is_file() or p.is_symlink())
    import fsspec

    fs = fsspec.filesystem(location.protocol, skip_instance_cache=True, **location.storage_options)
    try:
        base = fs._strip_protocol(location.base).rstrip("/")
        start = f"{base}/{under}".rstrip("/") if under else base
        fs.invalidate_cache()
        try:
            found = fs.find(start, detail=True)
        except FileNotFoundError:
            return []
        return sorted(p[len(base) + 1:] for p, info in found.items() if info.get("type") != "directory")
    finally:
        _servers.close_filesystem(fs)


# -- self-identifying states ---------------------------------------------------------------------------------

IDENTITY = "identity.json"


def write_state(folder: Path, *, writer: str, version: int, size: int, seed: int) -> Path:
    """A folder of a few files whose ``identity.json`` proves which save it is (see the module docs)."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "data.bin": rng.randbytes(size),
        "nested/small.txt": f"{writer} {version}\n".encode() * rng.randint(1, 50),
        "nested/deeper/zeros.bin": bytes(rng.randint(0, 4096)),
    }
    listing = {}
    for name, data in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        listing[name] = [len(data), hashlib.sha256(data).hexdigest()]
    (folder / "empty").mkdir(exist_ok=True)
    identity = {"writer": writer, "version": version, "files": listing}
    (folder / IDENTITY).write_text(json.dumps(identity, sort_keys=True))
    return folder


def check_state(folder: Path) -> tuple[str, int]:
    """(writer, version) of a loaded state; ValueError saying what is wrong when it is not complete and whole."""
    ident_path = folder / IDENTITY
    if not ident_path.is_file():
        raise ValueError(f"{IDENTITY} is missing from the loaded state (entries: {sorted(os.listdir(folder))[:10]})")
    identity = json.loads(ident_path.read_text())
    expected = set(identity["files"]) | {IDENTITY}
    found = {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}
    if found != expected:
        raise ValueError(f"files differ from those saved: missing {sorted(expected - found)}, "
                         f"extra {sorted(found - expected)}")
    for name, (size, digest) in identity["files"].items():
        data = (folder / name).read_bytes()
        if len(data) != size or hashlib.sha256(data).hexdigest() != digest:
            raise ValueError(f"{name}: {len(data)} bytes with sha256 {hashlib.sha256(data).hexdigest()[:16]}…, "
                             f"saved as {size} bytes with {digest[:16]}… (partial or mixed data)")
    if not (folder / "empty").is_dir():
        raise ValueError("the empty folder 'empty' is missing")
    return identity["writer"], int(identity["version"])


# -- children ----------------------------------------------------------------------------------------------


def child_env(**extra: str) -> dict[str, str]:
    """The environment for a child Python: this taskpoint and the suite's helpers importable, no buffering."""
    import taskpoint

    src = str(Path(taskpoint.__file__).resolve().parents[1])
    env = dict(os.environ)
    paths = [src, str(TESTS_DIR), *(p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p)]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


#: Prepended to every child script: the same environment defaults as the suite, before gcsfs is imported.
CHILD_PRELUDE = textwrap.dedent("""
    import _servers
    _servers.apply_default_environment()
""")


def start_child(script: str, args: list[str], env: dict[str, str] | None = None, cwd: str | None = None
                ) -> zygote.Forked:
    """``python -c script args`` (after :data:`CHILD_PRELUDE`), stdin /dev/null, stdout and stderr in pipes of
    their own: a real process, forked from a server that imported the store clients (tests/_zygote.py, 0.5 of the
    0.9 CPU-s of such a child started fresh)."""
    return zygote.spawn(zygote.STORES, ["-c", CHILD_PRELUDE + script, *args], env or child_env(), cwd=cwd,
                        apart=True)


def run_child(script: str, args: list[str], *, timeout: float, env: dict[str, str] | None = None,
              cwd: str | None = None) -> tuple[int, str, str]:
    """Run ``python -c script args`` to the end (:func:`start_child`); (exit code, stdout, stderr). A hang is killed
    (by its pid)."""
    proc = start_child(script, args, env, cwd)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        return -9, out, f"timed out after {timeout:.0f} s and was killed\n{err}"
    return proc.returncode, out, err


def last_json_line(text: str) -> dict[str, Any] | None:
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith("{"):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(line)  # type: ignore[no-any-return]
    return None


def tail(text: str, lines: int = 6) -> str:
    return " | ".join(text.strip().splitlines()[-lines:])


@contextlib.contextmanager
def timed(result: Result) -> Iterator[Result]:
    started = time.monotonic()
    try:
        yield result
    finally:
        result.seconds = round(time.monotonic() - started, 1)


def location_or_skip(servers: Servers, kind: str, scratch: Path, result: Result) -> Any:
    """A fresh location on ``kind`` (a StoreLocation), or None with ``result`` marked as not run and why."""
    try:
        return servers.location(kind, scratch)
    except Exception as exc:
        result.skipped = True
        result.note(f"not run: {describe_exception(exc)}")
        return None
