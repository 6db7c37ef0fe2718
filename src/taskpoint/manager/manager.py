"""CheckpointManager: numbered steps in one directory, each committed by a manifest written last. A facade: its
option values make its parts (:mod:`.options`, :mod:`.assembly`), and the bodies of its methods are those of its
write side (:mod:`.writes`: save, commit, delete, gc) and of its read side (:mod:`.queries`: reads, restores)."""

from __future__ import annotations

import contextlib
import io
import os
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from fsspec.callbacks import Callback

from .._log import TransferStats
from ..format.records import StepContent
from ..storage import RetryPolicy
from ..storage.backends import LEFTOVER_GRACE_SECONDS
from ._checks import check_directory, check_step
from .assembly import assemble
from .inventory import StepSummary
from .options import BackgroundSaves, Options, Retention, Schedule, Shards, Tier
from .queries import _in_thread
from .verify import StepDescription, Verification


class CheckpointManager:
    """Numbered checkpoints ("steps") in one directory, with commits, checksums, retention and metadata.

    ``directory`` is any fsspec URL or local path, created on first save. ``save`` takes what :meth:`Checkpoint.save
    <taskpoint.Checkpoint.save>` takes (bytes-like data, or a path naming a file or directory). A step is seen by
    :meth:`steps` and :meth:`restore` once its manifest is written, after the payload; :meth:`restore` verifies the
    sha256 recorded there. Each blocking method has an async twin, ``<name>_async``, run in a worker thread; the
    manager is a context manager and an async one. What to keep, when to save, how to save in the background, with
    which ranks and through which local tier are option values: ``retention=``:class:`~taskpoint.Retention`,
    ``schedule=``:class:`~taskpoint.Schedule`, ``background=``:class:`~taskpoint.BackgroundSaves`,
    ``shards=``:class:`~taskpoint.Shards`, ``tier=``:class:`~taskpoint.Tier`. Their fields are keywords too
    (``keep=3`` is ``retention=Retention(keep=3)``), but not beside the value that holds them (TypeError).

    Args:
        storage_options: passed to fsspec (credentials, endpoint_url, ...).
        codec: ``"gzip"``, ``"zstd"`` or ``"none"``: the archive codec of directories (None: gzip, its 4 MiB members
            that do not compress, such as weights, stored: docs/performance.md) and of chunks (None: zstd).
        level: compression level for the codec; None picks a fast default.
        retry: how storage failures are retried; see :class:`~taskpoint.RetryPolicy`.
        grace_seconds: age after which an object that no manifest names (left by a killed or superseded save) is
            removed by later saves and :meth:`gc`. It must exceed the time between a payload's upload and its
            manifest; 0 removes leftovers at once and is safe only with a single writer.
        dedup: save bytes, files and directories as deduplicated steps: files cut into chunks, each stored once in
            the directory's chunk store and uploaded only when the store lacks it; :meth:`gc` removes the chunks
            no step names. Background saves then upload from a thread of this process.
        preemption: install the preemption handlers (from the main thread; ``SIGTERM`` by default) and react to
            notices: :meth:`reached_preemption`, and the emergency save of ``on_preemption``. False opts out.
        on_preemption: a function returning the state to save when a notice arrives: the next :meth:`save` (or
            :meth:`checkpoint_if_preempted`) finishes the save in flight, saves that state as the next step, waits
            for its commit and raises :class:`~taskpoint.Preempted`. See docs/manager.md, "Preemption".
    """

    def __init__(self, directory: str | os.PathLike[str], *, retention: Retention | None = None,
                 schedule: Schedule | None = None, background: BackgroundSaves | None = None,
                 shards: Shards | None = None, tier: Tier | None = None, storage_options: dict[str, Any] | None = None,
                 codec: str | None = None, level: int | None = None, retry: RetryPolicy | None = None,
                 grace_seconds: float = LEFTOVER_GRACE_SECONDS, dedup: bool = False, preemption: bool = True,
                 on_preemption: Callable[[], Any] | None = None, **older: Any) -> None:
        self._options = Options.gather({"retention": retention, "schedule": schedule, "background": background,
                                        "shards": shards, "tier": tier}, older)
        built = assemble(check_directory(directory), self._options, storage_options=storage_options, codec=codec,
                         level=level, retry=retry, grace_seconds=grace_seconds, dedup=dedup, preemption=preemption,
                         on_preemption=on_preemption,
                         open_local=lambda at, **kw: (m := type(self)(at, **kw), m._steps, m._queries.reader))
        self._steps, self._context, self._dedup, self._tier = built.steps, built.context, built.dedup, built.tier
        self._background, self._queries, self._writes = built.background, built.queries, built.writes
        weakref.finalize(self, self._background.slot.report_unclaimed, self._steps.directory)

    def __repr__(self) -> str:
        policy = self._options.retention
        best = "" if policy.keep_best is None else f", keep_best={policy.keep_best!r}"
        return f"CheckpointManager({self.directory!r}, keep={policy.keep}, keep_every={policy.keep_every}{best})"

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def __aenter__(self) -> CheckpointManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close_async()

    @property
    def restored_step(self) -> int | None:
        """The step the last successful :meth:`restore` returned (useful with ``fallback=True``)."""
        return self._queries.restored_step

    @property
    def last_save(self) -> TransferStats | None:
        """The figures of the last save that committed (bytes, seconds blocked and in all, MB/s); None before."""
        return self._writes.last_save

    @property
    def directory(self) -> str:
        """The URI of the directory that holds the steps."""
        return self._steps.directory

    @property
    def storage_options(self) -> dict[str, Any]:
        """The storage options the manager was given (passed to fsspec)."""
        return self._steps.root.storage_options

    @property
    def retry(self) -> RetryPolicy:
        """How the manager retries storage failures."""
        return self._steps.root.retry

    @property
    def rank(self) -> int:
        """This manager's rank (0 with one rank)."""
        return self._context.plan.ranks.rank

    @property
    def world_size(self) -> int:
        """How many ranks save each step together (1 by default)."""
        return self._context.plan.ranks.world_size

    def close(self) -> None:
        """Wait for a background save, delete the restore workspace, and raise a background error if any.

        Safe to call twice. Paths returned by :meth:`restore` without ``into`` are gone afterwards.
        """
        self._writes.close()

    def wait_until_finished(self) -> None:
        """Block until the background save (if any) and the promotion in flight have committed; raise an error
        either met."""
        self._writes.wait_until_finished()

    def save(self, data: Any, step: int, *, metadata: dict[str, Any] | None = None, overwrite: bool = False,
             blocking: bool | None = None, progress: bool | Callback | None = None) -> str:
        """Save ``data`` as ``step``; return the URI of the step's folder.

        ``metadata`` is a dict of JSON values, given back exactly by :meth:`metadata`. Saving a step that
        exists raises FileExistsError unless ``overwrite=True`` (blocking, on an object store with conditional
        writes, when the manifest's create finds one; elsewhere two writers checking at the same moment can
        both pass the check, and the last to commit wins, with its own complete data). With
        ``blocking=False`` (or ``async_save=True``) the call returns once the data is snapshotted (a state dict or
        a PyTree: staged), and handed to the save process where there is one (so that the step is committed even if this
        process is killed next; see docs/manager.md): the caller may change or delete it at once. At most one
        save is in flight; the next call waits for it, and an error it met is raised by the next call instead of
        doing anything else. ``progress``: as for :meth:`Checkpoint.save_sync <taskpoint.Checkpoint.save_sync>`
        (a background save shows no bar unless True).
        """
        return self._writes.save(data, step, metadata=metadata, overwrite=overwrite, blocking=blocking,
                                 progress=progress)

    def commit(self, step: int, content: StepContent, *, metadata: dict[str, Any] | None = None) -> str:
        """Commit ``step`` whose objects another writer stored in :meth:`step_uri`'s folder, as ``content``
        describes them (a step kind's content, e.g. ``taskpoint.torch``'s file set): its kind checks that they
        are stored and writes the manifest; then retention applies. Returns the step's URI."""
        return self._writes.commit(step, content, metadata=metadata)

    def should_save(self, step: int) -> bool:
        """Whether the loop should save ``step`` now: True on every ``save_interval_steps``-th step, on the first
        step at or after each ``save_interval`` since this manager's last save (on a monotonic clock), and
        whenever a preemption notice is pending; False for a step at or before the newest this manager saved or
        restored. No storage request: ``if mgr.should_save(step): mgr.save(state, step)`` costs nothing per step.
        """
        return self._writes.should_save(step)

    def reached_preemption(self, step: int | None = None) -> bool:
        """True once a preemption notice arrived; with several ranks, on all at one ``step`` (docs/distributed.md)."""
        return self._writes.reached_preemption(step)

    def checkpoint_if_preempted(self, state: Callable[[], Any] | None = None, *, step: int | None = None) -> None:
        """After a notice, the emergency save of ``state()`` (default ``on_preemption``; with several ranks at the
        agreed ``step``), then :class:`~taskpoint.Preempted`; without a notice, or either function, nothing."""
        self._writes.checkpoint_if_preempted(state, step=step)

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
        return self._queries.restore(step, into, paths=paths, fallback=fallback, broadcast=broadcast,
                                     progress=progress)

    @contextlib.contextmanager
    def restore_in_place(self, step: int | None = None, *, broadcast: bool = False,
                         progress: bool | Callback | None = None) -> Iterator[Path]:
        """:meth:`restore` for reading inside a ``with`` block, without a copy where the step's kind allows it
        (``taskpoint.jax``'s PyTree steps on local disk): a folder of the step's own, every file checked against
        its sha256 first, which the block must only read. The step stays held against retention and
        :meth:`delete` (here, and by a lease elsewhere) until the block exits. Other steps, and steps on an
        object store or a local tier, are restored into the manager's folder as :meth:`restore` does.
        ``progress``: as for :meth:`restore` (the bytes checked in place, or those restored). ``broadcast``: as for
        :meth:`restore`; the ranks' local copy is then read in place, and removed when the block exits."""
        with self._queries.restore_in_place(step, broadcast=broadcast, progress=progress) as folder:
            yield folder

    def open(self, step: int, path: str) -> io.BufferedReader:
        """A read-only binary file (``read``, ``readinto``, ``seek``, ``tell``) of the file ``path`` of ``step``,
        read on demand: only the compressed members or chunks that hold the bytes asked for are fetched, each
        verified before its bytes are returned (``torch.load(manager.open(step, "model.pt"))``). A step saved
        without an index restores that one file into a temporary folder first. KeyError when the step has no such
        file; FileNotFoundError when there is no such step. Reads fail once the step is deleted. With a local
        tier: the committed step of the remote tier, else a step the local tier alone holds, from there."""
        return self._queries.open(step, path)

    def steps(self, tier: str | None = None) -> list[int]:
        """The committed steps, oldest first. A background save appears once it has committed. With a local
        tier: the steps on either tier, or those of one (``tier="local"`` or ``"remote"``)."""
        return self._queries.steps(tier)

    def latest_step(self, tier: str | None = None) -> int | None:
        """The newest committed step (on ``tier``, as for :meth:`steps`), or None when there is none."""
        return self._queries.latest_step(tier)

    def step_uri(self, step: int) -> str:
        """The URI of ``step``'s folder (whether or not it exists)."""
        return self._steps.step_uri(check_step(step))

    def list_checkpoints(self) -> dict[int, str]:
        """Each committed step with the URI of its folder, oldest first: Datarax's name for it."""
        return {step: self._steps.step_uri(step) for step in self.steps()}

    def metadata(self, step: int | None = None) -> dict[str, Any]:
        """The metadata saved with ``step`` (the newest when None), read without downloading the payload."""
        return self._queries.metadata(step)

    def best_step(self) -> int | None:
        """The committed step with the best value of ``keep_best``'s metric (ties: the newer), or None when
        there is no ``keep_best`` or no committed step has a finite value. Reads each manifest once."""
        return self._queries.best_step()

    def protected_steps(self) -> dict[int, str]:
        """The committed steps that retention never deletes (nor :meth:`delete` without ``force``), each with
        the rule that protects it."""
        return self._queries.protected_steps()

    def verify(self, step: int | None = None, *, progress: object = None) -> Verification:
        """Read every byte of ``step`` (every committed step when None) against the checksums of its manifest,
        keeping nothing; ``progress`` as for :meth:`restore`. With ``step``: its :class:`~taskpoint.StepVerification`
        is healthy, or CheckpointCorruptError says what is damaged, FileNotFoundError that it does not exist, and
        CheckpointError that another writer overwrote or deleted it meanwhile. Without: each step's result, damage,
        changes and steps a newer taskpoint wrote included; FileNotFoundError when there is no committed step."""
        return self._queries.verify(step, progress)

    def describe(self, step: int | None = None) -> StepDescription:
        """What ``step``'s manifest (the newest step's when None) says: its kind, commit record, attempt,
        metadata and the kind's own details; no payload is read. FileNotFoundError when it does not exist."""
        return self._queries.describe(step)

    def inventory(self) -> list[StepSummary]:
        """Every ``ckpt-N`` folder, oldest first, with its state judged from one listing and the manifests
        (``taskpoint ls``): listed sizes are compared and chunks looked up, no byte of the data is read (that is
        :meth:`verify`'s)."""
        return self._queries.inventory()

    def delete(self, step: int, *, force: bool = False) -> None:
        """Delete a committed step: its manifest first (so it stops existing at once), then its payload.

        A protected step (the newest committed step that verifies, the step this manager restored from until it
        commits a newer one, a step another process is restoring or committing) raises CheckpointError naming
        the rule, unless ``force=True``. A step being restored in this process is never deleted. With a local
        tier the step goes from both tiers (the remote copy first, under these rules)."""
        self._writes.delete(step, force=force)

    def gc(self, grace_seconds: float | None = None, *, dry_run: bool = False) -> list[str]:
        """Remove leftovers of interrupted or superseded saves older than the grace period, and chunks that no
        step names (unless a save is in flight); return their URIs.

        Committed steps are never touched (retention is applied by :meth:`save`), nor anything whose name
        taskpoint would not write. On S3 this also aborts the unfinished multipart uploads of payloads (saves
        killed in the middle of an upload). ``grace_seconds`` overrides the manager's for this call; with
        ``dry_run`` nothing is removed, and the URIs that would be are returned.
        """
        return self._writes.gc(grace_seconds, dry_run=dry_run)

    # -- async twins ---------------------------------------------------------------------------------------

    save_async, commit_async, describe_async = _in_thread(save), _in_thread(commit), _in_thread(describe)
    steps_async, delete_async, inventory_async = _in_thread(steps), _in_thread(delete), _in_thread(inventory)
    list_checkpoints_async, close_async, gc_async = _in_thread(list_checkpoints), _in_thread(close), _in_thread(gc)
    restore_async, latest_step_async, verify_async = _in_thread(restore), _in_thread(latest_step), _in_thread(verify)
    metadata_async, wait_until_finished_async = _in_thread(metadata), _in_thread(wait_until_finished)
