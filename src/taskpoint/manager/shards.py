"""Steps saved by several ranks: each rank stores its shard and a record of it; rank 0 alone commits the step.

The commit, on storage only (no process group):

1. Rank k stores its data as a payload of a fresh name in ``ckpt-N/``, as a single-rank save does, hashing it.
2. Ranks 1 .. W-1 then write ``ckpt-N/rank-k.json`` (a :class:`~taskpoint.format.records.ShardRecord`: the
   payload's name, size and sha256, the world size, and the *round*) and return.
3. Rank 0, once its own shard is stored, lists ``ckpt-N/`` (:func:`taskpoint.group.poll`) and reads
   each rank record that appeared or changed, until it holds one of the current round from every rank. Then it
   commits the step (:mod:`.step_commit`): the manifest (version 3) naming every shard with its sha256; and
   removes the records.
4. If ``commit_timeout`` seconds pass first (or, after a preemption notice, a missing rank is known gone:
   :meth:`.agreement.Agreement.gone`), rank 0 removes the records it found and raises
   :class:`~taskpoint.StepAbandonedError` naming the ranks missing. No manifest was written, so the step never
   appears; its shards are leftovers that ``gc()`` (and later saves) remove once older than the grace period.

Either way rank 0 removes the records, which is what a rank > 0 that must not end before the step is settled
(an emergency save: :func:`await_commit`) watches for.

The *round* tells the records of this save from those a previous launch of the job left for the same step
(a rank that stored its record and was then killed with the others): it is the task attempt
(``taskpoint.ctx().attempt``, which all ranks of an attempt agree on; a task's grows with every launch) with
the launchers' variables that change with every launch (torchrun's run id and restart count, Slurm's job and
step ids and requeue count, Flyte's execution and attempt), the same on every rank of one launch. Both: an
attempt taken from a restart counter starts again at 1 when the whole job is launched again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

from .._log import safe_uri
from ..errors import CheckpointCorruptError, CheckpointError, StepAbandonedError, say_in_message
from ..format.pieces import PAYLOAD_PIECES
from ..format.records import ObjectRecord, Shard, ShardRecord, StepContent
from ..group import RanksMissing, poll
from ..ranks import Ranks, incarnation_from_environment, resolve_ranks
from ..storage import Location, RetryPolicy
from .leases import lease_body, renewing
from .step_commit import Stored, write_manifest
from .step_names import (
    MANIFEST_NAME,
    RANK_FAILURE,
    RANK_RECORD,
    commit_lease_name,
    rank_failure_name,
    round_tag,
    shard_record_name,
)
from .steps import StepStore, best_effort

_log = logging.getLogger("taskpoint")


@dataclass(frozen=True)
class RankPlan:
    """The ranks of one manager, and how long its rank 0 waits for the others' shards."""

    ranks: Ranks
    commit_timeout: float

    @classmethod
    def from_args(cls, rank: int | None, world_size: int | None, commit_timeout: Any, grace: float,
                  dedup: bool) -> RankPlan:
        """The manager's ranks (defaults from the environment, :mod:`taskpoint.ranks`), checked against its other
        options (``commit_timeout`` itself is checked by its :class:`~taskpoint.Shards`)."""
        ranks = resolve_ranks(rank, world_size)
        if ranks.distributed and dedup:
            raise ValueError(
                f"dedup=True is not supported with world_size {ranks.world_size}: a rank's chunks would be named "
                "by no manifest between its save and rank 0's commit, and gc() could remove them. Use "
                "dedup=False with several ranks.")
        if ranks.distributed and grace <= commit_timeout:
            raise ValueError(f"commit_timeout ({commit_timeout} s) must be shorter than grace_seconds ({grace} s) "
                             "with several ranks: shards waiting for their commit would otherwise be swept as "
                             "leftovers (grace_seconds=0 is for a single writer)")
        return cls(ranks, float(commit_timeout))

    def next_step(self, latest: int | None, last_saved: int | None) -> int:
        """The step of an emergency save: after the newest committed one and, with several ranks, after the
        last step this rank saved (rank 0 may not have committed it yet, and all ranks must agree)."""
        if self.ranks.distributed and last_saved is not None:
            return max(latest or 0, last_saved) + 1
        return (latest or 0) + 1


def save_round(attempt: int | None) -> str:
    """What every rank of one save of a step shares, and no earlier launch of the job had (see above)."""
    return f"attempt={attempt};{incarnation_from_environment()}"


class ShardWriter:
    """Stores this rank's shard of a step; on rank 0, also gathers the others' records and commits."""

    def __init__(self, steps: StepStore, plan: RankPlan, grace: float,
                 waiting: Callable[[int], set[int]] | None = None) -> None:
        self._steps, self._plan, self._grace = steps, plan, grace
        #: Called with the step on every listing while rank 0 waits for the shards (the preemption agreement);
        #: returns the ranks known gone, whose shards will never come.
        self._waiting = waiting
        #: The failure notes this rank wrote (:func:`tell_rank_zero`), removed if it saves the step again.
        self._failed: set[str] = set()

    def orphan(self, step: int, metadata: dict[str, Any], attempt: int | None, kind: str, codec: str,
               content: Callable[[tuple[Shard, ...]], StepContent]) -> ShardOrphan:
        """This rank's shard of ``step`` as one payload object of a fresh name (``kind``, ``codec``), with what the
        save process needs to finish this rank's part if this process dies first (``content``: of the shards)."""
        save_id = uuid.uuid4().hex
        record = ObjectRecord(kind=kind, codec=codec, save_id=save_id, created=time.time())
        folder = self._steps.folder(step)
        return ShardOrphan(folder.uri, folder.storage_options, folder.retry, step, self._plan.ranks,
                           save_round(attempt), f"payload-{save_id}", record, metadata, attempt, content)

    def write(self, step: int, attempt: int | None, store: Callable[[], tuple[Shard, int]],
              commits: Callable[[tuple[Shard, ...]], Stored], until_committed: contextlib.ExitStack[bool | None]
              ) -> Stored:
        """Store this rank's shard with ``store`` (the shard and the bytes sent), then record it (ranks > 0) or
        gather every rank's (rank 0). Returns what this rank commits, with the bytes sent: on rank 0,
        ``commits(shards)`` of every rank's shard (rank 0 holds its lease on the folder, on ``until_committed``,
        until the commit is over, and removes the records after it); on others, nothing (``content`` None)."""
        with naming_rank(self._plan.ranks):
            round_ = save_round(attempt)
            ranks = self._plan.ranks
            folder = self._steps.folder(step)
            if ranks.rank != 0:
                failure = folder.child(rank_failure_name(ranks.rank, round_))
                if failure.uri in self._failed:  # this rank's earlier save of the step failed: rank 0 must not read it
                    best_effort(failure.remove)
                    self._failed.discard(failure.uri)
                try:
                    shard, sent = store()
                    record_shard(folder, ShardRecord(step, ranks.world_size, round_, shard))
                except CheckpointError as exc:
                    tell_rank_zero(failure, exc)
                    self._failed.add(failure.uri)
                    raise
                return Stored(None, sent=sent)
            # Rank 0 holds a lease on the folder from before its own shard until the commit: no sweep removes the
            # shards it is gathering, however long the others take (a sweep with a shorter grace included). A shard
            # stored long before this lease (a rank far ahead of rank 0) may have been swept: the commit checks each.
            lease = self._steps.object(step, commit_lease_name(uuid.uuid4().hex))

            def renew() -> None:
                lease.write_small(lease_body(self._grace), action="write a lease at")

            renew()
            until_committed.callback(best_effort, lease.remove)
            until_committed.enter_context(renewing(renew, self._grace, "taskpoint-commit-lease"))
            own, sent = store()
            shards = self._gather(folder, step, round_, own)
            until_committed.push(lambda failed, *_: None if failed else forget_records(folder, range(1, len(shards))))
            return dataclasses.replace(commits(shards), sent=sent)

    def _gather(self, folder: Location, step: int, round_: str, own: Shard) -> tuple[Shard, ...]:
        """Every rank's shard of this round, rank 0's first; StepAbandonedError after the timeout."""
        world = self._plan.ranks.world_size
        found: dict[int, Shard] = {0: own}
        stale: set[int] = set()
        failed: dict[int, str] = {}

        def absent() -> list[int]:
            return [rank for rank in range(world) if rank not in found]

        def check() -> tuple[Shard, ...] | None:
            gather(folder, step, world, round_, found, stale, failed)
            if len(found) == world:
                return tuple(found[rank] for rank in range(world))
            if set(absent()) & set(failed):  # a rank noted that its save failed: its shard never comes
                raise RanksMissing("a rank failed", absent(), [], 0.0)
            return None

        waiting = self._waiting
        try:
            return poll(f"rank 0: the shards of step {step} in {safe_uri(self._steps.directory)}", check,
                        self._plan.commit_timeout, missing=absent,
                        gone=None if waiting is None else lambda: waiting(step))
        except RanksMissing as exc:
            missing, gone = exc.missing, exc.gone
            failing = sorted(set(missing) & set(failed))
            forget_records(folder, [rank for rank in found if rank] + sorted(stale))
            for rank in failing:
                best_effort(folder.child(rank_failure_name(rank, round_)).remove)
            also = f" (ranks {sorted(stale)} left records of another launch)" if stale else ""
            if len(found) == 1 and not stale and not failing:
                also = (" (no other rank stored a shard: if only rank 0 saves in this job, create its manager "
                        "with world_size=1)")
            if failing:
                why = "; ".join(f"rank {rank} failed to save its shard ({failed[rank]})" for rank in failing)
                waited = f"stopped waiting for the shards of ranks {missing} of {world}: {why}{also}"
            elif gone:
                waited = (f"stopped waiting for the shards of ranks {missing} of {world}: the processes of ranks "
                          f"{gone} are gone{also}")
            else:
                waited = (f"waited {self._plan.commit_timeout:g} s for the shards of ranks {missing} of "
                          f"{world}{also}")
            raise StepAbandonedError(
                f"step {step} in {self._steps.directory} was abandoned: rank 0 {waited}, and committed "
                "nothing. The previous steps are intact; gc() removes this step's shards once they are older "
                "than the grace period.") from None


@contextlib.contextmanager
def naming_rank(ranks: Ranks) -> Iterator[None]:
    """With several ranks, taskpoint's errors raised in the block name this rank (``[rank 1 of 3]``): in a job of
    many processes, the first thing to know of a save or restore that failed (a stalled part: which rank's)."""
    try:
        yield
    except CheckpointError as exc:
        if ranks.distributed:
            say_in_message(exc, f"rank {ranks.rank} of {ranks.world_size}")
        raise


#: How long a rank whose save failed tries to tell rank 0 (seconds): the store may be what failed.
FAILURE_NOTE_DEADLINE = 10.0


def tell_rank_zero(note: Location, error: CheckpointError) -> None:
    """Write ``note`` (a rank's failure note, :func:`~.step_names.rank_failure_name`) holding ``error``'s message,
    so that rank 0, gathering the shards, abandons the step at once with it instead of at its commit_timeout.
    Best effort and short: where the store itself failed, rank 0 still stops at its commit_timeout."""
    quick = note.with_retry(RetryPolicy(attempts=2, deadline=FAILURE_NOTE_DEADLINE))
    _log.warning("taskpoint: telling rank 0 that this rank's save failed, at %s", note.uri)
    best_effort(lambda: quick.write_small(str(error).encode(), action="tell rank 0 of the failure at"))


def await_commit(steps: StepStore, rank: int, step: int, timeout: float, gone: Callable[[], set[int]]) -> str:
    """After rank ``rank`` (> 0) stored its shard of ``step`` and its record: wait until rank 0 settled the step
    (it removes the records once it committed, and when it abandons), at most ``timeout`` seconds, or until
    rank 0 is known gone (``gone()``). Returns ``"committed"`` (the manifest names this rank's shard),
    ``"abandoned"``, ``"rank 0 gone"`` or ``"timed out"``; logs what it waits for and how it ended. An
    emergency save waits so, because a launcher that sees one rank exit tears down the others (torchrun)."""
    record = steps.object(step, shard_record_name(rank))
    began = time.monotonic()
    _log.info("taskpoint: rank %d waits (at most %.0f s) for rank 0 to commit step %d in %s", rank, timeout, step,
              steps.directory)
    try:
        outcome = poll(f"rank {rank}: rank 0's commit of step {step} in {safe_uri(steps.directory)}",
                       lambda: None if record.exists() else "abandoned", timeout, missing=lambda: [0], gone=gone)
    except RanksMissing as exc:
        outcome = "rank 0 gone" if exc.gone else "timed out"
    # Committed whatever ended the wait: a rank 0 may die after its commit, before it removed the records.
    manifest = steps.manifest(step, tolerate_corrupt=True)
    if manifest is not None and any(s.rank == rank for s in getattr(manifest.content, "shards", ())):
        outcome = "committed"
    (_log.info if outcome == "committed" else _log.warning)(
        "taskpoint: rank %d: step %d in %s: %s after %.1f s", rank, step, steps.directory, outcome,
        time.monotonic() - began)
    return outcome


def gather(folder: Location, step: int, world: int, round_: str, found: dict[int, Shard], stale: set[int],
           failed: dict[int, str] | None = None) -> None:
    """One listing of the step's folder: add to ``found`` the shards whose records of ``round_`` appeared, and
    to ``stale`` the ranks whose record is of another launch (or unreadable); to ``failed``, when given, the
    ranks that noted their save of ``round_`` failed, with the error. A record not accepted yet is read again on
    every listing: a rewrite within the same second (the resolution of some stores' modification times) would
    leave its time unchanged."""
    tag = round_tag(round_)
    for name in folder.list_names():
        note = RANK_FAILURE.fullmatch(name)
        if note is not None and failed is not None and note.group(2) == tag and int(note.group(1)) not in failed:
            failed[int(note.group(1))] = (folder.child(name).read_small() or b"").decode("utf-8", "replace")
            continue
        rank = _rank_of(name, world)
        if rank is None or rank in found:
            continue
        record = _read_record(folder.child(name))
        if record is None or record.step != step or record.round != round_ or record.shard.rank != rank:
            stale.add(rank)  # another launch's record of this step, or an unreadable one
            continue
        if record.world_size != world:
            raise CheckpointError(
                f"rank {rank} saved its shard of step {step} in {folder.uri} as one of {record.world_size} ranks, "
                f"but rank 0 saves as one of {world}: give every rank the same world_size")
        found[rank] = record.shard
        stale.discard(rank)


def _read_record(location: Location) -> ShardRecord | None:
    data = location.read_small()
    if data is None:
        return None
    try:
        return ShardRecord.from_bytes(data, location.uri)
    except CheckpointCorruptError:
        return None


def shards_record(shards: tuple[Shard, ...]) -> ObjectRecord:
    """Rank 0's record of a step of several ranks, in its manifest: the size of every rank's part."""
    return ObjectRecord(kind="shards", codec="shards", save_id=uuid.uuid4().hex, created=time.time(),
                        size=sum(s.record.size or 0 for s in shards))


def record_shard(folder: Location, record: ShardRecord) -> None:
    """Write a rank's record of its stored shard (a rank > 0), which rank 0 gathers."""
    folder.child(shard_record_name(record.shard.rank)).write_small(record.to_bytes(), action="record the shard at")


def forget_records(folder: Location, ranks: Iterable[int]) -> None:
    """Remove these ranks' records of the step (best effort: what stays is swept after the grace period)."""
    for rank in ranks:
        best_effort(folder.child(shard_record_name(rank)).remove)


@dataclass(frozen=True)
class ShardOrphan:
    """What the save process needs to finish this rank's part of a step when its trainer dies after
    ``save(..., blocking=False)`` returned (pickled to it with the request): a rank > 0 writes its shard's
    record; rank 0 gathers every rank's record of the round and commits the step, never over a manifest that
    is there, and never with a shard missing (at its deadline it gives up, and the step is never listed)."""

    folder: str
    storage_options: dict[str, Any]
    retry: Any
    step: int
    ranks: Ranks
    round: str
    name: str
    record: ObjectRecord
    metadata: dict[str, Any]
    attempt: int | None
    #: The step kind's content naming the shards (a function of the sharded kind: pickled by reference).
    content: Callable[[tuple[Shard, ...]], StepContent]

    def shard(self, size: int, digest: str) -> Shard:
        return Shard(self.ranks.rank, self.name, self.record.with_digest(size, PAYLOAD_PIECES, digest))

    def stored(self, shards: tuple[Shard, ...]) -> Stored:
        """What commits ``shards``, each one payload object: rank 0's record of the step, and every payload."""
        return Stored(self.content(shards), shards_record(shards), {s.payload: s.record.size or 0 for s in shards})

    def finish(self, size: int, digest: str, deadline: float) -> None:
        """In the save process, for a trainer that died once the shard was stored: record it, or (rank 0)
        commit the step once every rank's record is there, until ``deadline`` (``time.monotonic()``)."""
        folder = Location(self.folder, self.storage_options, self.retry)
        if self.ranks.rank != 0:
            record_shard(folder, ShardRecord(self.step, self.ranks.world_size, self.round, self.shard(size, digest)))
            return
        world = self.ranks.world_size
        found, stale = {0: self.shard(size, digest)}, set[int]()

        def check() -> bool | None:
            gather(folder, self.step, world, self.round, found, stale)
            return True if len(found) == world else None

        try:
            poll(f"the save process of rank 0: the shards of step {self.step} in {safe_uri(self.folder)}", check,
                 deadline - time.monotonic(), missing=lambda: [rank for rank in range(world) if rank not in found])
        except RanksMissing:
            return  # a shard never came: nothing is committed, and the shards are swept as leftovers
        shards = tuple(found[rank] for rank in range(self.ranks.world_size))
        manifest = self.stored(shards).manifest(self.step, self.attempt, self.metadata)
        write_manifest(folder.child(MANIFEST_NAME), manifest, create=True,
                       action="commit, for a trainer that died, the checkpoint at")
        forget_records(folder, range(1, self.ranks.world_size))

def _rank_of(name: str, world: int) -> int | None:
    """The rank whose record ``name`` is (1 .. world - 1), else None."""
    match = RANK_RECORD.fullmatch(name)
    rank = int(match.group(1)) if match else 0
    return rank if 0 < rank < world else None
