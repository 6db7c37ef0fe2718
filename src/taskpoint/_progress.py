"""Progress of one save or load: counts from taskpoint's own pipeline, handed to a callback or a bar.

Every save and load takes ``progress=``: True (a bar), False (nothing), None (the default: a bar only when
stderr is a terminal and the transfer lasts longer than :data:`AUTO_DELAY` seconds) or an
``fsspec.callbacks.Callback`` (``TqdmCallback``, or one of the user's own). :func:`resolve` turns that value
into a :class:`Progress`; the pipeline counts bytes where it moves them (``transfer``, ``folders``, the
manager's dedup and save process) and a ticker thread hands the sum to the callback every :data:`TICK`
seconds. The callback gets ``set_size(total)`` as soon as the total is known and ``relative_update``\\ s that
sum to exactly that total; a transfer that starts over after a transient failure reports only the bytes
beyond the furthest point an earlier attempt reached. What the total counts is in docs/checkpoint.md
("Progress"). The bar is tqdm's when tqdm is importable, else one line on stderr; no dependency is added.
"""

from __future__ import annotations

import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import IO, Any

from fsspec.callbacks import Callback

#: Seconds between two hand-overs of the count to the callback (and redraws of the bar).
TICK = 0.2
#: With ``progress=None`` on a terminal, the bar appears once a transfer has lasted this long.
AUTO_DELAY = 2.0

ACCEPTED = "True, False, None or an fsspec.callbacks.Callback (e.g. fsspec.callbacks.TqdmCallback())"

#: Seconds on a monotonic clock: what times the bar's delay and rate (``time.monotonic``; a test gives its own).
Clock = Callable[[], float]


class Progress:
    """What the pipeline reports to; this base class reports nowhere (``progress=False``, or no terminal)."""

    #: False when nothing listens: callers may skip work done only for the progress (a directory's walk).
    active = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        pass

    def set_total(self, total: int | None) -> None:
        """The transfer's total, once known (None: not known yet)."""

    def update(self, n: int) -> None:
        """``n`` more bytes of the transfer moved (any thread)."""

    def restart(self) -> None:
        """The transfer starts over (a retry): its counting starts from zero again, and only bytes beyond the
        furthest point reached before are reported."""

    def piece(self) -> Piece:
        """A separately counted part of the transfer (one file of a folder) that may start over on its own."""
        return Piece(self)

    def rewind(self) -> None:
        """Another transfer replaces this one (a restore that falls back or follows a newer manifest): the
        count goes back to zero, by one negative ``relative_update``."""

    def _add(self, n: int) -> None:
        """Bytes beyond what was reported before (from :class:`Piece`)."""


class Piece:
    """One part of a transfer, counted on its own: when it starts over, only its bytes beyond the furthest
    point an earlier attempt reached count again, so a retried part never counts twice."""

    def __init__(self, owner: Progress) -> None:
        self._owner = owner
        self._done = 0
        self._reached = 0

    def update(self, n: int) -> None:
        self._done += n
        if self._done > self._reached:
            self._owner._add(self._done - self._reached)
            self._reached = self._done

    def restart(self) -> None:
        self._done = 0


#: Nothing listens.
NO_PROGRESS = Progress()


class Ticks:
    """When the ticker thread hands the count over: every :data:`TICK` seconds. A test gives its own, one tick at
    a time, to check what each tick hands over without timing anything."""

    def __init__(self, interval: float = TICK) -> None:
        self._interval = interval
        self.stopped = threading.Event()

    def wait(self) -> bool:
        """Wait for the next tick: True, or False once :meth:`stop` was called (the ticker ends)."""
        return not self.stopped.wait(self._interval)

    def stop(self) -> None:
        self.stopped.set()


class _Tracker(Progress):
    """Adds up the pipeline's counts and hands them to ``sink`` at each of ``ticks`` (from a ticker thread) and
    at the end: every tick hands over all that was counted since the one before, and a tick with nothing new
    calls nothing."""

    active = True

    def __init__(self, sink: Callback, *, owned: bool, ticks: Ticks | None = None) -> None:
        self._sink = sink
        self._owned = owned  # our own bar: closed with the transfer; a caller's callback is the caller's
        self._lock = threading.RLock()
        self._total: int | None = None
        self._pending = 0
        self._shown = 0
        self._main = Piece(self)
        self._ticks = ticks or Ticks()
        self._ticker: threading.Thread | None = None
        self._broken = False  # the callback raised: it is not called again

    def _call(self, method: str, value: int) -> None:
        """``sink.<method>(value)``; an exception from the callback becomes a warning, and the callback is not
        called again: reporting progress never fails a save or a load."""
        if self._broken:
            return
        try:
            getattr(self._sink, method)(value)
        except Exception as exc:
            self._broken = True
            warnings.warn(f"the progress callback raised {type(exc).__name__}: {exc}; taskpoint stopped calling "
                          "it (the transfer goes on)", RuntimeWarning, stacklevel=2)

    def __enter__(self) -> Progress:
        if self._ticker is None:
            self._ticker = threading.Thread(target=self._tick, name="taskpoint-progress", daemon=True)
            self._ticker.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *rest: object) -> None:
        try:
            if exc_type is None:
                self._finish()
        finally:
            self._close()

    def _tick(self) -> None:
        while self._ticks.wait():
            with self._lock:
                self._flush()
                if isinstance(self._sink, _Bar):
                    self._sink.tick()

    def set_total(self, total: int | None) -> None:
        if total is not None:
            with self._lock:
                if total != self._total:
                    self._total = total
                    self._call("set_size", total)

    def update(self, n: int) -> None:
        with self._lock:
            self._main.update(n)

    def restart(self) -> None:
        with self._lock:
            self._main.restart()

    def _add(self, n: int) -> None:
        with self._lock:
            self._pending += n

    def _flush(self) -> None:
        with self._lock:
            if self._pending:
                pending, self._pending = self._pending, 0
                self._shown += pending
                self._call("relative_update", pending)

    def rewind(self) -> None:
        with self._lock:
            self._flush()
            if self._shown:
                self._call("relative_update", -self._shown)
            self._shown = 0
            self._main = Piece(self)

    def _finish(self) -> None:
        """The transfer succeeded: the last count, and the total made equal to the sum of the updates (a
        total that was not known, or a source that changed size, is corrected by one more ``set_size``)."""
        with self._lock:
            self._flush()
            if self._total != self._shown:
                self.set_total(self._shown)
            if isinstance(self._sink, _Bar):
                self._sink.tick()

    def _close(self) -> None:
        self._ticks.stop()
        if self._ticker is not None and self._ticker is not threading.current_thread():
            self._ticker.join()
        if self._owned:
            self._sink.close()


def resolve(progress: object, label: str, *, background: bool = False, stream: IO[str] | None = None,
            clock: Clock = time.monotonic, ticks: Ticks | None = None) -> Progress:
    """The :class:`Progress` for a ``progress=`` argument; TypeError for anything else. ``label`` names the
    transfer on a bar; ``background``: the caller does not wait (a background save shows no bar unless asked).
    ``stream`` (default: stderr at the call) takes the bar; ``clock`` times its delay and rate and ``ticks``
    its redraws (a test gives its own of both, and times nothing)."""
    stream = sys.stderr if stream is None else stream
    if progress is False:
        return NO_PROGRESS
    if progress is True:
        return _Tracker(_Bar(label, 0.0, stream, clock), owned=True, ticks=ticks)
    if progress is None:
        if background or not _is_terminal(stream):
            return NO_PROGRESS
        return _Tracker(_Bar(label, AUTO_DELAY, stream, clock), owned=True, ticks=ticks)
    if isinstance(progress, Callback):
        return _Tracker(progress, owned=False)
    raise TypeError(f"progress must be {ACCEPTED}; got {type(progress).__name__}")


def check(progress: object) -> None:
    """TypeError unless ``progress`` is a value :func:`resolve` accepts (for callers that resolve later)."""
    if not (progress is None or isinstance(progress, (bool, Callback))):
        raise TypeError(f"progress must be {ACCEPTED}; got {type(progress).__name__}")


def relay(send: Callable[[str, int], None]) -> Progress:
    """A :class:`Progress` whose counts go to ``send("size", total)`` and ``send("update", n)``: the manager's
    save process reports to the caller's process this way."""
    return _Tracker(_Relay(send), owned=False)


class _Relay(Callback):  # type: ignore[misc]
    def __init__(self, send: Callable[[str, int], None]) -> None:
        super().__init__()
        self._send = send

    def set_size(self, size: int) -> None:
        self._send("size", size)

    def relative_update(self, inc: int = 1) -> None:
        self._send("update", inc)


def _is_terminal(stream: IO[str] | None) -> bool:
    try:
        return stream is not None and stream.isatty()
    except (AttributeError, ValueError):  # replaced by an object without isatty, or closed
        return False


# -- the bar ------------------------------------------------------------------------------------------------


class _Bar(Callback):  # type: ignore[misc]
    """taskpoint's own bar: tqdm's when importable, else one line redrawn on ``stream``; it appears once the
    transfer has lasted ``delay`` seconds, and is drawn from the ticker (:meth:`tick`), never per update."""

    def __init__(self, label: str, delay: float, stream: IO[str], clock: Clock = time.monotonic) -> None:
        super().__init__(size=None, value=0)
        self._label = label
        self._stream = stream
        self._clock = clock
        self._since = clock()
        self._delay = delay
        self._tqdm: Any = None
        self._line = False  # the own line was drawn
        self._shown = False
        self._closed = False

    def call(self, *args: Any, **kwargs: Any) -> None:
        """Updates only change :attr:`value` and :attr:`size`; the ticker draws."""

    def tick(self) -> None:
        if self._closed or (not self._shown and self._clock() - self._since < self._delay):
            return
        if not self._shown:
            self._shown = True
            self._tqdm = _new_tqdm(self._label, self.size, self._stream)
        if self._tqdm is not None:
            self._tqdm.total = self.size
            self._tqdm.update(self.value - self._tqdm.n)
        else:
            self._draw()

    def _draw(self) -> None:
        elapsed = max(self._clock() - self._since, 1e-9)
        done = _human(self.value)
        total = f"/{_human(self.size)}" if self.size else ""
        share = f"{100 * self.value / self.size:3.0f}% " if self.size else ""
        self._stream.write(f"\r{self._label}: {share}{done}{total} {_human(self.value / elapsed)}/s ")
        self._stream.flush()
        self._line = True

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._tqdm is not None:
            self._tqdm.close()
        elif self._line:
            self._stream.write("\n")
            self._stream.flush()


def _new_tqdm(label: str, total: int | None, stream: IO[str]) -> Any:
    """A tqdm bar of bytes, or None when tqdm is not importable."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=label, unit="B", unit_scale=True, unit_divisor=1024, file=stream,
                dynamic_ncols=True, leave=True)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
