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
(so never while it still reads it), counts against the budget while it waits, and is freed at ``close()``. The first
staged save of a manager makes its segment: the manager does not know the state's size before it.
"""

from __future__ import annotations

from .staging import SEGMENT_PREFIX, Segment, StagingBudget


class StagingMemory:
    """The segments of one manager's staged saves: :meth:`take` one for a save, :meth:`give_back` it once the save
    is over; at most ``limit`` bytes (``max_staging_bytes``) held in all, the ready segment included."""

    def __init__(self, limit: int | None) -> None:
        self.budget = StagingBudget(limit)
        #: The segment the last save's process wrote and handed back; None when there is none.
        self.ready: Segment | None = None

    def take(self, size: int, step: int, owner: str | None) -> Segment | None:
        """A segment of ``size`` bytes for the save of ``step`` by the save process ``owner`` names (this process
        when None), held in the budget until :meth:`give_back`: the ready segment when it is that
        process's (resized), else a new one. None, holding nothing, when ``size`` exceeds the budget (the save is
        then made blocking). Waits as :meth:`~.staging.StagingBudget.reserve` does."""
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
        """Free the ready segment."""
        ready, self.ready = self.ready, None
        if ready is not None:
            ready.free()
            self.budget.release(ready.size)
