"""The stopping step that every rank of a job agrees on after a preemption notice reached any of them.

A platform signals every process of a job within milliseconds, but each rank notices at its own next safe
point, and ranks are rarely at the same step. Saving the emergency state where each rank happens to be would
give shards of different steps, which rank 0 never commits. So the answer of ``reached_preemption()`` (and of
``should_save()`` and ``checkpoint_if_preempted()``) becomes True on every rank at one step:

- **Through the process group**, when ``torch.distributed`` is initialized (:class:`~taskpoint.group.TorchGroup`):
  each safe point starts an all-reduce (MAX) of this rank's notice (its signal number, or 0) without waiting
  for it, and the next safe point reads the result of the previous one, which has long finished by then: while
  no notice is pending a safe point costs starting one small collective (``make bench``, "agreement"). Every
  rank calls its safe points in the same order, so every rank reads the first non-zero result at the same call.
- **Through storage** otherwise (:class:`~taskpoint.group.StorageGroup`): a rank that had a notice publishes
  the step it reached (its group record ``preemption-agreement/rank-k.json`` beside the steps); a thread of
  every rank lists that folder every :data:`POLL_SECONDS`, so ranks that were not signalled learn of it and
  publish theirs at their next safe point (rank 0 also while it waits for the shards of a step: the rank that
  had the notice may be waiting for it). At its safe point after the one it published, a rank waits until
  every rank has published; the stop step is the largest published, plus one, so no rank has passed it. The
  wait lasts at most ``commit_timeout`` (and never past the notice's deadline), and ends sooner when a rank it
  waits for is known gone: a rank that never answers does not hold the others, who then end without an
  emergency step (:class:`NoAgreement`).

Under a launcher that tears the job down when one process exits (torchrun's elastic agent signals every
other rank, and SIGKILLs them 30 s later; with ``--max-restarts`` it then restarts them all), a rank that ended
early would cost the others their emergency step. So no rank ends before the step is settled: ranks > 0 wait,
after storing their shard, until rank 0 committed the step or abandoned it (:func:`~.shards.await_commit`,
at most ``commit_timeout``), and a repeated signal meanwhile is absorbed (:func:`preemption.emergency`). A rank
that is gone is noticed instead of waited for, where it can be: each record names its host and pid, and a
rank whose record names this host and a process that no longer exists is gone (:meth:`Agreement.gone`):
rank 0 then abandons the step at once rather than at its ``commit_timeout``, and a rank waiting for rank 0's
commit stops waiting. A rank on another host is known gone only by its silence, at the timeout.

Records carry the *round* of the save (:func:`~.shards.save_round`) and are ignored when they are of another
round or not after the step this manager restored (a relaunch that resumed from the emergency step never
mistakes the records of the launch before for a new notice). Rank 0 removes them once the emergency step is
committed, or once the agreement failed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from .. import preemption
from ..errors import CheckpointError
from ..group import RanksMissing, Record, StorageGroup, TorchGroup, poll
from ..ranks import Ranks
from ..storage import Location

#: The folder, beside the steps, where ranks publish the step they reached after a notice.
AGREEMENT_FOLDER = "preemption-agreement"
#: The collective, among the group's records (``rank-{k}.json``), of the step each rank reached.
RECORD = "rank"
#: How often each rank lists that folder for a notice another rank received (seconds): the longest a rank
#: that was not signalled trains on before it learns of it, on top of its step time.
POLL_SECONDS = 0.5


class NoAgreement(RuntimeError):
    """Some ranks did not say which step they reached before the wait ended: no emergency step is saved."""

    def __init__(self, missing: list[int], waited: float) -> None:
        super().__init__(f"ranks {missing} did not answer the preemption agreement within {waited:.1f} s")
        self.missing = missing


class Agreement:
    """One manager's side of the agreement (see the module's docstring); with one rank, the notice itself."""

    def __init__(self, ranks: Ranks, timeout: float, folder: Location | None, round_: Callable[[], str],
                 floor: Callable[[], int | None]) -> None:
        self._ranks, self._folder, self._timeout = ranks, folder, timeout
        self._round, self._floor = round_, floor
        self._calls = 0
        #: The agreed stop, once known: a step number (storage) or True (process group).
        self.stop: int | None = None
        self._agreed = False
        self._signal = 0
        self._torch: TorchGroup | None = None
        #: The vote in flight on the process group: waits for it at most the seconds given (None: the group's).
        self._vote: Callable[[float | None], int] | None = None
        self._records: StorageGroup | None = None
        self._published: int | None = None
        self._watcher: threading.Thread | None = None
        self._heard = threading.Event()
        self._heard_signal = 0
        self._stop_watching = threading.Event()
        self._publishing = threading.Lock()

    @property
    def distributed(self) -> bool:
        return self._ranks.distributed

    @property
    def commits(self) -> bool:
        """Whether this rank commits the steps (rank 0), and so removes the records once they served."""
        return self._ranks.rank == 0

    @property
    def signal(self) -> int:
        """The signal of the notice the job stops for (this rank's own, or the one another rank received)."""
        notice = preemption.notice()
        return notice.signal if notice is not None else self._signal

    def reached(self, step: int | None) -> bool:
        """Whether this safe point (at ``step``, or the next of this manager's safe points) is where every rank
        stops. Raises :class:`NoAgreement` when the other ranks did not answer in time."""
        notice = preemption.notice()
        if not self._ranks.distributed:
            return notice is not None
        if self._agreed:
            return step is None or self.stop is None or step >= self.stop
        self._calls += 1
        position = self._calls if step is None else step
        if self._torch is None and self._watcher is None:
            self._torch = TorchGroup.of_initialized(None, "the preemption agreement")
            if self._torch is None and self._folder is not None:
                self._watch()
        if self._torch is not None:
            vote = self._vote_on(self._torch, notice)
            if vote:
                self._agree(vote, None)
            return self._agreed
        return self._storage(position, notice)

    def _vote_on(self, group: TorchGroup, notice: preemption.Notice | None) -> int:
        """The largest signal any rank had at the previous call (0: none); then this call's vote is sent: one
        all-reduce in flight, read at the next call."""
        if self._vote is not None:
            # With a notice this rank stops anyway: a rank that never answers must not hold it past the deadline.
            waited = None if notice is None else max(0.1, notice.remaining())
            try:
                result = self._vote(waited)
            except (TimeoutError, CheckpointError) as exc:
                if notice is None:
                    raise
                raise NoAgreement([], waited or 0.0) from exc
            if result:
                return result
        self._vote = group.start_max(notice.signal if notice is not None else 0, "the preemption agreement's votes")
        return 0

    def _agree(self, signal: int, stop: int | None) -> None:
        self._agreed, self._signal, self.stop = True, signal, stop
        self._stop_watching.set()
        if preemption.notice() is None:
            preemption.notify(signal)  # a notice of this rank too: the emergency save says which signal

    # -- through storage ---------------------------------------------------------------------------------------

    def _storage(self, position: int, notice: preemption.Notice | None) -> bool:
        if notice is None and not self._heard.is_set():
            return False
        if notice is None:
            notice = preemption.notify(self._heard_signal or 15)
        if self._published is None:
            self._publish(position, notice.signal)
            return False
        assert self._published is not None
        if position <= self._published:
            return False
        steps = self._wait_for_all(notice)
        self._agree(notice.signal, max(steps.values()) + 1)
        assert self.stop is not None
        return position >= self.stop

    def _group(self) -> StorageGroup:
        """The records of this round's agreement; a record not after the step this manager restored is of a
        launch before this one, which this one resumed past."""
        if self._records is None:
            assert self._folder is not None
            self._records = StorageGroup(self._folder, self._ranks, self._round(), self._timeout,
                                         accept=self._after_floor)
        return self._records

    def _after_floor(self, record: Record) -> bool:
        floor = self._floor()
        try:
            return floor is None or int(record.value["step"]) > floor
        except (TypeError, KeyError, ValueError):
            return False

    def while_committing(self, step: int) -> set[int]:
        """Rank 0 waits for the shards of ``step``: a rank that had a notice may be waiting for rank 0's step,
        and would never store its shard. So rank 0 publishes ``step`` now when it heard of a notice (it will not
        pass the step after it before the agreement either). Returns the ranks known gone (:meth:`gone`): their
        shards will never come."""
        if self._folder is None or self._torch is not None or self._published is not None or self._agreed:
            return self.gone()
        notice = preemption.notice()
        if notice is not None or self._heard.is_set():
            self._publish(step, notice.signal if notice is not None else self._heard_signal or 15)
        return set()

    def gone(self) -> set[int]:
        """The ranks whose newest record names this host and a process that no longer exists (a rank on another
        host is never reported: only its silence tells)."""
        return set() if self._records is None else self._records.gone()

    def _publish(self, position: int, signal: int) -> None:
        with self._publishing:
            if self._published is None:
                self._group().publish(RECORD, {"step": position, "signal": signal})
                self._published = position

    def _wait_for_all(self, notice: preemption.Notice) -> dict[int, int]:
        group = self._group()
        try:
            found = group.wait_for(RECORD, range(self._ranks.world_size), "the preemption agreement",
                                   max(0.0, min(self._timeout, notice.remaining())))
        except RanksMissing as exc:
            raise NoAgreement(exc.missing, exc.waited) from exc
        return {rank: int(record.value["step"]) for rank, record in found.items()}

    def _watch(self) -> None:
        """Start the thread that learns of a notice another rank published."""
        group = self._group()

        def heard() -> int | None:
            if self._stop_watching.is_set():
                return 0
            try:
                found = group.records(RECORD)
            except Exception:  # an unreachable store: asked again at the next interval
                return None
            others = [record for rank, record in found.items() if rank != self._ranks.rank]
            return int(others[0].value.get("signal") or 15) if others else None

        def run() -> None:
            signal = poll("the preemption agreement's watch", heard, None, pauses=(POLL_SECONDS, POLL_SECONDS))
            if signal:
                self._heard_signal = signal
                self._heard.set()

        self._watcher = threading.Thread(target=run, name="taskpoint-preemption-agreement", daemon=True)
        self._watcher.start()

    def forget(self) -> None:
        """After the emergency step committed (rank 0): remove every rank's record of this round."""
        if self._folder is not None and self._torch is None:
            self._group().forget(RECORD)

    def close(self) -> None:
        self._stop_watching.set()
