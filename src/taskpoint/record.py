"""The record protocol of a checkpoint object: save with the record written before the object is visible,
load verified against it (see :mod:`taskpoint.format.records` for the format and the argument)."""

from __future__ import annotations

import contextlib
import time
import uuid
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from . import _log
from ._progress import NO_PROGRESS, Progress
from .errors import CheckpointCorruptError, StorageNotFound
from .executors import IO
from .format.codecs import Codec
from .format.records import RECORD_SUFFIX, ObjectRecord, Record
from .payloads import Payload, payload_class
from .record_writes import SaveState, merged, parsed, read_versioned
from .save_memory import SaveMemory
from .storage import Deadline, Location, RetryPolicy
from .transfer import guess_kind, read_payload, write_payload

#: How often a load re-reads the record and follows it when the object it read is not listed (each time, a
#: save of another process wrote the record after this load read it).
_RECORD_REREADS = 4
#: The pause before a load reads the object again under an unchanged record (a damaged object waits it once).
_RECORD_PAUSE = 0.1


def save_object(dest: Location, payload: Payload, codec: Codec, level: int | None,
                progress: Progress = NO_PROGRESS, memory: SaveMemory | None = None) -> ObjectRecord:
    """Write ``payload`` to ``dest`` atomically; its kind, size and CRC32 are recorded beside it before it
    becomes visible, next to the objects that may still be there (see :mod:`taskpoint.format.records`).
    ``memory``: what the caller's earlier saves learned (None: nothing, as in a new process)."""
    memory = memory if memory is not None else SaveMemory()
    record_loc = dest.sibling(RECORD_SUFFIX)
    known, version = memory.take(record_loc)
    read_at, started = time.monotonic(), time.time()
    # Nothing known, on an object store with conditional writes: the record's first write is a create (only where
    # there is none), sent with the folder check and beside the record's read, begun here: a refused create takes
    # what it read, and otherwise the save waits for it only before it returns (SaveState.settle). A new name is
    # two round trips (those, then the object), where it took three in a row (5-30 ms each on a real store); a name
    # with a record three, as when the read came first.
    beside = known is None and record_loc.conditional and not dest.is_local
    ahead = IO.lane(1).submit(read_versioned, record_loc) if beside else None
    if known is None and not beside:
        stored, version = read_versioned(record_loc)
        previous = stored or Record()
    else:
        previous = known or Record()
    if not beside and (dest.is_local or not previous.objects):
        # A folder or prefix is refused before anything is written (folders.py). A destination with a record
        # was saved to as an object before: on object stores that spares the first save a HEAD and a listing.
        memory.refuse_folder(dest)

    def sweep() -> None:  # what killed or failed saves left (never this save's own upload, begun after `started`)
        _log.logger.debug("sweeping leftovers of interrupted saves at %s", _log.safe_uri(dest.uri))
        dest.sweep_leftovers(started_before=started)

    if previous.sweep or (known is None and dest.is_local):
        sweep()
    entry = ObjectRecord(kind=payload.kind, codec=codec.name if payload.archived else "raw",
                         save_id=uuid.uuid4().hex, created=time.time(), size=payload.size())
    check = (lambda deadline: memory.refuse_folder(dest.within(deadline))) if beside else None
    state = SaveState(record_loc, previous, version, check=check, ahead=ahead, sweep=sweep)

    def on_partial(deadline: Deadline) -> None:  # a multipart upload begins: if this process dies, the next save
        if not state.partial:  # sweeps it
            state.partial = True
            state.write(lambda record: replace(record, sweep=True), action="save a checkpoint to", outer=deadline)

    def before_commit(size: int, digest: str, deadline: Deadline) -> None:
        # Another process may save here too: the record must keep listing the object it made visible. With
        # conditional writes the store says so (a conflict: read it again); elsewhere read it again unless it
        # was read a moment ago, and keep what it lists besides what this process knew.
        if not record_loc.conditional and (known is not None or time.monotonic() - read_at > _FRESH_SECONDS):
            state.record = merged(read_record(record_loc.within(deadline), tolerate_corrupt=True), state.record)
        new = replace(entry, size=size, crc32=digest, index=payload.written_index)
        state.write(lambda record: record.with_new(new, sweep=state.partial), action="record the checkpoint at",
                    outer=deadline)

    try:
        size, digest = write_payload(dest, payload, codec, level, digest="crc32", before_commit=before_commit,
                                     on_partial=on_partial, progress=progress)
    except BaseException as failure:
        waits = record_loc.retry.deadline if isinstance(failure, Exception) else 0  # an interrupt does not wait
        if state.refused:  # never written (a folder, say): a record this save made goes again, nothing is left
            with contextlib.suppress(Exception):
                if not state.settle(entry.save_id, waits) and state.created:
                    record_loc.remove()
            raise
        with contextlib.suppress(Exception):  # best effort: the record already lists all that may be visible
            # The failed save's object may have become visible if only the answer was lost: the record keeps
            # every object it listed, and asks the next save to sweep what this one may have left. One try,
            # briefly: a store that is down must not make the failed save wait out a second deadline.
            state.loc = record_loc.with_retry(_MARK_RETRY)
            state.write(lambda record: replace(record, sweep=True), action="record a failed save at")
        with contextlib.suppress(Exception):
            state.settle(entry.save_id, waits)
        raise
    state.settle(entry.save_id, record_loc.retry.deadline)
    memory.keep(record_loc, replace(state.record, confirmed=entry.save_id, sweep=False), state.version)
    return replace(entry, size=size, crc32=digest, index=payload.written_index)


#: The one try of marking the record after a failed save (the next save's sweep does the rest).
_MARK_RETRY = RetryPolicy(attempts=1, deadline=5.0)
#: A record read this recently (seconds) is not read again just before the new object is listed in it.
_FRESH_SECONDS = 1.0


def read_record(record_loc: Location, *, tolerate_corrupt: bool = False) -> Record | None:
    """The record beside a checkpoint object, or None when there is none."""
    return parsed(record_loc.read_small(), record_loc.uri, tolerate_corrupt=tolerate_corrupt)


#: Hears the payload kind and stored size of a read that passed its checks.
Verified = Callable[[str, int], None]


@dataclass(frozen=True)
class _Load:
    """What one load hands down its calls: where it counts, how far it may expand, who hears what it verified."""

    progress: Progress
    max_expand: int | None
    on_verified: Verified | None
    #: Only these paths of a directory (normalized), the rest of the archive streamed and skipped; None: all.
    only: Sequence[str] | None = None
    #: The load's clock, which leaves out the import of the extra that reads the payload's kind.
    clock: _log.Clock | None = None


class _Unlisted(CheckpointCorruptError):
    """The object read is none of those the record lists (maybe a save that listed it has not been seen). The
    signal of :func:`load_object`'s rereads: what leaves it is a plain :class:`CheckpointCorruptError`."""


#: What a load does with an object that has no record beside it (written by Flyte or another tool, or its record
#: was removed), so that nothing can verify its bytes: ``"warn"`` loads it with the archive's own checks and
#: logs a WARNING; ``"strict"`` refuses it with :class:`CheckpointCorruptError`.
VERIFY_MODES = ("warn", "strict")


def unverified(uri: str, *, strict: bool, copy_of: str | None = None) -> str:
    """What to say of the checkpoint at ``uri`` that has no record: the WARNING of a load, or the refusal.
    ``copy_of``: the object it was copied from, whose record did not verify it either."""
    why = (f"the checkpoint at {uri} has no record ({uri}{RECORD_SUFFIX} is missing), so its bytes could not be "
           "verified: it was written by Flyte or another tool, or its record was removed.")
    if copy_of is not None:
        why += (f" It is a copy of {copy_of}, and no record there lists it either (no taskpoint save wrote it "
                "there, or the copy differs from what was saved).")
    if strict:
        return (f"{why} verify='strict' refuses it: save it again with taskpoint, or load it with verify='warn' "
                "if you trust where it came from.")
    return f"{why} It was loaded unverified; Checkpoint(..., verify='strict') refuses such a checkpoint."


def listed(entry: ObjectRecord) -> dict[str, Any]:
    """An entry of the record as a description shows it: its fields, the archive's index left out."""
    return {k: v for k, v in entry.to_json().items() if k != "index"}


def load_object(src: Location, workspace: Path, progress: Progress = NO_PROGRESS, *,
                strict: bool = False, copy_of: Location | None = None, max_expand: int | None = None,
                on_verified: Verified | None = None, only: Sequence[str] | None = None,
                clock: _log.Clock | None = None) -> Path | None:
    """Load the checkpoint at ``src`` into ``workspace``; None when nothing was ever saved there. An object
    with no record is loaded unverified with a WARNING, or refused when ``strict`` (see :data:`VERIFY_MODES`).
    ``max_expand``: the most bytes the load may write (the caller's ``Checkpoint(max_expand=...)``);
    ``on_verified(kind, size)`` hears what the read that passed its checks held (the load's log record names it);
    ``clock``, the load's, does not count the import of the extra that reads the payload's kind.

    ``copy_of``: where ``src`` was copied from without its record (Flyte's local retries copy only the object).
    When ``src`` has no record, the record beside ``copy_of`` verifies it if it lists the copied bytes; if it
    does not (or there is none), the object is what it would be without ``copy_of``: unverified."""
    load = _Load(progress, max_expand, on_verified, only, clock)
    record_loc = src.sibling(RECORD_SUFFIX)
    record = read_record(record_loc)
    if record is None and copy_of is not None:
        copied = _load_copy(src, copy_of, workspace, load)
        if copied is not None:
            return copied
    paused = False
    for reread in range(_RECORD_REREADS + 1):
        try:
            result = _loadlisted(src, workspace, record, load, strict,
                                  copy_of.uri if copy_of is not None else None)
            break
        except _Unlisted as unlisted:
            # A save writes its record before its object becomes visible: a reader that meets an object its
            # copy of the record does not list finds it listed when it reads the record again (once more after
            # a short pause: two writers may race). A record that stays the same means the object is damaged.
            newer = read_record(record_loc)
            if reread == _RECORD_REREADS or (newer == record and paused):
                raise CheckpointCorruptError(str(unlisted)) from None
            if newer == record:  # another writer may be about to make the object its record lists visible
                time.sleep(_RECORD_PAUSE)
                paused = True
            record = newer
    if result is None:
        if record is not None and record.objects:
            raise CheckpointCorruptError(
                f"the checkpoint at {src.uri} is recorded as saved but its object is missing; it was deleted "
                f"or moved. Restore the object, or delete its record ({RECORD_SUFFIX}) to start over.")
        if src.container_missing():
            raise StorageNotFound(f"could not load {src.uri}: the bucket or container does not exist. "
                                  "Create it, or fix the URI.")
    elif record is None:
        origin = _log.safe_uri(copy_of.uri) if copy_of is not None else None
        _log.logger.warning(unverified(_log.safe_uri(src.uri), strict=False, copy_of=origin))
    return result


def _load_copy(src: Location, copy_of: Location, workspace: Path, load: _Load) -> Path | None:
    """``src`` loaded and verified against the record beside ``copy_of``; None (nothing loaded, the progress
    rewound) when there is no such record, no object at ``src``, or the record does not list its bytes."""
    record = read_record(copy_of.sibling(RECORD_SUFFIX), tolerate_corrupt=True)
    if record is None or not record.objects:
        return None
    try:
        return _loadlisted(src, workspace, record, load, strict=False)
    except _Unlisted:
        load.progress.rewind()  # the unverified load that follows counts the object again, from zero
        return None


#: The advice of a load that met an object its record does not list.
_UNLISTED_ADVICE = (f"Save a new checkpoint, or load an older one; if another tool replaced it on purpose, delete "
                    f"its record ({RECORD_SUFFIX}) to load it unverified.")


def _loadlisted(src: Location, workspace: Path, record: Record | None, load: _Load,
                 strict: bool, copy_of: str | None = None) -> Path | None:
    """One load of ``src``, verified against ``record`` (objects without a record are Flyte's: unverified,
    refused when ``strict``)."""

    def choose(head: bytes, size: int | None) -> type[Payload]:
        if record is None:
            if strict:
                raise CheckpointCorruptError(unverified(src.uri, strict=True, copy_of=copy_of))
            return guess_kind(head)
        listed = record.of_size(size) or record.unverified or record.of_size(None)
        if listed is None:
            raise _Unlisted(f"the checkpoint at {src.uri} has a record that lists no object: the record was "
                            f"emptied or written by another tool. {_UNLISTED_ADVICE}")
        if size is not None and listed.size not in (None, size) and record.unverified is None:
            raise _Unlisted(f"the checkpoint at {src.uri} holds an object of {size} bytes, which its record "
                            f"does not list: it is truncated or damaged, or was replaced by something other than "
                            f"a taskpoint save. {_UNLISTED_ADVICE}")
        importing = time.perf_counter()
        found = payload_class(listed.kind, src.uri)
        if load.clock is not None:
            load.clock.exclude(time.perf_counter() - importing)
        return found

    def verify(kind: str, size: int, digest: str) -> None:
        _verify(record, kind, size, digest, src.uri)
        if load.on_verified is not None:
            load.on_verified(kind, size)

    newest = record.of_size(None) if record is not None else None
    digest = "sha256" if newest is not None and newest.crc32 is None and newest.sha256 else "crc32"
    return read_payload(src, workspace, choose, verify, digest, size_hint=newest.size if newest else None,
                        progress=load.progress, max_expand=load.max_expand, only=load.only)


def _verify(record: Record | None, kind: str, size: int, digest: str, uri: str) -> None:
    if record is None or record.matching(kind, size, digest) is not None:
        return
    legacy = record.unverified
    if legacy is not None and legacy.kind == kind and legacy.size in (None, size):
        warnings.warn(
            f"the checkpoint at {uri} was written by a save (of an older taskpoint) that stopped before recording "
            "its checksum; it was loaded with the archive's own checks only.", stacklevel=2)
        return
    expected = ", ".join(str(o.size) for o in record.objects) or "none"
    raise _Unlisted(
        f"the checkpoint at {uri} does not match the checksum recorded when it was saved "
        f"(size {size}, recorded sizes {expected}); it is truncated or damaged. Save a new checkpoint, or load "
        "an older one.")
