"""The commit of a step: every object its manifest names checked stored at its size, then the manifest written
last, which is what makes the step exist. The one place a step's manifest is written, for every committer: the
writer (what a step kind stored, :mod:`.commit`), rank 0 (a step of several ranks, :mod:`.shards`), the save
process (for a trainer that died, :mod:`.saver_child`) and promotion to the remote tier (:mod:`.promotion`).

A commit that fails leaves what was stored in place: the write may have landed although it raised (a lost
response, an interrupt after the PUT), and then the manifest names those objects; deleting them would leave a
committed step naming nothing. If the manifest did not land, they are leftovers that no manifest names, removed
by a later save or gc() once older than the grace period.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from ..errors import SaveStalledError
from ..format.pieces import PAYLOAD_PIECES
from ..format.records import ObjectRecord, StepContent, StepManifest
from ..storage import Location, RetryPolicy
from ..storage.streams import VersionConflict
from .step_names import MANIFEST_NAME
from .steps import StepStore, best_effort, save_clock


@dataclass(frozen=True)
class Stored:
    """What a step kind stored for one step (``StepKind.store``), for the commit to check and name: the manifest's
    ``content`` and ``record``, and the objects of the step's folder it names, with their sizes."""

    #: None: nothing for this process to commit (a rank > 0 recorded its shard, which rank 0 commits).
    content: StepContent | None
    record: ObjectRecord | None = None
    objects: Mapping[str, int] = field(default_factory=dict)
    #: The bytes that crossed the wire.
    sent: int = 0
    #: The :func:`~.steps.save_clock` reading taken before the objects' writes began, whose answers proved them
    #: stored at their sizes (see :func:`check_stored`); None: each is checked.
    began: float | None = None
    #: What the manifest's write runs inside, given the write and its undo: a deduplicated step's check that no
    #: sweep of the chunk store began meanwhile (:meth:`~.dedup.Dedup.commit`).
    guard: Callable[[Callable[[], None], Callable[[], None]], None] | None = None

    def manifest(self, step: int, attempt: int | None, metadata: dict[str, Any]) -> StepManifest:
        """The manifest that commits what was stored as ``step``."""
        assert self.content is not None and self.record is not None
        return StepManifest(step=step, record=self.record, attempt=attempt, metadata=metadata, content=self.content)


def commit(steps: StepStore, step: int, stored: Stored, attempt: int | None, metadata: dict[str, Any], *,
           create: bool = False, grace: float = 0.0) -> None:
    """Commit ``step`` with what was ``stored``: check its objects (:func:`check_stored`, ``grace`` the saving
    manager's), then write the manifest. ``create``: only where there is no manifest (a conditional create: one
    round trip instead of a read before the save and the write after it); one there that commits the same save (a
    retry that met its own landed write) is this commit, another's raises :meth:`StepStore.taken` and removes
    the stored objects, which no manifest will name."""
    manifest = stored.manifest(step, attempt, metadata)
    check_stored(steps, step, stored.objects, written_since=stored.began, grace=grace)
    location = steps.object(step, MANIFEST_NAME)

    def write() -> None:
        if not write_manifest(location, manifest, create=create) and \
                not manifest.same_save(steps.manifest(step, tolerate_corrupt=True)):
            for name in stored.objects:
                best_effort(steps.object(step, name).remove)
            raise steps.taken(step)

    if stored.guard is None:
        write()
    else:
        stored.guard(write, location.remove)


def write_manifest(location: Location, manifest: StepManifest, *, create: bool = False,
                   action: str = "commit the checkpoint at") -> bool:
    """Write ``manifest`` at ``location``, the step's manifest. ``create``: only where none is, by a conditional
    create where the store has one, else after a look; False when one was there and nothing was written."""
    if create and not location.conditional and location.exists():
        return False
    try:
        location.write_small(manifest.to_bytes(), action=action, create=create)
    except VersionConflict:
        return False
    return True


def check_stored(steps: StepStore, step: int, sizes: Mapping[str, int], *, written_since: float | None = None,
                 grace: float = 0.0) -> None:
    """Just before a commit: every object it will name is stored, at its size. Raises SaveStalledError
    otherwise: a sweep took the object for a dead save's leftover, older than its grace period, so this save
    was stalled for longer than that (or another process sweeps with a shorter ``grace_seconds``).

    ``written_since``: the :func:`~.steps.save_clock` reading taken before the objects' writes began, whose
    answers proved them stored at their sizes. Less than half of ``grace`` (the saving manager's) later, no
    sweep of that grace can have taken them for a dead save's yet (their stored times are no older than that
    reading; the other half covers clocks that disagree), so the check, a HEAD per object, is skipped: a small
    save commits one round trip sooner. A sweep with a shorter grace can remove them in the one round trip
    before the commit, as it can between this check and the commit."""
    if written_since is not None and save_clock() - written_since < grace / 2:
        return
    for name, size in sizes.items():
        found = steps.object(step, name).size()
        if found != size:
            state = "is gone" if found is None else f"holds {found} bytes instead of {size}"
            raise SaveStalledError(
                f"step {step} was not committed to {steps.directory}: {steps.object(step, name).uri} {state}. A "
                "sweep (gc(), or the tidy-up of another save) took it for the leftover of a dead save: this "
                "save was stalled (paused, frozen or starved) for longer than the grace period, or another "
                "process sweeps with a shorter grace_seconds. The previous steps are intact; save again.")


@dataclass(frozen=True)
class OrphanCommit:
    """What the save process commits for a trainer that died after handing it the one payload object of a step
    (pickled to it with the request): ``manifest`` at ``uri``, written create-only, never over a manifest already
    there. A save (``fill``) fills in the record's size and digest from what the process stored; a promotion's copy
    is committed only when its size and digest are the ones the record holds, so that a torn local step is never
    committed."""

    uri: str
    storage_options: dict[str, Any]
    retry: RetryPolicy
    manifest: StepManifest
    fill: bool

    @classmethod
    def at(cls, location: Location, manifest: StepManifest, *, fill: bool) -> OrphanCommit:
        return cls(location.uri, location.storage_options, location.retry, manifest, fill)

    @property
    def hash_name(self) -> str:
        """The hash the object is stored by: :data:`PAYLOAD_PIECES` for a save, the record's for a copy."""
        return PAYLOAD_PIECES if self.fill else self.manifest.record.hash_name

    def finish(self, size: int, digest: str, deadline: float) -> None:
        """Commit the step whose object the process stored at ``size`` bytes with ``digest`` (by
        :attr:`hash_name`); one small write, within the storage retry's own bounds (``deadline`` is for the parts
        of a step of several ranks, which wait for the others)."""
        record = self.manifest.record
        if self.fill:
            manifest = replace(self.manifest, record=record.with_digest(size, self.hash_name, digest))
        elif (size, (self.hash_name, digest)) == (record.size, record.digest):
            manifest = self.manifest
        else:
            return
        write_manifest(Location(self.uri, self.storage_options, self.retry), manifest, create=True,
                       action=f"{'commit' if self.fill else 'promote'}, for a trainer that died, the checkpoint at")
