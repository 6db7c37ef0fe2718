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

import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

from ..errors import CheckpointCorruptError, CheckpointError
from .in_use import InUse
from .leases import alive, lease_body, renewing
from .retention import KeepPolicy
from .step_names import COMMIT_LEASE, MANIFEST_NAME, RESTORE_LEASE, commit_lease_name
from .steps import Folder, StepStore, best_effort

NEWEST = "it is the newest committed step that verifies (a run must have a step to resume from)"
RESTORED = "this manager restored from it and has not committed a newer step since"
RESTORING = "it is being restored"
ELSEWHERE = "another process is restoring or committing it (a fresh lease in its folder)"


class Guard:
    """The retention of one manager: its policy's choice less the protected steps, and the metric cache."""

    def __init__(self, steps: StepStore, in_use: InUse, policy: KeepPolicy, grace: float) -> None:
        self._steps, self._in_use, self.policy, self._grace = steps, in_use, policy, grace
        self._metrics: dict[int, tuple[float | None, float | None]] = {}  # step -> (manifest mtime, value)
        self._good: set[int] = set()  # steps whose manifest this manager wrote or read intact
        #: The step the last restore of this manager returned, protected until a newer step is committed here.
        self.restored: int | None = None

    # -- what this manager did -----------------------------------------------------------------------------

    def committed(self, step: int, metadata: dict[str, object]) -> None:
        """This manager committed ``step`` with ``metadata``."""
        best = self.policy.best
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
        best = self.policy.best
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


@contextmanager
def restore_lease(steps: StepStore, step: int, grace: float) -> Iterator[None]:
    """Hold a lease on ``step``'s folder while a restore reads it, so that other processes' retention keeps it.
    Best effort: a store this process may only read (or any failure) restores without one."""
    with _held(steps, step, f"restore-{uuid.uuid4().hex}.json", grace, "restore"):
        yield


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
        best_effort(steps.root.child(f"ckpt-{step}").remove_empty_folder)
