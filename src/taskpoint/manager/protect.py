"""Protected steps: what retention never deletes, and ``delete`` only with ``force=True``.

Retention deletes what its policy (:mod:`.retention`) lets go, less the steps protected by these rules:

- the newest committed step that verifies (its manifest reads and passes its own check): a run always has a
  step to resume from, whatever ``keep_best`` prefers;
- the step this manager restored from, until it commits a newer one: a run that resumed from an older step
  (``fallback=True``) keeps it until it has a successor;
- a step being restored, here (the steps this process has in use) or by another process (a fresh restore lease in the
  step's folder), or being committed by rank 0 of another process, or overwritten by another process's save in
  flight (their commit lease: :func:`overwrite_lease`).

The metric of ``keep_best`` comes from each step's metadata: remembered for the steps this manager commits,
read once from the manifest for the others (and again when a listing shows the manifest was rewritten).
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from .. import _log
from ..errors import CheckpointCorruptError, CheckpointError
from ..storage import RetryPolicy
from .in_use import InUse
from .leases import alive, every, lease_body, renewing
from .retention import Retention
from .step_names import COMMIT_LEASE, MANIFEST_NAME, RESTORE_LEASE, commit_lease_name
from .steps import Folder, StepStore, best_effort

NEWEST = "it is the newest committed step that verifies (a run must have a step to resume from)"
RESTORED = "this manager restored from it and has not committed a newer step since"
RESTORING = "it is being restored"
ELSEWHERE = "another process is restoring or committing it (a fresh lease in its folder)"


class Guard:
    """The retention of one manager: its policy's choice less the protected steps, and the metric cache."""

    def __init__(self, steps: StepStore, in_use: InUse, policy: Retention, grace: float) -> None:
        self._steps, self._in_use, self.policy, self._grace = steps, in_use, policy, grace
        self._metrics: dict[int, tuple[float | None, float | None]] = {}  # step -> (manifest mtime, value)
        self._good: set[int] = set()  # steps whose manifest this manager wrote or read intact
        #: The step the last restore of this manager returned, protected until a newer step is committed here.
        self.restored: int | None = None

    # -- what this manager did -----------------------------------------------------------------------------

    def committed(self, step: int, metadata: dict[str, object]) -> None:
        """This manager committed ``step`` with ``metadata``."""
        best = self.policy.keep_best
        self._metrics[step] = (None, best.value(metadata) if best is not None else None)
        self._good.add(step)
        if self.restored is not None and step > self.restored:
            self.restored = None

    def deleted(self, step: int) -> None:
        """This manager deleted ``step`` (forced, when protected): a later save of that number is a new step."""
        self._metrics.pop(step, None)
        self._good.discard(step)
        if self.restored == step:
            self.restored = None

    def restored_from(self, step: int) -> None:
        self.restored = step
        self._good.add(step)

    def delete(self, step: int, *, force: bool) -> None:
        """Delete the committed ``step`` (:meth:`CheckpointManager.delete <taskpoint.CheckpointManager.delete>`):
        CheckpointError naming the rule when it is protected (unless ``force``) or being restored here."""
        folders, where = self._steps.scan(), self._steps.directory
        committed = {number for number, found in folders.items() if found.committed}
        if step not in committed:
            raise self._steps.missing(step)  # the error path lists the steps again, for the one message
        folder = folders[step]
        rule = None if force else self.rule(step, self.newest_verified(committed), folder)
        if rule is not None and not self._in_use.is_restoring(step):
            raise CheckpointError(f"step {step} in {where} is protected: {rule}. Pass force=True to delete it anyway")
        if not self._in_use.start_delete(step):
            raise CheckpointError(f"step {step} in {where} is being restored; delete it once the restore has finished")
        try:
            self._steps.delete_step(step, folder, self._grace)
            self.deleted(step)
        finally:
            self._in_use.end_delete(step)

    # -- retention -----------------------------------------------------------------------------------------

    def choose(self, committed: set[int], folders: dict[int, Folder] | None = None) -> list[int]:
        """The steps retention deletes among ``committed``: the policy's choice less the protected steps.
        ``folders``, when the directory was just listed, tells the manifests' times (for the metric cache)."""
        if not self.policy.deletes:
            return []
        if folders is not None:
            self._forget_rewritten(folders)
        chosen = self.policy.to_delete(committed, self.metric)
        if not chosen:
            return []
        newest = self.newest_verified(committed)
        listed = folders or {}
        return [step for step in chosen if self.rule(step, newest, listed.get(step)) is None]

    def rule(self, step: int, newest: int | None, folder: Folder | None = None) -> str | None:
        """Why ``step`` may not be deleted (``newest``: the newest committed step that verifies; ``folder``: the
        step's folder as just listed, else it is listed here), or None."""
        if step == newest:
            return NEWEST
        if step == self.restored:
            return RESTORED
        if self._in_use.is_restoring(step):
            return RESTORING
        if self.leased_elsewhere(step, folder):
            return ELSEWHERE
        return None

    def newest_verified(self, committed: set[int]) -> int | None:
        """The newest of ``committed`` whose manifest reads and passes its check."""
        for step in sorted(committed, reverse=True):
            if step in self._good:
                return step
            try:
                if self._steps.manifest(step) is not None:
                    self._good.add(step)
                    return step
            except CheckpointCorruptError:
                continue
        return None

    def leased_elsewhere(self, step: int, folder: Folder | None = None) -> bool:
        """Whether ``step``'s folder holds a fresh restore or commit lease (by the longer of our grace and the
        lease's own)."""
        now = time.time()
        if folder is None:
            folder = self._steps.scan(step).get(step, Folder())
        return any((RESTORE_LEASE.fullmatch(name) or COMMIT_LEASE.fullmatch(name))
                   and alive(mtime, now, self._grace, self._steps.object(step, name).read_small)
                   for name, mtime in folder.objects.items())

    # -- the metric of keep_best ---------------------------------------------------------------------------

    def metric(self, step: int) -> float | None:
        """``keep_best``'s value for ``step`` (None: none, or the manifest cannot be read)."""
        best = self.policy.keep_best
        if best is None:
            return None
        if step not in self._metrics:
            try:
                manifest = self._steps.manifest(step)
            except CheckpointCorruptError:
                manifest = None  # a damaged step is never among the best
            self._metrics[step] = (None, best.value(manifest.metadata) if manifest is not None else None)
        return self._metrics[step][1]

    def _forget_rewritten(self, folders: dict[int, Folder]) -> None:
        """Forget what a listing shows has changed: a manifest rewritten since (another writer's overwrite)."""
        for step in list(self._metrics):
            folder = folders.get(step)
            mtime = folder.objects.get(MANIFEST_NAME) if folder is not None and folder.committed else None
            seen, value = self._metrics[step]
            if folder is None or not folder.committed:
                del self._metrics[step]
                self._good.discard(step)
            elif seen is None:
                self._metrics[step] = (mtime, value)
            elif mtime != seen:
                del self._metrics[step]
                self._good.discard(step)


#: The retries of a restore lease's writes (seconds of deadline): a store that cannot take one in this long
#: leaves the restore without it, never the restore waiting on it.
LEASE_DEADLINE = 30.0
#: How long the end of a restore waits for its lease's removal (retried within :data:`LEASE_DEADLINE`) before
#: it leaves the lease's thread to finish alone.
LEASE_JOIN_SECONDS = LEASE_DEADLINE + 5.0
#: How long the end of a restore waits for its lease's write to end, so that the lease is gone when the restore
#: returns (a store answers in 5-30 ms); a write slower than this is the lease's thread's to finish and undo.
LEASE_SETTLE_SECONDS = 2.0


class RestoreLease:
    """A lease on ``step``'s folder while a restore reads it, so that other processes' retention keeps the step.

    Written on a thread of its own (:meth:`held`), off the restore's critical path: the manifest and payload
    reads do not wait for it (a round trip each, 5-30 ms on a real store), and a store that is slow to take it
    delays nothing. A sweep elsewhere may list the folder before the lease lands, as it may before a lease
    written first; the restore then meets the step deleted under it, which it reports (every byte it returns is
    verified against the manifest). Best effort: a store that refuses the lease (a reader without
    write permission restores without one, and ``refused`` hears why)."""

    def __init__(self, steps: StepStore, step: int, grace: float, refused: Callable[[Exception], None]) -> None:
        """``refused`` hears why the lease could not be written: on the restore's thread when its block ends
        after the write did, else on the lease's own."""
        self._steps, self._step, self._grace, self._refused = steps, step, grace, refused
        self._lease = steps.object(step, f"restore-{uuid.uuid4().hex}.json").with_retry(
            RetryPolicy(deadline=LEASE_DEADLINE))
        self._stop = threading.Event()
        self._tried = threading.Event()  # the first write ended, landed or not
        self.failure: Exception | None = None  # why the lease could not be written

    def _write(self, action: str) -> None:
        self._lease.write_small(lease_body(self._grace), action=f"{action} a restore lease at")

    def _hold(self) -> None:
        """Write the lease, renew it every quarter of the grace until told to stop, then remove it."""
        try:
            self._write("write")
        except Exception as exc:
            self.failure = exc
            self._tried.set()
            if self._stop.is_set():  # the restore is over and did not wait for this write
                self._refused(exc)
            return
        self._tried.set()
        try:
            every(self._grace / 4 if self._grace > 0 else None, lambda: best_effort(lambda: self._write("renew")),
                  self._stop)
        finally:
            best_effort(self._lease.remove)
            # The lease may have made the folder of a step that does not exist (local disk); rmdir keeps a full one.
            best_effort(self._steps.folder(self._step).remove_empty_folder)

    @contextmanager
    def held(self) -> Iterator[RestoreLease]:
        """The lease, held on its thread while the block runs (on local disk, where a write costs no round
        trip, written before it). At its end the thread removes it, waited for when its write ends within
        :data:`LEASE_SETTLE_SECONDS` (the removal at most :data:`LEASE_JOIN_SECONDS`, then logged); a write
        slower than that is left to its thread, which removes the lease once it lands."""
        thread = threading.Thread(target=self._hold, name="taskpoint-restore-lease", daemon=True)
        thread.start()
        if self._steps.root.is_local and not self._tried.wait(LEASE_JOIN_SECONDS):
            _log.logger.warning("the restore lease %s is still being written after %.0f s; restoring without "
                                "waiting for it", _log.safe_uri(self._lease.uri), LEASE_JOIN_SECONDS)
        try:
            yield self
        finally:
            self._stop.set()
            if not self._tried.wait(LEASE_SETTLE_SECONDS):
                _log.logger.debug("restore lease %s still being written after %.0f s; its thread removes it once "
                                  "it lands", _log.safe_uri(self._lease.uri), LEASE_SETTLE_SECONDS)
            else:
                thread.join(LEASE_JOIN_SECONDS)
                if thread.is_alive():
                    _log.logger.warning("the restore lease %s is still being removed after %.0f s; left to its "
                                        "thread", _log.safe_uri(self._lease.uri), LEASE_JOIN_SECONDS)
                if self.failure is not None:
                    self._refused(self.failure)


@contextmanager
def overwrite_lease(steps: StepStore, step: int, grace: float) -> Iterator[None]:
    """Hold a commit lease on the folder of the committed ``step`` while a save overwrites it, so that other
    processes' retention and ``delete`` keep the step whose save is in flight (and their sweeps leave the folder
    alone). Best effort, as a restore's: the save itself reports a store it cannot write."""
    with _held(steps, step, commit_lease_name(uuid.uuid4().hex), grace, "commit"):
        yield


@contextmanager
def _held(steps: StepStore, step: int, name: str, grace: float, what: str) -> Iterator[None]:
    """Hold the lease ``name`` (a ``what`` lease) in ``step``'s folder, renewed, while the block runs."""
    lease = steps.object(step, name)
    try:
        lease.write_small(lease_body(grace), action=f"write a {what} lease at")
    except Exception:
        yield
        return
    try:
        with renewing(lambda: lease.write_small(lease_body(grace), action=f"renew a {what} lease at"), grace,
                      f"taskpoint-{what}-lease"):
            yield
    finally:
        best_effort(lease.remove)
        # The lease may have made the folder of a step that does not exist (local disk); rmdir keeps a full one.
        best_effort(steps.folder(step).remove_empty_folder)
