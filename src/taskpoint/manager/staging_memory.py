"""The staging memory of one manager: the budget its background saves' segments are held in
(``max_staging_bytes``), and the one segment it keeps *ready* between saves, so that a save blocks for one copy.

A fresh segment costs the kernel allocating its pages as the copy writes them (0.03-0.08 s for 256 MiB in
``/dev/shm`` here, when they were reserved by ``posix_fallocate`` on their own), and a mapping of them would cost
more (:meth:`~.staging.Segment.fill` writes without one). So the
save process does not remove a segment it has written when asked to keep it (:class:`~.saver.StagedRequest`), and
the manager hands it to the next staged save: resized to that state's size (:meth:`~.staging.Segment.resize`, a
no-op when the size is the same) and written over with its pages in place. DCP keeps its staging buffer the same way.

The ready segment stays named for the save process that wrote it: no sweep touches it while that process runs, and
it goes with that process (which removes the segments named for it when its trainer dies, and whose own death
makes them a sweep's). It is reused only by a save to the same save process, only after that process answered
(so never while it still reads it), counts against the budget while it waits, and is freed at ``close()``.

The first staged save of a manager makes its segment, and the kernel allocating its pages as the copy writes them was
most of what that save blocked for (256 MiB: 0.10-0.20 s of the trainer's CPU, against 0.04-0.05 s for a copy into
the pages of a ready segment). The manager does not know the state's size before that save, except where it resumes:
a manager that starts its save process ahead (``async_save=True``) makes the ready segment ahead (:meth:`prepare`) at
the size of the state its newest step holds, when a background save stages that step's kind, and allocates its pages
(``posix_fallocate``, 0.07-0.1 s per 256 MiB on its own thread, the loop running on), so that a first save of the
same state blocks as a later one does.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from .._log import logger
from .staging import SEGMENT_PREFIX, WAIT_LOG_SECONDS, Segment, StagingBudget


class StagingMemory:
    """The segments of one manager's staged saves: :meth:`take` one for a save, :meth:`give_back` it once the save
    is over; at most ``limit`` bytes (``max_staging_bytes``) held in all, the ready segment included."""

    def __init__(self, limit: int | None) -> None:
        self.budget = StagingBudget(limit)
        #: The segment the last save's process wrote and handed back (or one made ahead); None when there is none.
        self.ready: Segment | None = None
        self._made = threading.Condition()  # guards the three below, and ``ready`` against :meth:`prepare`
        self._making = False  # a segment is being made ahead: a save waits for it
        self._taken = False  # a save took a segment: none is made ahead any more
        self._closed = False

    def prepare(self, size_of: Callable[[], int | None], owner: str) -> None:
        """Make the ready segment ahead: ``size_of()`` bytes (the state the newest step holds; None when unknown),
        named for the save process ``owner`` names, its pages allocated (:meth:`~.staging.Segment.reserve`). Nothing
        when a save took a segment first, the size is unknown, it does not fit the budget now, or the folder has no
        room (said in the log): the first save then makes its segment, as without. A save that comes while it is
        made waits for it (:meth:`take`), which is no longer than making its own."""
        try:
            size = size_of()
        except Exception as exc:  # the step could not be read: nothing is made ahead
            logger.info("no staging segment made ahead: the newest step's size could not be read (%s)", exc)
            return
        with self._made:
            if not size or self._taken or self._closed or not self.budget.reserve_now(size):
                return
            self._making = True
        segment: Segment | None = None
        began = time.monotonic()
        try:
            segment = Segment.create(size, owner)
            segment.reserve()
            logger.info("made a staging segment of %d bytes (the newest step's state) ahead of the first background "
                        "save, in %.3f s", size, time.monotonic() - began)
        except OSError as exc:
            logger.info("no staging segment made ahead of the first background save: %s", exc)
            if segment is not None:
                segment.free()
                segment = None
        with self._made:
            self._making = False
            made = segment is not None and not self._closed
            if made:
                self.ready = segment
            self._made.notify_all()
        if not made:  # not made, or the manager closed meanwhile
            if segment is not None:
                segment.free()
            self.budget.release(size)

    def _wait_for_prepare(self, step: int) -> None:
        """Until no segment is being made ahead (a bound: one ``posix_fallocate`` of the state's size), logged every
        :data:`~.staging.WAIT_LOG_SECONDS`. Called with ``_made`` held."""
        began = time.monotonic()
        while self._making:
            if not self._made.wait(WAIT_LOG_SECONDS):
                logger.info("step %d waits for its staging segment made ahead since %.1f s", step,
                            time.monotonic() - began)

    def take(self, size: int, step: int, owner: str | None) -> Segment | None:
        """A segment of ``size`` bytes for the save of ``step`` by the save process ``owner`` names (this process
        when None), held in the budget until :meth:`give_back`: the ready segment when it is that
        process's (resized), else a new one. None, holding nothing, when ``size`` exceeds the budget (the save is
        then made blocking). Waits as :meth:`~.staging.StagingBudget.reserve` does."""
        with self._made:
            self._taken = True
            self._wait_for_prepare(step)
            ready, self.ready = self.ready, None
        if ready is not None:
            self.budget.release(ready.size)
            if owner is None or not ready.path.name.startswith(f"{SEGMENT_PREFIX}{owner}-"):
                ready.free()  # its save process is gone: a new one would not take it
                ready = None
        if not self.budget.reserve(size, step):
            if ready is not None:
                ready.free()
            return None
        try:
            if ready is not None:
                try:
                    ready.resize(size)
                    return ready
                except FileNotFoundError:  # removed meanwhile (by hand): a new one
                    ready.free()
                    ready = None
            return Segment.create(size, owner)
        except BaseException:
            if ready is not None:
                ready.free()
            self.budget.release(size)
            raise

    def give_back(self, segment: Segment, *, kept: bool) -> None:
        """The save that :meth:`take` gave ``segment`` to is over: ``kept``, its save process wrote the segment
        and kept it, and it is the ready one; else it is freed (a no-op when the save process freed it)."""
        if kept:
            self.ready = segment
        else:
            segment.free()
            self.budget.release(segment.size)

    def close(self) -> None:
        """Free the ready segment (one being made ahead is freed once made)."""
        with self._made:
            self._closed = True
            ready, self.ready = self.ready, None
        if ready is not None:
            ready.free()
            self.budget.release(ready.size)
