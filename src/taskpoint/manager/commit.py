"""Writing one step: its kind stores it, the commit checks what it stored and writes the manifest
(:mod:`.step_commit`); then retention and tidying.

The writer knows no kind: a payload goes to the first of the manager's kinds that accepts it (``dedup=True``:
``chunked``; a plug-in's; else ``payload``), with several ranks through the ranks' wrapper around it, and the
content of a step whose objects another writer stored (``taskpoint.torch``) to the kind it names.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .. import _log
from .._log import TransferStats
from .._progress import NO_PROGRESS, Progress
from ..format.records import StepContent
from ..payloads import Payload, payload_for
from .background import Handover
from .in_use import InUse
from .kinds import SaveJob, StepContext, StepKind, StepKinds, commits_exclusively, store
from .protect import Guard, overwrite_lease
from .shards import naming_rank
from .step_commit import commit
from .steps import best_effort


@dataclass(frozen=True)
class Claim:
    """What a save of one step starts from (:meth:`StepWriter.claim`)."""

    payload: Payload
    #: The step is committed already (an overwrite), and the objects of its folder its manifest names.
    exists: bool
    replaced: set[str] | None
    #: Nothing was read: the commit creates the manifest only where there is none (:attr:`SaveJob.exclusive`).
    exclusive: bool


class StepWriter:
    """Writes the steps of one manager, each through its kind, and applies retention after each commit."""

    def __init__(self, context: StepContext, in_use: InUse, guard: Guard, kinds: StepKinds, savers: Sequence[StepKind],
                 ranks: Callable[[StepKind], StepKind] | None = None) -> None:
        self._context, self._in_use, self._guard, self._kinds = context, in_use, guard, kinds
        self._savers = tuple(savers)
        #: With several ranks, what saves a rank's part through the kind it chose (:meth:`.kinds.sharded.RanksKind.
        #: around`); None with one.
        self._around_ranks = ranks
        #: The last step this writer saved (its shard, with several ranks), committed or not.
        self.last_step: int | None = None

    def kind_for(self, data: Payload | StepContent) -> StepKind:
        """The kind that saves ``data``: the first of the manager's kinds that accepts a payload, where the last
        (one payload object, which takes any) comes after the kinds other packages registered (``taskpoint.jax``'s
        PyTree files), with several ranks wrapped so that each rank stores its part through it; the kind a content
        names."""
        if isinstance(data, Payload):
            *first, last = self._savers
            others = [kind for kind in self._kinds.loaded() if kind not in self._savers]
            kind = next(kind for kind in (*first, *others, last) if kind.accepts(data, self._context))
            return kind if self._around_ranks is None else self._around_ranks(kind)
        return self._kinds.kind(data.kind, self._context.steps.directory)

    def claim(self, step: int, data: object, *, overwrite: bool, background: bool) -> Claim:
        """The payload of ``data`` to save as ``step``, and whether the step is committed already:
        FileExistsError when it is, unless ``overwrite``. The manifest is read first (before ``data`` is
        serialized, as PyTree payloads are here), except for a blocking save of a new step to an object store
        with conditional writes by a kind that commits so (:func:`~.kinds.commits_exclusively`): its commit
        creates the manifest only where there is none, a round trip fewer (each costs 5-30 ms on a real store).
        A background save always reads first, so that its caller hears of an existing step at once."""
        steps = self._context.steps
        folded = not (overwrite or background or steps.root.is_local or not steps.root.conditional)
        payload = payload_for(data) if folded else None
        if payload is not None and commits_exclusively(self.kind_for(payload)):
            return Claim(payload, exists=False, replaced=None, exclusive=True)
        exists, replaced = steps.committed_objects(step)
        if exists and not overwrite:
            raise steps.taken(step)
        return Claim(payload or payload_for(data), exists, replaced, exclusive=False)

    def write(self, step: int, metadata: dict[str, Any], attempt: int | None, replaced: set[str] | None,
              data: Payload | StepContent, saver: Handover | None = None, *, clock: _log.Clock,
              progress: Progress = NO_PROGRESS, overwrites: bool = False, exclusive: bool = False) -> TransferStats:
        """Save ``data`` as ``step``: its kind stores it, and the step is committed (by rank 0, with several
        ranks); then tidy up (the objects of the ``replaced`` step its new manifest does not name, retention,
        leftovers). Returns the save's figures (``CheckpointManager.last_save``). ``progress`` counts the
        upload; its callback is told the last count once the step is committed. ``overwrites``: ``step`` is
        committed already, and other processes keep it while this save is in flight
        (:func:`~.protect.overwrite_lease`; with several ranks, rank 0's own commit lease does). ``exclusive``:
        see :attr:`SaveJob.exclusive`."""
        self.last_step = step
        kind = self.kind_for(data)
        steps, ranks = self._context.steps, self._context.plan.ranks
        held = (overwrite_lease(steps, step, self._context.grace)
                if overwrites and not ranks.distributed else contextlib.nullcontext())
        with progress, held, contextlib.ExitStack() as until_committed:
            stored = store(kind, self._context, SaveJob(step, metadata, attempt, data, saver, progress,
                                                      until_committed, exclusive))
            if stored.content is not None:
                with naming_rank(ranks):
                    commit(steps, step, stored, attempt, metadata, create=exclusive, grace=self._context.grace)
        if stored.content is not None:
            steps.committed(step)
            self._guard.committed(step, metadata)
            if replaced and not self._in_use.is_restoring(step):
                for name in replaced - stored.objects.keys():
                    best_effort(steps.object(step, name).remove)
            self.tidy()
        return _log.transferred("save", steps.step_uri(step), data.kind, stored.sent, clock, step)

    def tidy(self) -> None:
        """After a commit: apply retention and remove old leftovers. Never fails the save that committed."""
        steps, dedup = self._context.steps, self._context.dedup
        try:
            removed = steps.tidy(self._guard.choose, self._context.grace)
            if dedup is not None and dedup.sweep_due():
                removed += dedup.sweep()  # the chunks of the steps deleted since the last sweep
            if removed:
                _log.logger.debug("swept %d leftover(s) in %s: %s", len(removed), _log.safe_uri(steps.directory),
                                  [_log.safe_uri(uri) for uri in removed])
        except Exception as exc:
            warnings.warn(f"taskpoint saved the new step but could not tidy {steps.directory} ({exc}); old steps "
                          "and leftovers will be removed by a later save or gc()", RuntimeWarning, stacklevel=2)
