"""The record's side of one save (see :mod:`taskpoint.record`): its writes, conditional where the store has them
and merged with what other writers listed, and the reads they start from."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace

from . import _log
from .errors import CheckpointCorruptError, StorageUnavailable
from .executors import IO
from .format.records import Record
from .storage import Deadline, Location
from .storage.deadline import NO_DEADLINE
from .storage.streams import VersionConflict

#: How often a conditional record write reads the record again after another writer changed it (each conflict
#: means the other writer's write landed: only a crowd of writers at one destination exhausts this).
_CONFLICT_TRIES = 16


def merged(current: Record | None, known: Record) -> Record:
    """The record as stored, plus the objects this process knew of that it no longer lists (newest first)."""
    if current is None:
        return known
    listed = {o.save_id for o in current.objects}
    extra = tuple(o for o in known.objects if o.save_id not in listed)
    return replace(current, objects=current.objects + extra, confirmed=known.confirmed or current.confirmed)


def read_versioned(record_loc: Location) -> tuple[Record | None, str | None]:
    """The stored record (None when there is none or it is damaged: a save replaces it) and its version."""
    data, version = record_loc.read_versioned()
    return parsed(data, record_loc.uri, tolerate_corrupt=True), version


@dataclass
class SaveState:
    """What one save has written to the record so far, and the version of the record it last saw."""

    loc: Location
    record: Record
    version: str | None
    partial: bool = False
    #: The folder check still to run beside the first write (nothing was known of the record), by the deadline it is
    #: given; None when none is due.
    check: Callable[[Deadline], None] | None = None
    #: The read of the record begun with the save: a refused create takes what it read (:meth:`_stored`), and
    #: :meth:`settle` waits for it otherwise (then None).
    ahead: Future[tuple[Record | None, str | None]] | None = None
    sweep: Callable[[], None] | None = None  # sweeps leftovers, where the record met by a refused create asks it
    created: bool = False  # a write of this save found no record and made it
    refused: bool = False  # that check refused the destination (or failed): the object was never written

    def write(self, change: Callable[[Record], Record], *, action: str, outer: Deadline = NO_DEADLINE) -> None:
        """Store ``change(record)``, by ``outer`` (the deadline of the write whose hook this is). Where the store
        has conditional writes it lands only over the version this save saw; when another writer got there
        first, read the record again, keep what it lists and apply the change to that."""
        check, self.check = self.check, None
        if check is not None:
            self._beside(check, lambda: self.write(change, action=action, outer=outer))
            return
        loc = self.loc.within(outer)
        if not loc.conditional:
            self.record = change(self.record)
            loc.write_small(self.record.to_bytes(), action=action)
            return
        for _ in range(_CONFLICT_TRIES):
            candidate = change(self.record)
            try:
                self.version, self.created = (loc.write_versioned(candidate.to_bytes(), self.version, action=action),
                                              self.created or self.version is None)
                self.record = candidate
                return
            except VersionConflict:
                stored, self.version = self._stored(loc, outer)
                self.record = merged(stored, self.record)
                _log.logger.debug("another writer changed the record at %s; merged", _log.safe_uri(self.loc.uri))
        raise StorageUnavailable(
            f"could not {action} {self.loc.uri}: other writers changed its record {_CONFLICT_TRIES} times in a row. "
            "Let one process save to a destination at a time; nothing was lost.")

    def _stored(self, loc: Location, outer: Deadline) -> tuple[Record | None, str | None]:
        """The record as stored, after a conflict. After the first (a refused create, when nothing was known of
        the record) what :attr:`ahead` read, unless it found none or failed: the record came meanwhile, read again;
        and the leftovers that record asks to sweep are swept, as a save that read it first would have."""
        ahead, self.ahead = self.ahead, None
        found: tuple[Record | None, str | None] = (None, None)
        if ahead is not None:
            _log.logger.debug("the record at %s exists: waiting for its read", _log.safe_uri(self.loc.uri))
            with contextlib.suppress(Exception):
                found = ahead.result(timeout=outer.time_left())
        stored, version = found if found[1] is not None else read_versioned(loc)
        if ahead is not None and stored is not None and stored.sweep and self.sweep is not None:
            self.sweep()
        return stored, version

    def settle(self, save_id: str, waits: float | None) -> bool:
        """Wait for the record's read begun with the save, if no conflict took it, at most ``waits`` seconds (its
        retry deadline): no request of a save outlives it. True when that read found a record this save's create
        replaced (one that does not list this save, and lists what its record does not): the store ignored
        ``If-None-Match``. Then what that record listed is written back beside this save's own entries, and the
        leftovers it asked to sweep are swept: nothing it listed is lost."""
        ahead, self.ahead = self.ahead, None
        if ahead is None:
            return False
        _log.logger.debug("waiting for the read of the record at %s to end", _log.safe_uri(self.loc.uri))
        try:
            found, _ = ahead.result(timeout=waits)
        except Exception:  # failed or timed out: nothing was read to compare with
            return False
        if found is None or save_id in {o.save_id for o in found.objects}:
            return False  # no record before the create, or this save's own (or another writer's over it)
        lost = {o.save_id for o in found.objects} - {o.save_id for o in self.record.objects}
        if not lost and not (found.sweep and not self.record.sweep):
            return False  # it lists nothing this save's record does not
        _log.logger.warning(
            "the store at %s accepted this save's create-only write (If-None-Match) of the record, which replaced "
            "the record another save had written there: it ignores conditional writes. What that record listed is "
            "written back; a save killed between the two could have left the checkpoint there unlisted.",
            _log.safe_uri(self.loc.uri))
        if found.sweep and self.sweep is not None:
            self.sweep()
        self.write(lambda record: merged(record, found), action="write back the record at")
        return True

    def _beside(self, check: Callable[[Deadline], None], write: Callable[[], None]) -> None:
        """``write`` (the first) with the folder ``check`` on a pool thread meanwhile: one round trip for both.
        :attr:`refused` when the check refuses the destination or fails. When the write fails, the check is cut
        short (it starts no new attempt) and waited for only until its request in flight ends: the save raises
        the write's error, and no request of it outlives it. Waited out instead, under a total outage (the fault
        proxy: 503 SlowDown, which counts against the deadline only, and cut connections) the check went on 14 s
        after the write had failed, and the failed save sent 111 requests."""
        deadline = NO_DEADLINE.stoppable()
        with IO.lane(1) as lane:
            checked = lane.submit(check, deadline)
            try:
                write()
            except BaseException:
                deadline.cut_short()
                raise
            finally:
                self.refused = checked.exception() is not None
            checked.result()


def parsed(data: bytes | None, uri: str, *, tolerate_corrupt: bool) -> Record | None:
    """The record in ``data`` (None: there is none); a damaged one is None when ``tolerate_corrupt`` (a save
    replaces it), else :class:`~taskpoint.errors.CheckpointCorruptError`."""
    if data is None:
        return None
    try:
        return Record.from_bytes(data, uri)
    except CheckpointCorruptError:
        if tolerate_corrupt:
            return None
        raise
