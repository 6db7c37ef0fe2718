"""The ``taskpoint`` command line: look at, check, move and clean checkpoints; run a command with locations.

Commands: ``ls``, ``show``, ``verify``, ``pull``, ``push``, ``rm``, ``gc`` and ``run`` (see docs/cli.md). The top
layer: it imports the library and reads records and manifests with the library's own code. click is imported
here only, so ``import taskpoint`` does not load it.

Exit codes: 0 success (healthy), 1 error (storage, usage, anything unexpected), 2 damaged (names the object or
step), 3 not found. ``taskpoint run`` keeps its own: 2 for its usage errors, 127 for a command not found, else
the command's.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote, quote_plus

import click

from . import __version__
from ._log import TransferStats, logger, safe_uri
from .checkpoint import Checkpoint, load_object, read_record
from .errors import CheckpointCorruptError, CheckpointError, StorageError
from .format.codecs import Codec
from .format.records import MANIFEST_SUFFIX, Record
from .manager import CheckpointManager
from .manager.claims import Claims
from .manager.steps import MANIFEST_NAME, STEP_FOLDER, StepStore
from .payloads import Payload
from .runtime import layout
from .storage import WRITE_PIECE, Location, digest_by_reading
from .transfer import DIGESTS, read_payload

F = TypeVar("F", bound=Callable[..., Any])

#: Exit codes of every command but ``run``.
OK, ERROR, DAMAGED, NOT_FOUND = 0, 1, 2, 3

#: Storage option keys whose values are not secret (they stay readable in error messages).
_PLAIN_OPTIONS = frozenset({"endpoint_url", "region_name", "region", "project", "anon", "account_name",
                            "use_ssl", "requester_pays", "default_block_size"})


class _Missing(Exception):
    """Nothing is stored at the URI (exit code 3)."""


class _Failed(Exception):
    """A command's failure, already described: ``code`` and a one-line message."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


# -- options shared by the commands ---------------------------------------------------------------------------


class _State:
    """What the options of one invocation decided: storage options, debug, where messages go."""

    def __init__(self) -> None:
        self.pairs: list[str] = []
        self.debug = False

    def storage_options(self) -> dict[str, Any]:
        """``$TASKPOINT_STORAGE_OPTIONS`` (JSON), overridden key by key by ``--storage-option``; fsspec adds
        its own configuration (``FSSPEC_<PROTOCOL>_*`` variables, config files) when it builds the filesystem."""
        try:
            options = dict(layout.env_storage_options() or {})
        except ValueError as exc:
            raise _Failed(ERROR, str(exc)) from None
        for pair in self.pairs:
            key, sep, raw = pair.partition("=")
            if not sep or not key.strip():
                raise _Failed(ERROR, "--storage-option takes KEY=VALUE; one has no '=' or no key (not shown: it "
                                     "may hold a credential)")
            try:
                value: Any = json.loads(raw)
            except ValueError:
                value = raw
            options[key.strip()] = value
        return options


def _state() -> _State:
    ctx = click.get_current_context()
    state = ctx.find_object(_State)
    if state is None:
        state = ctx.ensure_object(_State)
    return state


def _add_pairs(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[str, ...]:
    ctx.ensure_object(_State).pairs.extend(value)
    return value


def _set_debug(ctx: click.Context, param: click.Parameter, value: bool) -> bool:
    if value:
        ctx.ensure_object(_State).debug = True
    return value


_storage_option = click.option(
    "--storage-option", "-o", "storage_option", multiple=True, metavar="KEY=VALUE", expose_value=False,
    callback=_add_pairs,
    help="fsspec storage option (repeatable); VALUE is parsed as JSON when it parses, else kept as a string. "
         "Overrides $TASKPOINT_STORAGE_OPTIONS key by key.")
_debug = click.option("--debug", is_flag=True, expose_value=False, callback=_set_debug,
                      help="show the traceback of an error")


def _command(fn: F) -> F:
    """A command's common options, and its errors as one line on stderr with the matching exit code."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> int:
        state = _state()
        name = click.get_current_context().info_name
        try:
            result = fn(*args, **kwargs)
            return int(result or OK)
        except Exception as exc:
            code, message = _describe(exc)
            secrets = _secret_values(state)
            if state.debug:
                click.echo(_redact("".join(traceback.format_exception(exc)), secrets), err=True, nl=False)
            hint = "" if state.debug or code != ERROR or isinstance(exc, (_Failed, StorageError)) \
                else " (run with --debug for the traceback)"
            click.echo(f"taskpoint {name}: {_redact(message, secrets)}{hint}", err=True)
            return code

    return _storage_option(_debug(run))  # type: ignore[return-value]


def _describe(exc: BaseException) -> tuple[int, str]:
    """The exit code and the one-line message for an error."""
    if isinstance(exc, _Failed):
        code = exc.code
    elif isinstance(exc, _Missing):
        code = NOT_FOUND
    elif isinstance(exc, CheckpointCorruptError):
        code = DAMAGED
    elif isinstance(exc, FileNotFoundError) and not isinstance(exc, StorageError):
        code = NOT_FOUND
    else:
        code = ERROR
    text = " ".join(str(exc).split()) or type(exc).__name__
    if not isinstance(exc, (CheckpointError, _Missing, _Failed, FileNotFoundError, ValueError)):
        text = f"{type(exc).__name__}: {text}"
    return code, text


def _secret_values(state: _State) -> list[str]:
    """String values of the storage options in effect (given, from the environment, from fsspec's config) that
    could be credentials; messages never show them."""
    found: list[str] = []

    def collect(value: Any, key: str = "") -> None:
        if isinstance(value, dict):
            for k, v in value.items():
                collect(v, str(k))
        elif isinstance(value, (list, tuple)):
            for v in value:
                collect(v, key)
        elif isinstance(value, str) and len(value) >= 4 and key.lower() not in _PLAIN_OPTIONS:
            found.append(value)

    with suppress(_Failed):
        collect(state.storage_options())
    for pair in state.pairs:  # also a pair that did not parse
        collect(pair.partition("=")[2], pair.partition("=")[0])
    import fsspec.config

    collect(fsspec.config.conf)
    # Clients quote values into URLs and JSON in their messages (gcsfs: ...tokeninfo?access_token=%2F...).
    forms = {form for value in found
             for form in (value, quote(value, safe=""), quote_plus(value), json.dumps(value)[1:-1])}
    return sorted(forms, key=len, reverse=True)


def _redact(text: str, secrets: list[str]) -> str:
    for secret in secrets:
        text = text.replace(secret, "***")
    return text


# -- the group ----------------------------------------------------------------------------------------------


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, "--version", prog_name="taskpoint", message="%(prog)s %(version)s")
@click.option("-v", "--verbose", count=True, help="log taskpoint's saves and loads to stderr (-vv: retries too)")
@_debug
def cli(verbose: int) -> None:
    """Checkpoints of retried tasks: look at them, check them, move them, clean up after them.

    URIs are anything fsspec opens: local paths, file://, memory://, s3://, gs://, az://. Storage options
    (credentials, endpoint_url, ...) come from --storage-option KEY=VALUE, $TASKPOINT_STORAGE_OPTIONS (JSON)
    and fsspec's own configuration (FSSPEC_S3_* variables, ~/.config/fsspec); see docs/cli.md.

    \b
    Examples:
      taskpoint ls s3://bucket/runs/train/steps
      taskpoint verify s3://bucket/runs/train/steps --step 1200
      taskpoint pull ./.taskpoint/job/main/3/checkpoint ./restored
    """
    if verbose:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(logging.DEBUG if verbose > 1 else logging.INFO)


# -- what a URI holds -----------------------------------------------------------------------------------------


def _location(uri: str) -> Location:
    return Location(uri.rstrip("/") if not uri.endswith("://") else uri, _state().storage_options())


def _object_size(loc: Location) -> int | None:
    """The size of the object at ``loc``; None when there is none (or it is a folder)."""

    def info() -> int | None:
        try:
            found = loc.fs.info(loc.path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        if found.get("type") == "directory":
            return None
        return int(found.get("size") or 0)

    return loc.run(info, action="check")


def _steps(loc: Location) -> StepStore:
    return StepStore(loc, Claims((str(loc.fs.protocol), loc.path)))


def _time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return datetime.fromtimestamp(seconds, timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


def _human(size: int | None) -> str:
    if size is None:
        return "-"
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _checkpoint_view(loc: Location) -> dict[str, Any] | None:
    """A checkpoint object and its record (``<uri>.taskpoint.json``); None when neither is there."""
    record = read_record(loc.sibling(MANIFEST_SUFFIX))
    size = _object_size(loc)
    if record is None and size is None:
        return None
    # The entry a load verifies the object against: the newest listed one of the stored size.
    visible = record.of_size(size) if record is not None and size is not None else None
    confirmed = record.confirmed if record is not None else None
    objects = [{**asdict(entry), "confirmed": entry.save_id == confirmed, "size_matches": entry.size == size}
               for entry in (record.objects if record is not None else ())]
    if record is None:
        state = "unrecorded"  # Flyte's, or written by hand: only the archive's own checks apply
    elif size is None:
        state = "missing"
    elif visible is None:
        state = "damaged"
    else:
        state = "saved"
    return {"type": "checkpoint", "uri": loc.uri, "state": state, "size": size,
            "kind": visible.kind if visible else (objects[0]["kind"] if objects else None),
            "created": visible.created if visible else None, "objects": objects,
            "record": None if record is None else loc.sibling(MANIFEST_SUFFIX).uri}


def _manager_view(loc: Location) -> dict[str, Any] | None:
    """The steps of a CheckpointManager directory; None when it holds no ``ckpt-N`` folder."""
    root = loc.path.rstrip("/")
    listing = loc.list_tree()
    sizes: dict[int, dict[str, int]] = {}
    for path, info in listing.items():
        parts = path[len(root) + 1:].split("/") if path.startswith(root + "/") else []
        match = STEP_FOLDER.fullmatch(parts[0]) if parts else None
        if match is None:
            continue
        names = sizes.setdefault(int(match.group(1)), {})
        if len(parts) == 2 and parts[1] and info.get("type") != "directory":
            names[parts[1]] = int(info.get("size") or 0)
    if not sizes:
        return None
    steps = _steps(loc)
    rows = []
    for step, names in sorted(sizes.items()):
        row: dict[str, Any] = {"step": step, "uri": steps.step_uri(step), "state": "incomplete", "size": None,
                               "created": None, "attempt": None, "kind": None, "metadata_keys": [],
                               "leftovers": sorted(n for n in names if n != MANIFEST_NAME)}
        if MANIFEST_NAME in names:
            try:
                manifest = steps.manifest(step)
            except CheckpointCorruptError as exc:
                row.update(state="damaged", problem=" ".join(str(exc).split()))
                rows.append(row)
                continue
            assert manifest is not None
            record = manifest.record
            stored = names.get(manifest.payload)
            row.update(size=record.size, created=record.created, attempt=manifest.attempt, kind=record.kind,
                       metadata_keys=sorted(manifest.metadata), payload=manifest.payload,
                       leftovers=sorted(n for n in names if n not in (MANIFEST_NAME, manifest.payload)))
            if stored is None:
                row.update(state="damaged", problem=f"its payload {manifest.payload} is missing")
            elif stored != record.size:
                row.update(state="damaged", problem=f"its payload holds {stored} bytes, the manifest records "
                                                    f"{record.size}")
            else:
                row["state"] = "committed"
        rows.append(row)
    return {"type": "manager", "uri": loc.uri, "steps": rows}


def _task_root_view(loc: Location) -> dict[str, Any] | None:
    """Runs, actions and attempts under a task root (or a run's or an action's folder); None when none."""
    root = loc.path.rstrip("/")
    actions: dict[str, dict[str, Any]] = {}
    for path, info in loc.list_tree().items():
        parts = path[len(root) + 1:].split("/") if path.startswith(root + "/") else []
        if info.get("type") == "directory" or len(parts) < 2:
            continue
        if parts[-1] in (layout.ATTEMPT_MARKER, layout.CHECKPOINT_NAME) and parts[-2].isdigit():
            prefix, attempt = "/".join(parts[:-2]), int(parts[-2])
            entry = actions.setdefault(prefix, {"attempts": {}, "steps": []})
            slot = entry["attempts"].setdefault(attempt, {"attempt": attempt, "checkpoint_size": None})
            if parts[-1] == layout.CHECKPOINT_NAME:
                slot["checkpoint_size"] = int(info.get("size") or 0)
        elif (len(parts) >= 3 and parts[-1] == MANIFEST_NAME and parts[-3] == layout.STEPS_FOLDER
              and STEP_FOLDER.fullmatch(parts[-2])):
            prefix = "/".join(parts[:-3])
            entry = actions.setdefault(prefix, {"attempts": {}, "steps": []})
            entry["steps"].append(int(parts[-2][len("ckpt-"):]))
    if not actions:
        return None
    rows = []
    for prefix, entry in sorted(actions.items()):
        names = prefix.split("/") if prefix else []
        rows.append({"path": prefix, "run": names[0] if len(names) >= 2 else None,
                     "action": "/".join(names[1:]) if len(names) >= 2 else (names[0] if names else None),
                     "attempts": [entry["attempts"][n] for n in sorted(entry["attempts"])],
                     "steps": sorted(entry["steps"])})
    return {"type": "task-root", "uri": loc.uri, "actions": rows}


def _what(loc: Location) -> dict[str, Any]:
    """What the URI holds: a checkpoint object, a manager directory or a task root; _Missing otherwise."""
    view = _checkpoint_view(loc) or _manager_view(loc) or _task_root_view(loc)
    if view is None:
        if loc.container_missing():
            raise _Failed(ERROR, f"{loc.uri}: the bucket or container does not exist. Create it, or fix the URI.")
        raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
    return view


def _print_json(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=True))


# -- ls -------------------------------------------------------------------------------------------------------


@cli.command("ls")
@click.argument("uri")
@click.option("--json", "as_json", is_flag=True, help="print JSON for machines")
@_command
def ls_command(uri: str, as_json: bool) -> int:
    """List what URI holds: a checkpoint object, a CheckpointManager directory, or a task root.

    A checkpoint object shows its record (<uri>.taskpoint.json); a manager directory its steps (state, size,
    save time, attempt, metadata keys); a task root its runs, actions and attempts. States come from the
    listing and the manifests (sizes checked); `taskpoint verify` checks every byte.

    \b
    Examples:
      taskpoint ls ./.taskpoint
      taskpoint ls s3://bucket/runs/job7/train/steps --json
      taskpoint ls gs://bucket/ckpt -o token=anon
    """
    view = _what(_location(uri))
    if as_json:
        _print_json(view)
    elif view["type"] == "checkpoint":
        listed = len(view["objects"])
        click.echo(f"{view['uri']}  {view['state']}  {view['kind'] or '-'}  {_human(view['size'])}  "
                   f"saved {_time(view['created'])} UTC  ({listed} object(s) in its record)")
    elif view["type"] == "manager":
        click.echo(f"{view['uri']}: {sum(r['state'] == 'committed' for r in view['steps'])} committed step(s)")
        click.echo(f"{'STEP':>6}  {'STATE':<10}  {'KIND':<9}  {'SIZE':>10}  {'SAVED (UTC)':<19}  ATTEMPT  METADATA")
        for row in view["steps"]:
            attempt = "-" if row["attempt"] is None else str(row["attempt"])
            click.echo(f"{row['step']:>6}  {row['state']:<10}  {row['kind'] or '-':<9}  {_human(row['size']):>10}  "
                       f"{_time(row['created']):<19}  {attempt:>7}  {','.join(row['metadata_keys']) or '-'}")
    else:
        click.echo(f"{view['uri']}: {len(view['actions'])} action(s)")
        for row in view["actions"]:
            attempts = " ".join(f"{a['attempt']}" + (f"({_human(a['checkpoint_size'])})"
                                                     if a["checkpoint_size"] is not None else "")
                                for a in row["attempts"]) or "-"
            steps = f"  steps {row['steps'][0]}..{row['steps'][-1]} ({len(row['steps'])})" if row["steps"] else ""
            click.echo(f"  {row['path'] or '.'}  attempts {attempts}{steps}")
    return OK


# -- show -----------------------------------------------------------------------------------------------------


@cli.command("show")
@click.argument("uri")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="the step of a manager directory (default: the newest)")
@click.option("--json", "as_json", is_flag=True, help="print JSON for machines")
@_command
def show_command(uri: str, step: int | None, as_json: bool) -> int:
    """Show the record of a checkpoint object, or the manifest and user metadata of one step.

    \b
    Examples:
      taskpoint show ./.taskpoint/job7/train/3/checkpoint
      taskpoint show s3://bucket/runs/steps --step 1200 --json
    """
    loc = _location(uri)
    view = None if step is not None else _checkpoint_view(loc)
    if view is None:
        with CheckpointManager(loc.uri, storage_options=loc.storage_options) as manager:
            chosen = step if step is not None else manager.latest_step()
            if chosen is None:
                if _task_root_view(loc) is not None:
                    raise _Failed(ERROR, f"{loc.uri} is a task root: give one attempt's checkpoint or a steps "
                                         "folder (taskpoint ls lists them)")
                raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
        manifest = _steps(loc).manifest(chosen)
        if manifest is None:
            raise _Missing(f"step {chosen} does not exist in {loc.uri}")
        view = {"type": "step", "uri": _steps(loc).step_uri(chosen), "step": manifest.step,
                "payload": manifest.payload, "attempt": manifest.attempt, **asdict(manifest.record),
                "metadata": manifest.metadata}
    if as_json:
        _print_json(view)
        return OK
    for key, value in view.items():
        if key == "objects":
            click.echo("objects:")
            for entry in value:
                click.echo("  - " + ", ".join(f"{k}={_time(v) + ' UTC' if k == 'created' else v}"
                                              for k, v in entry.items()))
        elif key == "metadata":
            click.echo("metadata: " + json.dumps(value, indent=2, sort_keys=True).replace("\n", "\n  "))
        elif key == "created":
            click.echo(f"created: {_time(value)} UTC")
        else:
            click.echo(f"{key}: {value}")
    return OK


# -- verify ---------------------------------------------------------------------------------------------------


class _Discard(Payload):
    """Reads the stored bytes through taskpoint's reader (hashing them) and keeps none: verification only."""

    kind = "verify"
    archived = False

    @classmethod
    def claim(cls, data: object) -> Payload | None:
        return None

    def write(self, sink: IO[bytes], codec: Codec, level: int | None) -> None:  # pragma: no cover - never saved
        raise NotImplementedError

    @classmethod
    def materialize(cls, source: IO[bytes], staging: Path, uri: str) -> None:
        while source.read(WRITE_PIECE):
            pass

    @classmethod
    def publish(cls, staging: Path, workspace: Path) -> Path:
        return workspace


def _stream_check(loc: Location, digest: str, size_hint: int | None, check: Callable[[int, str], None]) -> int:
    """Stream the object at ``loc`` and hash every byte (on local disk by positional reads, elsewhere through
    taskpoint's reader with its parallel ranged reads); ``check(size, hexdigest)`` decides. Returns the size.
    Nothing is extracted or kept."""
    seen: list[int] = []

    def verify(kind: str, size: int, hexdigest: str) -> None:
        check(size, hexdigest)
        seen.append(size)

    if loc.is_local:
        def local() -> None:
            with loc.open_read() as raw:
                fd = raw.fileno()
                size = os.fstat(fd).st_size
                hasher = DIGESTS[digest]()
                hashed = digest_by_reading(fd, size, hasher)
                verify("", hashed, str(hasher.hexdigest()))

        try:
            loc.run(local, action="verify")
        except FileNotFoundError:
            raise _Missing(f"{loc.uri} does not exist") from None
        return seen[-1]
    scratch = Path(tempfile.mkdtemp(prefix="taskpoint-verify-"))
    try:
        found = read_payload(loc, scratch, lambda head, size: _Discard, verify, digest, size_hint=size_hint)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if found is None:
        raise _Missing(f"{loc.uri} does not exist")
    return seen[-1]


def _verify_checkpoint(loc: Location) -> str:
    """Check a checkpoint object against its record; the line to print. CheckpointCorruptError when damaged."""
    record = read_record(loc.sibling(MANIFEST_SUFFIX))
    if record is None or not record.objects:
        if _object_size(loc) is None:
            raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
        # No digest to compare with (Flyte's object, or an older taskpoint's pending save): a full load into
        # a temporary folder runs the archive's own checks.
        scratch = Path(tempfile.mkdtemp(prefix="taskpoint-verify-"))
        try:
            load_object(loc, scratch)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        return f"{loc.uri}: readable (no recorded checksum: checked by loading it, with the archive's own checks)"
    newest = record.of_size(None)
    assert newest is not None
    digest = "sha256" if newest.crc32 is None and newest.sha256 else "crc32"

    def check(size: int, hexdigest: str) -> None:
        if not _matches(record, size, hexdigest):
            sizes = ", ".join(str(o.size) for o in record.objects)
            raise CheckpointCorruptError(f"{loc.uri} is damaged: {size} bytes that match no checksum its record "
                                         f"lists (recorded sizes {sizes})")

    try:
        size = _stream_check(loc, digest, newest.size, check)
    except _Missing:
        raise CheckpointCorruptError(f"{loc.uri} is recorded as saved but its object is missing") from None
    return f"{loc.uri}: healthy ({_human(size)}, {digest} matches its record)"


def _matches(record: Record, size: int, hexdigest: str) -> bool:
    return any(record.matching(kind, size, hexdigest) is not None for kind in {o.kind for o in record.objects})


def _verify_step(steps: StepStore, step: int) -> str:
    manifest = steps.manifest(step)
    if manifest is None:
        raise _Missing(f"step {step} does not exist in {steps.directory}")
    record = manifest.record

    def check(size: int, hexdigest: str) -> None:
        if (size, hexdigest) != (record.size, record.sha256):
            raise CheckpointCorruptError(f"step {step} in {steps.directory} is damaged: read {size} bytes that do "
                                         f"not match the sha256 of its manifest (recorded size {record.size})")

    try:
        size = _stream_check(steps.object(step, manifest.payload), "sha256", record.size, check)
    except _Missing:
        raise CheckpointCorruptError(f"step {step} in {steps.directory} is damaged: its payload "
                                     f"{manifest.payload} is missing") from None
    return f"step {step}: healthy ({_human(size)}, sha256 matches its manifest)"


@cli.command("verify")
@click.argument("uri")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="check only this step of a manager directory (default: every committed step)")
@_command
def verify_command(uri: str, step: int | None) -> int:
    """Stream every byte of a checkpoint (or of a manager's steps) and check it against its recorded checksum.

    Nothing is extracted: the stored bytes are hashed as they stream. Exit code 0 healthy, 1 error (storage,
    usage), 2 damaged (the object or step is named), 3 not found.

    \b
    Examples:
      taskpoint verify ./.taskpoint/job7/train/3/checkpoint
      taskpoint verify s3://bucket/runs/steps --step 1200 && echo intact
    """
    loc = _location(uri)
    started = time.perf_counter()
    if step is None and (read_record(loc.sibling(MANIFEST_SUFFIX)) is not None or _object_size(loc) is not None):
        click.echo(_verify_checkpoint(loc))
        return OK
    steps = _steps(loc)
    if step is not None:
        click.echo(_verify_step(steps, step))
        return OK
    committed = sorted(n for n, folder in steps.scan().items() if folder.committed)
    if not committed:
        raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
    damaged = []
    for number in committed:
        try:
            click.echo(_verify_step(steps, number))
        except CheckpointCorruptError as exc:
            damaged.append(number)
            click.echo(f"step {number}: DAMAGED: {' '.join(str(exc).split())}")
    elapsed = time.perf_counter() - started
    if damaged:
        raise CheckpointCorruptError(f"{len(damaged)} of {len(committed)} step(s) in {loc.uri} are damaged: "
                                     f"{', '.join(map(str, damaged))}")
    click.echo(f"{loc.uri}: {len(committed)} step(s) healthy in {elapsed:.2f} s")
    return OK


# -- pull and push --------------------------------------------------------------------------------------------


@contextmanager
def _transfers() -> Iterator[list[TransferStats]]:
    """The figures of the saves and loads inside the block, from taskpoint's own log records."""
    found: list[TransferStats] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            stats = getattr(record, "transfer", None)
            if isinstance(stats, TransferStats):
                found.append(stats)

    handler, level = Collect(logging.INFO), logger.level
    logger.addHandler(handler)
    if not logger.isEnabledFor(logging.INFO):
        logger.setLevel(logging.INFO)
    try:
        yield found
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def _figures(stats: TransferStats) -> str:
    return f"{stats.kind}, {_human(stats.bytes)} in {stats.total_seconds:.2f} s, {stats.mb_per_s:.1f} MB/s"


@cli.command("pull")
@click.argument("uri")
@click.argument("dest", type=click.Path(file_okay=False, path_type=Path))
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="the step of a manager directory (default: the newest)")
@_command
def pull_command(uri: str, dest: Path, step: int | None) -> int:
    """Load a checkpoint (or a manager's step) into the folder DEST, verified as the API loads it.

    A directory checkpoint's entries replace same-named entries in DEST; bytes and file checkpoints land as
    DEST/payload. Nothing lands before the checksum matches.

    \b
    Examples:
      taskpoint pull s3://bucket/runs/job7/train/3/checkpoint ./restored
      taskpoint pull s3://bucket/runs/steps ./restored --step 1200
    """
    loc = _location(uri)
    with _transfers() as seen:
        if step is None and (read_record(loc.sibling(MANIFEST_SUFFIX)) is not None
                             or _object_size(loc) is not None):
            with Checkpoint(loc.uri, loc.uri, storage_options=loc.storage_options, workspace=dest) as cp:
                result = cp.load_sync()
            if result is None:
                raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
        else:
            with CheckpointManager(loc.uri, storage_options=loc.storage_options) as manager:
                if step is None and manager.latest_step() is None:
                    raise _Missing(f"nothing taskpoint saved is at {loc.uri}")
                result = manager.restore(step, into=dest)
    click.echo(f"pulled {safe_uri(loc.uri)} -> {result}" + (f" ({_figures(seen[-1])})" if seen else ""))
    return OK


@cli.command("push")
@click.argument("src", type=click.Path(exists=True, path_type=Path))
@click.argument("uri")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="save as this step of a manager directory (URI is then the directory)")
@click.option("--metadata", default=None, metavar="JSON", help="with --step: the step's metadata, a JSON object")
@click.option("--overwrite", is_flag=True, help="with --step: replace the step if it exists")
@click.option("--codec", type=click.Choice(["gzip", "zstd", "none"]), default="gzip", show_default=True,
              help="archive codec for folders")
@_command
def push_command(src: Path, uri: str, step: int | None, metadata: str | None, overwrite: bool, codec: str) -> int:
    """Save the file or folder SRC to URI (atomic, checksummed, as the API saves).

    \b
    Examples:
      taskpoint push ./model s3://bucket/runs/job7/train/1/checkpoint
      taskpoint push ./model s3://bucket/runs/steps --step 1200 --metadata '{"loss": 0.31}'
    """
    loc = _location(uri)
    if step is None and (metadata is not None or overwrite):
        raise _Failed(ERROR, "--metadata and --overwrite go with --step (a manager directory)")
    with _transfers() as seen:
        if step is None:
            with Checkpoint(loc.uri, storage_options=loc.storage_options, codec=codec) as cp:
                cp.save_sync(src)
            where = loc.uri
        else:
            try:
                meta = json.loads(metadata) if metadata is not None else None
            except ValueError as exc:
                raise _Failed(ERROR, f"--metadata must be a JSON object: {exc}") from None
            with CheckpointManager(loc.uri, storage_options=loc.storage_options, codec=codec) as manager:
                where = manager.save(src, step, metadata=meta, overwrite=overwrite)
    click.echo(f"pushed {src} -> {safe_uri(where)}" + (f" ({_figures(seen[-1])})" if seen else ""))
    return OK


# -- rm and gc ------------------------------------------------------------------------------------------------


@cli.command("rm")
@click.argument("uri")
@click.option("--step", type=click.IntRange(min=0), required=True, help="the step to delete")
@_command
def rm_command(uri: str, step: int) -> int:
    """Delete one step of a CheckpointManager directory (its manifest first, so it stops existing at once).

    \b
    Example:
      taskpoint rm s3://bucket/runs/steps --step 1100
    """
    loc = _location(uri)
    with CheckpointManager(loc.uri, storage_options=loc.storage_options) as manager:
        manager.delete(step)
    click.echo(f"deleted step {step} of {safe_uri(loc.uri)}")
    return OK


@cli.command("gc")
@click.argument("directory")
@click.option("--grace", type=click.FloatRange(min=0), default=None,
              help="only remove leftovers older than this many seconds (default: the manager's)")
@click.option("--dry-run", is_flag=True, help="list what would be removed, remove nothing")
@_command
def gc_command(directory: str, grace: float | None, dry_run: bool) -> int:
    """Remove leftovers of interrupted saves under a CheckpointManager directory (committed steps stay).

    On S3 this also aborts unfinished multipart uploads of payloads. Storage options come from
    --storage-option and $TASKPOINT_STORAGE_OPTIONS (a JSON object), as for tasks.

    \b
    Examples:
      taskpoint gc s3://bucket/runs/steps --dry-run
      taskpoint gc ./checkpoints --grace 0
    """
    loc = _location(directory)
    with CheckpointManager(loc.uri, storage_options=loc.storage_options) as manager:
        removed = manager.gc(grace_seconds=grace, dry_run=dry_run)
    verb = "would remove" if dry_run else "removed"
    for found in removed:
        click.echo(f"{verb} {safe_uri(found)}")
    click.echo(f"taskpoint gc: {len(removed)} leftover(s) {verb.replace('would remove', 'would be removed')}")
    return OK


# -- run ------------------------------------------------------------------------------------------------------


@cli.command("run", context_settings={"allow_interspersed_args": False})
@click.option("--checkpoint-path", help="where this attempt saves (any fsspec URL)")
@click.option("--prev-checkpoint", help="where the previous attempt saved")
@click.option("--root", help="storage root for root mode (sets TASKPOINT_ROOT)")
@click.option("--run-name", help="run name (sets TASKPOINT_RUN_NAME)")
@click.option("--action-name", help="action name (sets TASKPOINT_ACTION_NAME; default 'main' in root mode)")
@click.option("--attempt", type=int, help="attempt number from 1 (sets TASKPOINT_ATTEMPT)")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
def run_command(checkpoint_path: str | None, prev_checkpoint: str | None, root: str | None, run_name: str | None,
                action_name: str | None, attempt: int | None, cmd: tuple[str, ...]) -> int:
    """Run CMD so that taskpoint.ctx() inside it has a checkpoint.

    Give the locations (--checkpoint-path/--prev-checkpoint, Flyte's flags) or a root, run and action (the
    attempt then comes from --attempt, an orchestrator's restart counter, or storage). Exit code: CMD's; 2
    for a usage error, 127 when CMD is not found.

    \b
    Examples:
      taskpoint run --root s3://bucket/runs --run-name job7 -- python train.py
      taskpoint run --checkpoint-path s3://b/2/ckpt --prev-checkpoint s3://b/1/ckpt -- python train.py
    """
    args = list(cmd)
    if args and args[0] == "--":
        args = args[1:]
    if not args:
        click.echo("taskpoint run: give the command to run after --", err=True)
        return 2
    if prev_checkpoint and not checkpoint_path:
        click.echo("taskpoint run: --prev-checkpoint needs --checkpoint-path", err=True)
        return 2
    if attempt is not None and attempt < 1:
        click.echo("taskpoint run: --attempt counts from 1", err=True)
        return 2
    env = dict(os.environ)
    for name, value in ((layout.ENV_CHECKPOINT_PATH, checkpoint_path), (layout.ENV_PREV_CHECKPOINT, prev_checkpoint),
                        (layout.ENV_ROOT, root), (layout.ENV_RUN_NAME, run_name),
                        (layout.ENV_ACTION_NAME, action_name),
                        (layout.ENV_ATTEMPT, None if attempt is None else str(attempt))):
        if value is not None:
            env[name] = value
    if env.get(layout.ENV_ROOT) and env.get(layout.ENV_RUN_NAME) and not env.get(layout.ENV_ACTION_NAME):
        env[layout.ENV_ACTION_NAME] = "main"
    if not env.get(layout.ENV_CHECKPOINT_PATH) and not (env.get(layout.ENV_ROOT) and env.get(layout.ENV_RUN_NAME)):
        click.echo("taskpoint run: give --checkpoint-path, or --root with --run-name", err=True)
        return 2
    sys.stdout.flush()
    try:
        os.execvpe(args[0], args, env)
    except FileNotFoundError:
        click.echo(f"taskpoint run: command not found: {args[0]}", err=True)
        return 127
    return 0  # pragma: no cover - exec does not return


# -- entry point ----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The console script: run the command line and return its exit code."""
    try:
        result = cli.main(args=argv, prog_name="taskpoint", standalone_mode=False)
    except click.exceptions.UsageError as exc:
        name = exc.ctx.info_name if exc.ctx is not None and exc.ctx.parent is not None else None
        where = f"taskpoint {name}" if name else "taskpoint"
        click.echo(f"{where}: {' '.join(exc.format_message().split())} (see '{where} --help')", err=True)
        return 2 if name == "run" else ERROR  # run keeps the conventional 2; elsewhere 2 means damaged
    except click.exceptions.Abort:
        click.echo("taskpoint: interrupted", err=True)
        return 130
    except click.exceptions.ClickException as exc:
        click.echo(f"taskpoint: {exc.format_message()}", err=True)
        return ERROR
    return result if isinstance(result, int) else OK


if __name__ == "__main__":
    sys.exit(main())
