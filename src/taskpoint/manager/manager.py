"""CheckpointManager: numbered steps in one directory, each committed by a manifest written last.

The manager orchestrates; the parts live beside it: :mod:`.step_names` (the layout), :mod:`.steps` (manifests,
listing, sweeping), :mod:`.retention` (which steps to keep), :mod:`.restore` (verified reads that follow
concurrent writers), :mod:`.background` and :mod:`.saver` (background saves and their process), :mod:`.in_use`
(steps being restored or deleted in this process), :mod:`.shards` (steps saved by several ranks, committed by
rank 0).

Every save writes its payload under a name of its own and the manifest names the payload it commits, so two
writers of the same step never mix their data: the last manifest wins, and it names one writer's complete
payload.
"""

from __future__ import annotations

import datetime
import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from fsspec.callbacks import Callback

from .. import _log, _progress, preemption
from .._log import TransferStats
from ..format.codecs import Codec, step_codec
from ..format.index import normalize_paths
from ..format.records import StepContent
from ..payloads import Payload
from ..storage import LEFTOVER_GRACE_SECONDS, Location, RetryPolicy, normalize_uri
from ._checks import check_grace, check_metadata, check_step
from .agreement import AGREEMENT_FOLDER, Agreement
from .attempts import running_attempt
from .background import Background, Handover
from .chunks import ChunkStore
from .commit import StepWriter
from .dedup import Dedup
from .emergency import PreemptionPolicy
from .in_use import InUse
from .kinds import KINDS, StepContext
from .kinds.chunked import CHUNKED
from .kinds.payload import PAYLOAD
from .kinds.sharded import SHARDED
from .protect import Guard
from .queries import StepQueries, _in_thread
from .rebuild import Rebuilder
from .restore import StepReader, candidates
from .retention import KeepBest, KeepPolicy
from .schedule import SaveSchedule
from .shards import DEFAULT_COMMIT_TIMEOUT, RankPlan, await_commit, save_round
from .steps import StepStore
from .tiers import LocalTier


class CheckpointManager(StepQueries):
    """Numbered checkpoints ("steps") in one directory, with commits, checksums, retention and metadata.

    ``directory`` is any fsspec URL or local path. ``save`` accepts what :meth:`Checkpoint.save
    <taskpoint.Checkpoint.save>` accepts (bytes-like data, or a path naming a file or directory). A step is
    visible to :meth:`steps`, :meth:`latest_step` and :meth:`restore` only once its manifest is written,
    after the payload; :meth:`restore` verifies the sha256 recorded there while it streams.

    The blocking methods carry the plain names; each has an async twin named ``<name>_async`` (as
    :meth:`Checkpoint.prev_exists_async <taskpoint.Checkpoint.prev_exists_async>`) that runs it in a worker
    thread, and the manager is both a context manager and an async context manager.

    Args:
        directory: where the steps live; created on first save.
        keep: keep the ``keep`` newest committed steps and delete older ones after each save; None (the
            default) keeps everything.
        keep_every: also keep every step divisible by ``keep_every`` (with ``keep`` or ``keep_best``).
        keep_best: a :class:`~taskpoint.KeepBest`: also keep the ``k`` steps with the best value of a metric of
            their metadata; without ``keep``, only those (as Lightning's ``save_top_k``). Retention never deletes
            a protected step (the newest that verifies, the one this manager restored from, one being restored
            or committed elsewhere): see docs/manager.md, "What to keep".
        save_interval_steps: :meth:`should_save` is True on every step divisible by it.
        save_interval: :meth:`should_save` is True on the first step at or after each interval (a
            ``datetime.timedelta`` or seconds) since this manager's last save, measured on a monotonic clock.
        storage_options: passed to fsspec (credentials, endpoint_url, ...).
        codec: ``"gzip"``, ``"zstd"`` or ``"none"``: the archive codec of directories (None: gzip, whose 4 MiB
            members that do not compress, such as weights, are stored: docs/performance.md), and the codec of
            each chunk of deduplicated steps (None: zstd).
        level: compression level for the codec; None picks a fast default.
        async_save: when True, :meth:`save` returns once the data is snapshotted or staged (and handed to the save
            process, started with the manager, which then commits it even if this process dies) and uploads in the
            background (``save(..., blocking=...)`` overrides it per call).
        retry: how storage failures are retried; see :class:`~taskpoint.RetryPolicy`.
        grace_seconds: age after which an object that no manifest names (left by a killed or superseded
            save) is removed by later saves and :meth:`gc`. It must exceed the time between a payload's
            upload and its manifest; 0 removes leftovers at once and is safe only with a single writer.
        snapshot_dir: where background saves copy files and directories before uploading them (the
            system temp folder by default). The copy needs as much space as the data; on the source's
            filesystem it is fastest (in-kernel, or reflinked where the filesystem supports it).
        background_process: background saves to local disk and object stores write the snapshot from a
            helper process (True, the default) so they never hold this process's GIL; False writes it
            from a thread of this process. ``memory://`` and payloads that cannot be pickled always use
            a thread. Blocking saves always run in the caller's thread.
        max_staging_bytes: the shared memory that background saves of torch state dicts (staged there for the save
            process) may hold at once; None: half the memory available (a larger state is saved blocking).
        preemption: install the preemption handlers (from the main thread; ``SIGTERM`` by default) and react
            to notices: :meth:`reached_preemption`, and the emergency save of ``on_preemption``. False opts out.
        on_preemption: a function returning the state to save when a notice arrives: the next :meth:`save`
            (or :meth:`checkpoint_if_preempted`) finishes the save in flight, saves that state as the next step,
            waits for its commit and raises :class:`~taskpoint.Preempted`. See docs/manager.md, "Preemption".
        dedup: save bytes, files and directories as deduplicated steps: files cut into chunks, each stored
            once in the directory's chunk store and uploaded only when the store lacks it; :meth:`gc` removes
            the chunks no step names. Background saves then upload from a thread of this process.
        rank: this process's rank among ``world_size`` ranks that save each step together, each its own shard
            (default: from ``$TASKPOINT_RANK``, torchrun's ``RANK`` or Slurm's ``SLURM_PROCID``; else 0).
        world_size: how many ranks save each step (default: from ``$TASKPOINT_WORLD_SIZE``, ``WORLD_SIZE`` or
            ``SLURM_NTASKS``; else 1). Rank 0 commits a step once every rank's shard is stored (waiting up to
            ``commit_timeout`` seconds, then raising :class:`~taskpoint.StepAbandonedError`); other ranks'
            saves return once their shard is recorded. ``restore`` returns this rank's shard. See docs/manager.md.
        local_dir: a local path (the node's NVMe or RAM disk) for a local tier: each step is committed there
            first, and every ``remote_every``-th step is then promoted to ``directory`` in the background,
            checked against its local manifest. ``local_keep``: how many local steps to keep. Reads see both
            tiers (``steps(tier=...)``). With several ranks each rank's local tier holds its own shard, and every
            rank calls ``restore`` together; see docs/manager.md, "A local tier".
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        keep: int | None = None,
        keep_every: int | None = None,
        keep_best: KeepBest | None = None,
        save_interval_steps: int | None = None,
        save_interval: float | datetime.timedelta | None = None,
        storage_options: dict[str, Any] | None = None,
        codec: str | None = None,
        level: int | None = None,
        async_save: bool = False,
        retry: RetryPolicy | None = None,
        grace_seconds: float = LEFTOVER_GRACE_SECONDS,
        snapshot_dir: str | os.PathLike[str] | None = None,
        background_process: bool = True,
        preemption: bool = True,
        on_preemption: Callable[[], Any] | None = None,
        dedup: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        commit_timeout: float = DEFAULT_COMMIT_TIMEOUT,
        local_dir: str | os.PathLike[str] | None = None,
        local_keep: int = 2,
        remote_every: int = 1,
        max_staging_bytes: int | None = None,
    ) -> None:
        uri = normalize_uri(directory, "directory").strip()
        if not uri:
            raise ValueError("directory must be a URI or path, got an empty string")
        if not uri.endswith("://"):
            uri = uri.rstrip("/") or "/"
        if storage_options is not None and not isinstance(storage_options, dict):
            raise TypeError(f"storage_options must be a dict, not {type(storage_options).__name__}")
        self._retention = KeepPolicy(keep, keep_every, keep_best)
        self._schedule = SaveSchedule(save_interval_steps, save_interval)
        self._grace = check_grace(grace_seconds)
        self._plan = RankPlan.from_args(rank, world_size, commit_timeout, self._grace, bool(dedup))
        snapshots = None if snapshot_dir is None else os.fspath(normalize_uri(snapshot_dir, "snapshot_dir"))
        if level is not None and (not isinstance(level, int) or isinstance(level, bool)):
            raise TypeError(f"level must be an int or None, not {type(level).__name__}")
        self._codec: Codec = step_codec(codec)
        self._level = level
        self._async_save = bool(async_save)
        root = Location(uri, storage_options, retry)
        self._throttles = root.throttles
        self._in_use = InUse((str(root.fs.protocol), root.path))
        self._steps = StepStore(root, self._in_use, KINDS)
        chunks = ChunkStore(root, "zstd" if codec is None else codec, level)
        self._dedup = Dedup(self._steps, chunks, self._grace)
        agreement = Agreement(self._plan.ranks, self._plan.commit_timeout, root.child(AGREEMENT_FOLDER),
                              lambda: save_round(running_attempt()), lambda: self.restored_step)
        self._parts = StepContext(self._steps, self._codec, level, self._grace, self._plan,
                            Rebuilder(self._steps, chunks, self._dedup.workers), self._dedup if dedup else None,
                            agreement.while_committing)
        self._reader = StepReader(self._parts, self._in_use, KINDS)
        self._guard = Guard(self._steps, self._in_use, self._retention, self._grace)
        self._lock = threading.RLock()  # save, delete, gc, close and wait_until_finished, one at a time
        #: The step the last successful :meth:`restore` returned (useful with ``fallback=True``).
        self.restored_step: int | None = None
        #: The figures of the last save that committed (bytes, seconds blocked and in all, MB/s); None before.
        self.last_save: TransferStats | None = None
        self._closed = False
        self._background = Background(uri, snapshots, bool(background_process) and root.backend.shared,
                                      max_staging_bytes=max_staging_bytes, prestart=self._async_save)
        # The kinds a payload is saved as, the first that accepts it: several ranks, dedup=True, else one object.
        self._writer = StepWriter(self._parts, self._in_use, self._guard, KINDS, (SHARDED, CHUNKED, PAYLOAD))
        self._preemption = PreemptionPolicy(preemption, on_preemption, agreement)
        self._tier = None if local_dir is None else LocalTier.open(type(self), local_dir, local_keep, remote_every, {
            "codec": codec, "level": level, "retry": retry, "grace_seconds": grace_seconds, "dedup": dedup,
            "snapshot_dir": snapshot_dir, "background_process": background_process,
        }, (self._parts, self._writer, self._background, self._guard.committed))
        weakref.finalize(self, self._background.slot.report_unclaimed, uri)

    # -- properties and lifecycle --------------------------------------------------------------------------

    def __repr__(self) -> str:
        policy, best = self._retention, "" if self._retention.best is None else f", keep_best={self._retention.best!r}"
        return f"CheckpointManager({self.directory!r}, keep={policy.keep}, keep_every={policy.keep_every}{best})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> CheckpointManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close_async()

    def close(self) -> None:
        """Wait for a background save, delete the restore workspace, and raise a background error if any.

        Safe to call twice. Paths returned by :meth:`restore` without ``into`` are gone afterwards.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._preemption.agreement.close()
            try:
                self._background.settle(wait=True)
            finally:
                self._reader.close()
                self._background.close()
                if self._tier is not None:
                    self._tier.close()

    def wait_until_finished(self) -> None:
        """Block until the background save (if any) and the promotion in flight have committed; raise an error
        either met."""
        with self._lock:
            self._background.settle(wait=True)
            if self._tier is not None:
                self._tier.settle()

    # -- save ----------------------------------------------------------------------------------------------

    def save(self, data: Any, step: int, *, metadata: dict[str, Any] | None = None, overwrite: bool = False,
             blocking: bool | None = None, progress: bool | Callback | None = None) -> str:
        """Save ``data`` as ``step``; return the URI of the step's folder.

        ``metadata`` is a dict of JSON values, given back exactly by :meth:`metadata`. Saving a step that
        exists raises FileExistsError unless ``overwrite=True`` (blocking, on an object store with conditional
        writes, when the manifest's create finds one; elsewhere two writers checking at the same moment can
        both pass the check, and the last to commit wins, with its own complete data). With
        ``blocking=False`` (or ``async_save=True``) the call returns once the data is snapshotted (a state dict:
        staged), and handed to the save process where there is one (so that the step is committed even if this
        process is killed next; see docs/manager.md): the caller may change or delete it at once. At most one
        save is in flight; the next call waits for it, and an error it met is raised by the next call instead of
        doing anything else. ``progress``: as for :meth:`Checkpoint.save_sync <taskpoint.Checkpoint.save_sync>`
        (a background save shows no bar unless True).
        """
        clock, began = _log.Clock(self._throttles), self._schedule.now()
        step = check_step(step)
        record_metadata = check_metadata(metadata)
        attempt = running_attempt()
        background = self._async_save if blocking is None else not blocking
        tracker = _progress.resolve(progress, f"save step {step}", background=background)
        self.checkpoint_if_preempted(step=step)  # a safe point: with on_preemption, a notice ends the attempt
        with self._lock:
            self._check_open()
            if not (self._preemption.saving and self._tier is not None and self._tier.promoting):
                self._background.settle(wait=True)  # (the emergency save does not wait past the grace's share)
            if self._tier is not None and not self._preemption.saving:  # local, then promoted (an emergency: remote)
                uri = self._tier.save(data, step, metadata, overwrite=overwrite, background=background,
                                      progress=progress)
                self._schedule.saved(step, began)
                return uri
            claim = self._writer.claim(step, data, overwrite=overwrite, background=background)
            payload = claim.payload
            job = functools.partial(self._write_step, step, record_metadata, attempt, claim.replaced, clock=clock,
                                    progress=tracker, overwrites=claim.exists, exclusive=claim.exclusive)
            if not background:
                job(payload)
            else:
                self._background.start(step, payload, job, self._writer.kind_for(payload))
            self._schedule.saved(step, began)
        clock.release()  # a background save's record, at its commit, counts the caller's wait until here
        return self._steps.step_uri(step)

    def commit(self, step: int, content: StepContent, *, metadata: dict[str, Any] | None = None) -> str:
        """Commit ``step`` whose objects another writer stored in :meth:`step_uri`'s folder, as ``content``
        describes them (a step kind's content, e.g. ``taskpoint.torch``'s file set): its kind checks that they
        are stored and writes the manifest; then retention applies. Returns the step's URI."""
        record_metadata = check_metadata(metadata)
        with self._lock:
            self._check_open()
            self._writer.write(check_step(step), record_metadata, running_attempt(), None, content,
                               clock=_log.Clock(self._throttles))
        return self._steps.step_uri(step)

    def _write_step(self, step: int, metadata: dict[str, Any], attempt: int | None, replaced: set[str] | None,
                    payload: Payload, saver: Handover | None = None, *, clock: _log.Clock,
                    progress: _progress.Progress, overwrites: bool, exclusive: bool = False) -> None:
        self.last_save = self._writer.write(step, metadata, attempt, replaced, payload, saver, clock=clock,
                                            progress=progress, overwrites=overwrites, exclusive=exclusive)

    # -- preemption: the notice, and the emergency save (emergency.py) --------------------------------------
    def reached_preemption(self, step: int | None = None) -> bool:
        """True once a preemption notice arrived; with several ranks, on all at one ``step`` (docs/distributed.md)."""
        return self._preemption.reached(step, self.latest_step)

    def checkpoint_if_preempted(self, state: Callable[[], Any] | None = None, *, step: int | None = None) -> None:
        """After a notice, the emergency save of ``state()`` (default ``on_preemption``; with several ranks at the
        agreed ``step``), then :class:`~taskpoint.Preempted`; without a notice, or either function, nothing."""
        if self._preemption.due(state, step, self.latest_step):
            tier, notice = self._tier, preemption.notice()
            settle = self.wait_until_finished if tier is None or notice is None else functools.partial(
                tier.settle_within, notice.deadline)
            agreement = self._preemption.agreement
            self._preemption.run(settle, lambda: self._plan.next_step(
                self.latest_step(), self._writer.last_step), lambda data, at, meta: self.save(
                data, at, metadata=meta, blocking=True), lambda at: await_commit(
                self._steps, self._plan.ranks.rank, at, self._plan.commit_timeout, agreement.gone), state, step)

    # -- restore -------------------------------------------------------------------------------------------

    def restore(self, step: int | None = None, into: str | os.PathLike[str] | None = None, *,
                paths: Iterable[str] | None = None, fallback: bool = False, broadcast: bool = False,
                progress: bool | Callback | None = None) -> Path:
        """Restore ``step`` (the newest when None) and return it as :meth:`Checkpoint.load
        <taskpoint.Checkpoint.load>` does: a folder for directories, ``<folder>/payload`` for bytes and files.

        Without ``into`` the result lands in a folder of the manager's own, removed by :meth:`close`; with it, the
        step's entries replace same-named entries in ``into``. ``paths`` (files or folders relative to the saved
        directory) restores only those, reading only their bytes (docs/manager.md, "Restoring part of a step");
        KeyError names one the step lacks. Every byte read is verified (sha256, or per chunk or member) before it
        lands: a mismatch raises CheckpointCorruptError naming the step. ``fallback=True`` skips a damaged step
        with a warning for the newest older one that verifies; storage errors are raised, never skipped.
        :attr:`restored_step` is the step the last restore returned. ``progress``: as for :meth:`Checkpoint.load_sync
        <taskpoint.Checkpoint.load_sync>`. ``broadcast=True`` (all ranks of a torch.distributed group at once): one
        read of the step among them, each rank verifying what it receives (docs/distributed.md, "One read")."""
        selected = None if paths is None else normalize_paths(paths)
        clock, tracker = _log.Clock(self._throttles), _progress.resolve(progress, "restore")
        target = None if into is None else Path(normalize_uri(into, "into"))
        self._ready()
        step = None if step is None else check_step(step)
        if self._tier is not None:  # the newest step that verifies on either tier, local copies first
            restored, result = self._tier.restore(step, self._reader, target, fallback=fallback, progress=tracker,
                                                  paths=selected, clock=clock)
        else:
            tried = candidates(self.steps() if step is None or fallback else (), step, fallback)
            if not tried:
                raise FileNotFoundError(f"there is no committed checkpoint in {self.directory}")
            restored, result = self._reader.read_first(tried, target, fallback=fallback, requested=step is not None,
                                                       clock=clock, progress=tracker, paths=selected,
                                                       broadcast=broadcast)
        self._restored(restored)
        return result

    # -- delete and garbage collection ---------------------------------------------------------------------

    def delete(self, step: int, *, force: bool = False) -> None:
        """Delete a committed step: its manifest first (so it stops existing at once), then its payload.

        A protected step (the newest committed step that verifies, the step this manager restored from until it
        commits a newer one, a step another process is restoring or committing) raises CheckpointError naming
        the rule, unless ``force=True``. A step being restored in this process is never deleted. With a local
        tier the step goes from both tiers (the remote copy first, under these rules)."""
        step = check_step(step)
        with self._lock:
            self._check_open()
            self._background.settle(wait=True)
            remote = self._tier is None or step in self.steps(tier="remote")
            if remote:
                self._guard.delete(step, force=force)
            if self._tier is not None and not self._tier.delete(step, force=force) and not remote:
                raise FileNotFoundError(f"step {step} exists on neither tier of {self.directory}")

    def gc(self, grace_seconds: float | None = None, *, dry_run: bool = False) -> list[str]:
        """Remove leftovers of interrupted or superseded saves older than the grace period, and chunks that no
        step names (unless a save is in flight); return their URIs.

        Committed steps are never touched (retention is applied by :meth:`save`), nor anything whose name
        taskpoint would not write. On S3 this also aborts the unfinished multipart uploads of payloads (saves
        killed in the middle of an upload). ``grace_seconds`` overrides the manager's for this call; with
        ``dry_run`` nothing is removed, and the URIs that would be are returned.
        """
        grace = self._grace if grace_seconds is None else check_grace(grace_seconds)
        with self._lock:
            self._check_open()
            self._background.settle(wait=True)
            folders = self._steps.scan()
            return (self._steps.sweep(folders, grace, dry_run=dry_run)
                    + self._steps.sweep_uploads(grace, dry_run=dry_run)
                    + self._dedup.sweep_chunks(grace, dry_run=dry_run)
                    + (self._tier.local.gc(grace, dry_run=dry_run) if self._tier is not None else []))

    # -- async twins ---------------------------------------------------------------------------------------

    save_async, restore_async, commit_async = _in_thread(save), _in_thread(restore), _in_thread(commit)
    delete_async, gc_async = _in_thread(delete), _in_thread(gc)
    wait_until_finished_async, close_async = _in_thread(wait_until_finished), _in_thread(close)
