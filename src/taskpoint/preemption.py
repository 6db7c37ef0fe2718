"""Noticing preemption: signal handlers that record a notice and chain whatever handler was there before.

A platform about to stop a process says so with a signal: Kubernetes and most clouds send ``SIGTERM`` and
``SIGKILL`` a grace period later (``terminationGracePeriodSeconds``, 30 s by default); Slurm sends the
signal of ``--signal=USR1@90`` before the time limit. :func:`install` puts a handler on each signal that
records a :class:`Notice` (the first one wins; later ones are counted) and then calls the handler that was
installed before it, so torchelastic's, Lightning's or the user's own handler still runs.

What a signal whose previous disposition was the default (terminate) does: the notice is recorded and the
program carries on to its next safe point (a ``CheckpointManager.save`` or ``ctx().checkpoint_if_preempted()``),
which saves and ends the process. A program that reaches none still ends by the signal: at the deadline
(``TASKPOINT_GRACE_SECONDS`` after the notice) a watchdog thread delivers it again, and a *second* such
signal while no emergency save runs restores the default and delivers it once more. During an emergency
save further signals are only counted and the deadline waits (the save runs to its commit, then the
process ends; the platform's ``SIGKILL`` remains the hard limit); the count is logged once the save ends.
Once the emergency save committed and the process ends (:func:`ending`), a repeated signal is absorbed too:
a launcher that signals every process again when one of them exits (torchrun's agent does, SIGKILL 30 s
later) must leave the exit status 128 + signal. The signal is then ignored (``SIG_IGN``, from the main thread):
the interpreter's exit puts the default disposition back before it unloads the modules (with torch loaded,
a second or more), and the default would end the process by the signal instead (status -15, not 143). Off
the main thread the handler absorbs it until the deadline. :func:`clear` puts the handler back.
``SIG_IGN`` stays ignored (the notice is still recorded).

Handlers are installed only from the main thread (Python's rule), once per signal, and work under asyncio and
trio: both run Python-level handlers installed with :func:`signal.signal` from the main thread. The handler
only assigns module globals, here and in :mod:`taskpoint.notice` (no locks: it runs between two bytecodes of
the main thread, which may hold any lock). The notice itself, and the clouds' spot notices that come over
HTTP, are :mod:`taskpoint.notice`'s; this module re-exports them and imports nothing else of taskpoint: the
manager and the runtime both use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from types import FrameType
from typing import Any

from .notice import (
    DEFAULT_GRACE_SECONDS,
    ENV_GRACE_SECONDS,
    ENV_SPOT,
    ENV_SPOT_INTERVAL,
    ENV_SPOT_URL,
    Notice,
    NoticePoller,
    forget,
    grace_seconds,
    notice,
    notices,
    notify,
    poll_from_environment,
)

__all__ = [
    "DEFAULT_GRACE_SECONDS",
    "DEFAULT_SIGNALS",
    "ENV_GRACE_SECONDS",
    "ENV_SIGNALS",
    "ENV_SPOT",
    "ENV_SPOT_INTERVAL",
    "ENV_SPOT_URL",
    "Handler",
    "Notice",
    "NoticePoller",
    "clear",
    "configured_signals",
    "emergency",
    "ending",
    "grace_seconds",
    "install",
    "installed",
    "notice",
    "notices",
    "notify",
    "poll_from_environment",
    "uninstall",
]

#: Comma-separated signal names (``TERM,USR1``) that replace the default set, ``SIGTERM``.
ENV_SIGNALS = "TASKPOINT_PREEMPTION_SIGNALS"
DEFAULT_SIGNALS: tuple[signal.Signals, ...] = (signal.SIGTERM,)

Handler = Callable[[int, FrameType | None], Any] | int | None

_logger = logging.getLogger("taskpoint")
_previous: dict[int, Handler] = {}
_signalled = 0
_saving = 0
#: Signals only counted because an emergency save ran or the process was ending after one.
_absorbed = 0
#: Set by :func:`ending`: the emergency save committed and the process is ending with 128 + signal.
_ending = False
#: The signals :func:`ending` set to ``SIG_IGN`` (our handler goes back on them at :func:`clear`).
_ignored: set[int] = set()
_install_lock = threading.Lock()
#: Set by the handler when a signal with the default disposition arrived: the watchdog's deadline starts.
_armed = threading.Event()
_watchdog: threading.Thread | None = None


def configured_signals() -> tuple[signal.Signals, ...]:
    """The signals from ``$TASKPOINT_PREEMPTION_SIGNALS`` (``TERM,USR1``), else ``SIGTERM``."""
    raw = os.environ.get(ENV_SIGNALS, "").strip()
    if not raw:
        return DEFAULT_SIGNALS
    return tuple(_signal(name) for name in raw.split(",") if name.strip())


def _signal(name: str | int) -> signal.Signals:
    if isinstance(name, int):
        return signal.Signals(name)
    text = name.strip().upper()
    try:
        return signal.Signals[text if text.startswith("SIG") else f"SIG{text}"]
    except KeyError:
        raise ValueError(f"unknown signal {name!r} (expected a name such as TERM, USR1 or SIGUSR2)") from None


def install(signals: Iterable[str | int] | None = None) -> bool:
    """Install the notice handler on ``signals`` (default :func:`configured_signals`); True when it is
    installed on all of them, or was once. Off the main thread it installs nothing and returns False. A
    signal it was installed on is left as it is: installing twice chains nothing twice, and a handler
    installed over ours later (which may chain to ours) is not replaced, which would make each call the
    other forever."""
    if threading.current_thread() is not threading.main_thread():
        return False
    wanted = configured_signals() if signals is None else tuple(_signal(s) for s in signals)
    with _install_lock:
        for sig in wanted:
            if sig in _previous:
                continue
            previous = signal.signal(sig, _handle)
            # Never chain to ourselves (our handler put back by someone who saved it, after an uninstall):
            # that would call this handler forever.
            _previous[sig] = signal.SIG_DFL if previous is _handle else previous
        global _watchdog
        if _watchdog is None:
            _watchdog = threading.Thread(target=_watch, name="taskpoint-preemption-deadline", daemon=True)
            _watchdog.start()
    if os.environ.get(ENV_SPOT, "").strip():
        poll_from_environment()
    return True


def _watch() -> None:
    """At the deadline of a notice whose signal had the default disposition, deliver the signal again (our
    handler then ends the process with it), unless the notice was cleared; never during an emergency save."""
    while True:
        _armed.wait()
        _armed.clear()
        armed = notice()
        while armed is not None and notice() is armed and (time.time() < armed.deadline or _saving):
            time.sleep(0.05)
        if armed is not None and notice() is armed:
            os.kill(os.getpid(), armed.signal)


def uninstall() -> None:
    """Put back the handlers :func:`install` replaced, where ours is still the one installed (main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return
    with _install_lock:
        for sig, previous in list(_previous.items()):
            if signal.getsignal(sig) is _handle:
                signal.signal(sig, previous if previous is not None else signal.SIG_DFL)
            del _previous[sig]


def installed() -> tuple[int, ...]:
    """The signals the handler is installed on."""
    return tuple(sig for sig in _previous if signal.getsignal(sig) is _handle)


def clear() -> None:
    """Forget the notice (a new attempt in the same process after an emergency save)."""
    global _signalled, _absorbed, _ending
    forget()
    _signalled, _absorbed, _ending = 0, 0, False
    if threading.current_thread() is threading.main_thread():
        for sig in list(_ignored):
            if signal.getsignal(sig) == signal.SIG_IGN:
                signal.signal(sig, _handle)
            _ignored.discard(sig)


@contextlib.contextmanager
def emergency() -> Iterator[None]:
    """While inside, a repeated signal is only counted: the emergency save runs to its commit. On the way out
    a line at WARNING says how many were absorbed, if any."""
    global _saving
    before = _absorbed
    _saving += 1
    try:
        yield
    finally:
        _saving -= 1
        if _absorbed > before:
            current = notice()
            name = current.name if current is not None else "the signal"
            _logger.warning("taskpoint: %s arrived %d more time(s) during the emergency save; absorbed, so that "
                            "the save ran to its end", name, _absorbed - before)


def ending(message: str, *args: object) -> None:
    """The process is about to end with 128 + signal after its emergency save: log ``message % args`` at
    WARNING, also on stderr when the application configured no logging (the package's own ``NullHandler``
    would swallow it: a preempted process must say what it saved and where), and absorb repeated signals from
    now on (see the module's docstring)."""
    global _ending
    _ending = True
    if threading.current_thread() is threading.main_thread():
        with _install_lock:
            for sig, previous in _previous.items():
                if previous in (signal.SIG_DFL, None) and signal.getsignal(sig) is _handle:
                    signal.signal(sig, signal.SIG_IGN)
                    _ignored.add(sig)
    if not _logger.isEnabledFor(logging.WARNING):
        return
    _logger.warning(message, *args, stacklevel=2)
    if not _shown(_logger) and logging.lastResort is not None:
        logging.lastResort.handle(_logger.makeRecord(_logger.name, logging.WARNING, "", 0, message, args, None))


def _shown(logger: logging.Logger) -> bool:
    """Whether a handler other than a ``NullHandler`` on ``logger`` or its ancestors takes WARNING records."""
    current: logging.Logger | None = logger
    while current is not None:
        if any(not isinstance(h, logging.NullHandler) and h.level <= logging.WARNING for h in current.handlers):
            return True
        current = current.parent if current.propagate else None
    return False


def _handle(signum: int, frame: FrameType | None) -> None:
    global _signalled, _absorbed
    _signalled += 1
    first = _signalled == 1
    notify(signum)
    previous = _previous.get(signum, signal.SIG_DFL)
    if callable(previous):
        previous(signum, frame)
    elif previous == signal.SIG_IGN:
        return
    elif first:
        _armed.set()  # the default would have ended the process: it ends at the deadline at the latest
    elif _saving or (_ending and (current := notice()) is not None and time.time() < current.deadline):
        _absorbed += 1  # the emergency save runs to its end; the process ends with 128 + signal after it
    else:
        # The default disposition, signalled again with no emergency save running: end as it would have.
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


