"""The write side of a manager, composed into it: save, commit, the emergency save of a preemption notice, delete,
gc, and the end of background work (wait and close), one at a time under its lock."""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from typing import Any

from fsspec.callbacks import Callback

from .. import _log, _progress, preemption
from .._log import TransferStats
from ..format.records import StepContent
from ..payloads import Payload
from ._checks import check_grace, check_metadata, check_step
from .attempts import running_attempt
from .background import Background, Handover
from .commit import StepWriter
from .dedup import Dedup
from .emergency import PreemptionPolicy
from .kinds import StepContext
from .protect import Guard
from .queries import StepQueries
from .restore import StepReader
from .schedule import SaveSchedule
from .shards import await_commit
from .tiers import LocalTier


class StepWrites:
    """The write side of one :class:`~taskpoint.CheckpointManager`: the manager documents each method; these
    bodies act, given the manager's parts (``queries`` is its read side: open or closed, and what is committed).
    Saves, commits, deletes, gc, close and waits run one at a time (``_lock``)."""

    def __init__(self, context: StepContext, writer: StepWriter, reader: StepReader, guard: Guard,
                 schedule: SaveSchedule, background: Background, tier: LocalTier | None, preemption: PreemptionPolicy,
                 dedup: Dedup, queries: StepQueries, async_save: bool) -> None:
        self._context, self._steps, self._plan, self._grace = context, context.steps, context.plan, context.grace
        self._reader, self._guard, self._schedule = reader, guard, schedule
        #: Writes the steps, each through its kind.
        self.writer = writer
        self._background, self._tier, self._preemption, self._dedup = background, tier, preemption, dedup
        self._queries, self._async_save = queries, async_save
        self._lock = threading.RLock()  # save, delete, gc, close and wait_until_finished, one at a time
        #: The figures of the last save that committed (the manager's ``last_save``).
        self.last_save: TransferStats | None = None

    def close(self) -> None:
        with self._lock:
            if self._queries.closed:
                return
            self._queries.closed = True
            self._preemption.agreement.close()
            try:
                self._background.settle(wait=True)
            finally:
                self._reader.close()
                self._background.close()
                if self._tier is not None:
                    self._tier.close()

    def wait_until_finished(self) -> None:
        with self._lock:
            self._background.settle(wait=True)
            if self._tier is not None:
                self._tier.settle()

    # -- save ----------------------------------------------------------------------------------------------

    def save(self, data: Any, step: int, *, metadata: dict[str, Any] | None, overwrite: bool,
             blocking: bool | None, progress: bool | Callback | None) -> str:
        clock, began = _log.Clock(self._steps.root.throttles), self._schedule.now()
        step = check_step(step)
        record_metadata = check_metadata(metadata)
        attempt = running_attempt()
        background = self._async_save if blocking is None else not blocking
        tracker = _progress.resolve(progress, f"save step {step}", background=background)
        self.checkpoint_if_preempted(step=step)  # a safe point: with on_preemption, a notice ends the attempt
        with self._lock:
            self._queries.check_open()
            if not (self._preemption.saving and self._tier is not None and self._tier.promoting):
                self._background.settle(wait=True)  # (the emergency save does not wait past the grace's share)
            if self._tier is not None and not self._preemption.saving:  # local, then promoted (an emergency: remote)
                uri = self._tier.save(data, step, metadata, overwrite=overwrite, background=background,
                                      progress=progress)
                self._schedule.saved(step, began)
                return uri
            claim = self.writer.claim(step, data, overwrite=overwrite, background=background)
            payload = claim.payload
            job = functools.partial(self._write_step, step, record_metadata, attempt, claim.replaced, clock=clock,
                                    progress=tracker, overwrites=claim.exists, exclusive=claim.exclusive)
            if not background:
                job(payload)
            else:
                self._background.start(step, payload, job, self.writer.kind_for(payload))
            self._schedule.saved(step, began)
        clock.release()  # a background save's record, at its commit, counts the caller's wait until here
        return self._steps.step_uri(step)

    def commit(self, step: int, content: StepContent, *, metadata: dict[str, Any] | None) -> str:
        record_metadata = check_metadata(metadata)
        with self._lock:
            self._queries.check_open()
            if self._tier is not None:  # stored on the local tier (kind_api.step_folder), promoted from there
                self._background.settle(wait=True)
                return self._tier.commit(check_step(step), content, metadata)
            self.writer.write(check_step(step), record_metadata, running_attempt(), None, content,
                              clock=_log.Clock(self._steps.root.throttles))
        return self._steps.step_uri(step)

    def _write_step(self, step: int, metadata: dict[str, Any], attempt: int | None, replaced: set[str] | None,
                    payload: Payload, saver: Handover | None = None, *, clock: _log.Clock,
                    progress: _progress.Progress, overwrites: bool, exclusive: bool = False) -> None:
        self.last_save = self.writer.write(step, metadata, attempt, replaced, payload, saver, clock=clock,
                                           progress=progress, overwrites=overwrites, exclusive=exclusive)

    # -- preemption: the notice, and the emergency save (emergency.py) --------------------------------------

    def should_save(self, step: int) -> bool:
        step = check_step(step)
        return self._schedule.due(step, notice=self.reached_preemption(step))

    def reached_preemption(self, step: int | None) -> bool:
        return self._preemption.reached(step, self._queries.latest_step)

    def checkpoint_if_preempted(self, state: Callable[[], Any] | None = None, *, step: int | None = None) -> None:
        if self._preemption.due(state, step, self._queries.latest_step):
            tier, notice = self._tier, preemption.notice()
            settle = self.wait_until_finished if tier is None or notice is None else functools.partial(
                tier.settle_within, notice.deadline)
            agreement = self._preemption.agreement
            self._preemption.run(settle, lambda: self._plan.next_step(
                self._queries.latest_step(), self.writer.last_step), lambda data, at, meta: self.save(
                data, at, metadata=meta, overwrite=False, blocking=True, progress=None), lambda at: await_commit(
                self._steps, self._plan.ranks.rank, at, self._plan.commit_timeout, agreement.gone), state, step)

    # -- delete and garbage collection ---------------------------------------------------------------------

    def delete(self, step: int, *, force: bool) -> None:
        step = check_step(step)
        with self._lock:
            self._queries.check_open()
            self._background.settle(wait=True)
            remote = self._tier is None or step in self._queries.steps(tier="remote")
            if remote:
                self._guard.delete(step, force=force)
            if self._tier is not None and not self._tier.delete(step, force=force) and not remote:
                raise FileNotFoundError(f"step {step} exists on neither tier of {self._steps.directory}")

    def gc(self, grace_seconds: float | None, *, dry_run: bool) -> list[str]:
        grace = self._grace if grace_seconds is None else check_grace(grace_seconds)
        with self._lock:
            self._queries.check_open()
            self._background.settle(wait=True)
            folders = self._steps.scan()
            return (self._steps.sweep(folders, grace, dry_run=dry_run)
                    + self._steps.sweep_uploads(grace, dry_run=dry_run)
                    + self._dedup.sweep_chunks(grace, dry_run=dry_run)
                    + (self._tier.local.gc(grace, dry_run=dry_run) if self._tier is not None else []))
