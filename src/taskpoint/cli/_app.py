"""The ``taskpoint`` command line: look at, check, move and clean checkpoints; run a command with locations.

Commands: ``ls``, ``show``, ``verify``, ``pull``, ``cat``, ``push``, ``rm``, ``gc`` and ``run`` (see docs/cli.md).
The top layer: it imports the library and reads records and manifests with the library's own code. click is
imported here only, so ``import taskpoint`` does not load it.

Exit codes: 0 success (healthy), 1 error (storage, usage, anything unexpected), 2 damaged (names the object or
step), 3 not found, 4 newer (written by a newer taskpoint: upgrade). ``taskpoint run`` keeps its own: 2 for its
usage errors, 127 for a command not found, else the command's.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from typing import Any, TypeVar
from urllib.parse import quote, quote_plus

import click

from .. import __version__, signals
from ..errors import CheckpointCorruptError, CheckpointError, NewerFormatError, StorageError
from ..runtime import layout

#: The library's logger (a ``NullHandler`` until an application adds one): ``-v`` prints its records.
logger = logging.getLogger("taskpoint")

F = TypeVar("F", bound=Callable[..., Any])

#: Exit codes of every command but ``run`` (NEWER: a document of a format version newer than this taskpoint reads,
#: which is no damage; the next code after the four that were there, docs/cli.md).
OK, ERROR, DAMAGED, NOT_FOUND, NEWER = 0, 1, 2, 3, 4
#: The exit code of a command ended by SIGTERM (128 + 15, as a shell reports a process the signal ended).
TERMINATED = 128 + signal.SIGTERM

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
    return click.get_current_context().ensure_object(_State)


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
#: ``--progress/--no-progress`` of pull, push and verify: unset (None) shows a bar only on a terminal, and only
#: for transfers longer than about two seconds.
progress_option = click.option(
    "--progress/--no-progress", "progress", default=None,
    help="show a progress bar on stderr, or never (default: only on a terminal, for transfers over ~2 s)")


class _Terminated(BaseException):
    """SIGTERM arrived while the command line ran: raised in the main thread, so that the command's clean-up runs
    (a pull's staging folder, an upload's abort) as for Ctrl-C, and the process ends with 128 + SIGTERM."""


#: How long after a signal's exception was ignored (raised in a garbage-collection callback) the signal is sent
#: again: long enough for the main thread to be out of the callback, which takes microseconds.
REDELIVERY_DELAY = 0.01


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _redelivering(previous: Callable[[Any], object], signums: tuple[int, ...]) -> Callable[[Any], object]:
    """A ``sys.unraisablehook`` that delivers again the signals whose handler's exception Python had to ignore.
    A handler runs between any two bytecodes of the main thread, also those of a finalizer or a weakref callback
    (the garbage collector's), from which an exception cannot propagate: Python prints "Exception ignored" and
    goes on, and the SIGTERM would be lost (the campaign's SIGTERM trials met it in ``WeakSet._remove``). The
    signal is sent again instead, from another thread :data:`REDELIVERY_DELAY` later: raised at once, its handler
    would run inside this hook, which cannot raise either."""

    def hook(unraisable: Any) -> object:
        for signum, kind in ((signal.SIGTERM, _Terminated), (signal.SIGINT, KeyboardInterrupt)):
            if signum in signums and isinstance(unraisable.exc_value, kind):
                again = threading.Timer(REDELIVERY_DELAY, os.kill, (os.getpid(), signum))
                again.daemon = True
                again.start()
                return None
        return previous(unraisable)

    return hook


@contextmanager
def _ended_by_signals() -> Iterator[None]:
    """While the command line runs, SIGTERM ends it at once, cleaning up (Python's default ends the process
    without running any ``finally``); SIGTERM and Ctrl-C both wait for the steps that a signal must not cut in
    half (:func:`taskpoint.signals.uninterrupted`: a staging folder's creation and removal, a publish, the
    start of an upload). Only from the main thread; the previous handlers come back after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    installed: list[tuple[int, Any]] = []
    previous_hook = sys.unraisablehook
    try:
        installed.append((signal.SIGTERM, signal.signal(signal.SIGTERM, signals.deferrable(_terminate))))
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # not an embedding program's own
            installed.append((signal.SIGINT, signal.signal(signal.SIGINT,
                                                           signals.deferrable(signal.default_int_handler))))
        sys.unraisablehook = _redelivering(sys.unraisablehook, tuple(signum for signum, _ in installed))
        yield
    finally:
        sys.unraisablehook = previous_hook
        for signum, previous in reversed(installed):
            signal.signal(signum, previous)


def _command(fn: F) -> F:
    """A command's common options, and its errors as one line on stderr with the matching exit code."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> int:
        state = _state()
        name = click.get_current_context().info_name
        try:
            try:
                return int(fn(*args, **kwargs) or OK)
            finally:
                signals.remove_leftovers()  # what a signal kept from its removal (a pull's staging folder)
        except _Terminated:
            click.echo(f"taskpoint {name}: terminated (SIGTERM); nothing half-written is left visible", err=True)
            return TERMINATED
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
    elif isinstance(exc, NewerFormatError):  # a CheckpointCorruptError, but no damage
        code = NEWER
    elif isinstance(exc, CheckpointCorruptError):
        code = DAMAGED
    elif isinstance(exc, (KeyError, FileNotFoundError)) and not isinstance(exc, StorageError):
        code = NOT_FOUND  # KeyError: a path that is not in the checkpoint (pull --path, cat)
    else:
        code = ERROR
    text = " ".join(str(exc.args[0] if isinstance(exc, KeyError) and exc.args else exc).split()) or type(exc).__name__
    if not isinstance(exc, (CheckpointError, _Missing, _Failed, FileNotFoundError, ValueError, KeyError)):
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
    elif _ECHO_WARNINGS not in logger.handlers:
        logger.addHandler(_ECHO_WARNINGS)


class _EchoWarnings(logging.Handler):
    """The library's WARNINGs (a load that could not be verified) on stderr, one line each: they are for whoever
    runs the command, also without -v."""

    def emit(self, record: logging.LogRecord) -> None:
        click.echo(f"taskpoint: warning: {record.getMessage()}", err=True)


_ECHO_WARNINGS = _EchoWarnings(logging.WARNING)


def main(argv: list[str] | None = None) -> int:
    """The console script: run the command line and return its exit code. SIGTERM ends it with 143 from the
    moment this is called until it returns (:func:`_ended_by_signals`)."""
    try:
        with _ended_by_signals():
            return _run(argv)
    except _Terminated:  # before or after a command (while one runs, the command says so itself)
        click.echo("taskpoint: terminated (SIGTERM)", err=True)
        return TERMINATED


def _run(argv: list[str] | None) -> int:
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

