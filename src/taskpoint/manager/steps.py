"""The steps of one manager directory as stored: manifests, listings, deleting, and sweeping what saves left.

The layout of a step folder, and the names of what it holds, are :mod:`.step_names`'s.

What a step's manifest names, how it is deleted and which leftovers are whose is its kind's to say
(:class:`StoredKind`, looked up by name in the registry the manager passes in): this module knows no kind.

A step exists when, and only when, its manifest does. Objects in a step folder that no manifest names are
leftovers of interrupted or superseded saves; they are removed once older than a grace period, so that a
save still in progress elsewhere is never disturbed. A save that was stalled for longer than that finds what it
stored gone when it checks, just before its commit (:func:`.step_commit.check_stored`), and commits nothing; a
sweep reads the manifest of an uncommitted folder again just before removing from it, so a save that commits
meanwhile keeps its payload.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import CheckpointCorruptError, StorageNotFound
from ..format.records import StepContent, StepManifest
from ..storage import Location
from ..storage.backends import modified_time
from .in_use import InUse
from .leases import alive, fresh
from .step_names import COMMIT_LEASE, MANIFEST_NAME, PAYLOAD_NAME, RESTORE_LEASE, STEP_FOLDER, stored_names
from .step_names import shard_record_name as shard_record_name  # re-exported: tests name it here

#: How many of the newest steps a message about a missing step names (with the oldest and the count).
NEWEST_SHOWN = 3

#: What every save leaves in a step folder whatever its kind: the manifest, and the leases.
_OURS = stored_names(rf"taskpoint\.json|{COMMIT_LEASE.pattern}|{RESTORE_LEASE.pattern}")


@dataclass(frozen=True)
class StepObjects:
    """What a committed step names: objects in its folder (name: the size its manifest records, None when it
    records none) and chunks of the chunk store (key: the path of a file that needs it)."""

    files: dict[str, int | None] = field(default_factory=dict)
    chunks: dict[str, str] = field(default_factory=dict)
    #: The digest of each object of its folder whose digest the manifest records, as (its hash: ``blake3`` or
    #: ``sha256``, hex) (a promotion checks its copy against it as it streams; the step's other objects it reads
    #: back through the kind's verify).
    digests: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: What the step calls the objects of its folder (``taskpoint ls`` names a missing one so).
    noun: str = "payload"


class StoredKind(Protocol):
    """What the step store asks of a step kind: these methods of :class:`taskpoint.manager.kinds.StepKind`, the
    whole protocol, which documents each (``objects`` raises CheckpointCorruptError, or FileNotFoundError, when
    what the manifest names cannot be told)."""

    name: str

    def decode(self, body: dict[str, Any]) -> StepContent: ...
    def owns(self, name: str, committed: bool) -> bool: ...
    def objects(self, steps: StepStore, step: int, manifest: StepManifest) -> StepObjects: ...
    def delete(self, steps: StepStore, step: int, manifest: StepManifest) -> set[str]: ...


class KindLookup(Protocol):
    """The step kinds a store knows: by name (CheckpointCorruptError naming an unknown one), and those loaded."""

    def kind(self, name: str, where: str) -> StoredKind: ...
    def loaded(self) -> Iterable[StoredKind]: ...


@dataclass
class Folder:
    """One ``ckpt-N`` folder as listed: its objects' names and modification times (None when unknown)."""

    objects: dict[str, float | None] = field(default_factory=dict)
    #: The objects that are folders of files (a PyTree step's tree), listed as one object as new as its newest file.
    trees: set[str] = field(default_factory=set)
    #: When the folder itself was last modified, where the store has folders and listed it (None otherwise).
    mtime: float | None = None

    @property
    def committed(self) -> bool:
        return MANIFEST_NAME in self.objects

    def add_tree_file(self, tree: str, mtime: float | None) -> None:
        """Count a file below the folder ``tree`` of the step's folder, modified at ``mtime`` (None: unknown)."""
        seen = self.objects.get(tree, 0.0) if tree in self.trees else 0.0
        self.objects[tree] = None if mtime is None or seen is None else max(seen, mtime)
        self.trees.add(tree)


class StepStore:
    """The steps of the directory ``root``: where each object lives, what the listing holds, what may go."""

    def __init__(self, root: Location, in_use: InUse, kinds: KindLookup) -> None:
        self.root = root
        self._in_use = in_use
        self.kinds = kinds
        self._container_seen = False  # the bucket or container is known to exist
        #: Committed steps as last listed, plus those committed here since; None before the first listing.
        self._known: set[int] | None = None
        self._listed_at = 0.0
        #: Steps deleted through this store (by ``delete`` or retention): a deduplicated save sweeps the chunk
        #: store when it has grown since the last sweep.
        self.deleted = 0

    @property
    def directory(self) -> str:
        return self.root.uri

    def step_uri(self, step: int) -> str:
        return f"{self.directory}/ckpt-{step}"

    def folder(self, step: int) -> Location:
        """The folder of ``step``, which holds its manifest and what its kind stored."""
        return self.root.child(f"ckpt-{step}")

    def object(self, step: int, name: str) -> Location:
        return self.root.child(f"ckpt-{step}/{name}")

    # -- manifests -----------------------------------------------------------------------------------------

    def manifest(self, step: int, *, tolerate_corrupt: bool = False) -> StepManifest | None:
        """The manifest of ``step``; None when the step is not committed (or, tolerated, unreadable)."""
        location = self.object(step, MANIFEST_NAME)
        data = location.read_small()
        if data is None:
            self._check_container()
            return None
        try:
            manifest = StepManifest.from_bytes(data, location.uri,
                                               lambda kind: self.kinds.kind(kind, location.uri).decode)
            if manifest.step != step:
                raise CheckpointCorruptError(f"the checkpoint record {location.uri} does not describe step "
                                             f"{step}; delete the step, or save it again with overwrite=True")
        except CheckpointCorruptError as exc:
            if tolerate_corrupt:
                return None
            raise type(exc)(f"step {step} in {self.directory}: {exc}") from exc  # newer stays NewerFormatError
        return manifest

    def missing(self, step: int, also: Iterable[int] = ()) -> FileNotFoundError:
        """The error for ``step`` not existing, saying which steps do (this directory's committed steps and
        ``also``, a local tier's): the count, and the newest few and the oldest, from one listing."""
        committed = self.committed_steps() | set(also)
        return FileNotFoundError(f"step {step} does not exist in {self.directory}; {steps_there(committed)}")

    def taken(self, step: int) -> FileExistsError:
        """The error for saving ``step`` where it is committed already, without ``overwrite=True``."""
        return FileExistsError(f"step {step} already exists in {self.directory}; pass overwrite=True to replace it, "
                               "or save under a new step")

    def named(self, step: int, manifest: StepManifest) -> StepObjects:
        """What ``manifest`` (of ``step``) names, as its kind tells."""
        return self.kinds.kind(manifest.kind, self.step_uri(step)).objects(self, step, manifest)

    def committed_objects(self, step: int) -> tuple[bool, set[str] | None]:
        """Whether ``step`` is committed, and the objects of its folder its manifest names (None when that
        cannot be told: the manifest or what it refers to is unreadable)."""
        if self.object(step, MANIFEST_NAME).read_small() is None:
            return False, None
        try:
            manifest = self.manifest(step)
            return manifest is not None, None if manifest is None else set(self.named(step, manifest).files)
        except (CheckpointCorruptError, FileNotFoundError):
            return True, None

    def ours(self, name: str, committed: bool) -> bool:
        """Whether ``name`` in a step folder is an object taskpoint or a loaded step kind writes there."""
        return bool(_OURS.fullmatch(name)) or any(kind.owns(name, committed) for kind in self.kinds.loaded())

    # -- listing -------------------------------------------------------------------------------------------

    def committed_steps(self) -> set[int]:
        """The committed steps, from one listing (:meth:`scan`)."""
        return {number for number, folder in self.scan().items() if folder.committed}

    def scan(self, step: int | None = None) -> dict[int, Folder]:
        """Every ``ckpt-N`` folder (or only ``step``'s) with its objects, from one recursive listing of the keys
        that start with ``ckpt-`` (not the chunk store of deduplicated steps beside them)."""
        root = self.root.path.rstrip("/")
        found = self.root.list_tree("ckpt-") if step is None else self.folder(step).list_tree()
        folders: dict[int, Folder] = {}
        for path, info in found.items():
            parts = path[len(root) + 1:].split("/") if path.startswith(root + "/") else []
            match = STEP_FOLDER.fullmatch(parts[0]) if parts else None
            if match is None:
                continue
            folder = folders.setdefault(int(match.group(1)), Folder())
            if len(parts) == 1 and info.get("type") == "directory":
                folder.mtime = modified_time(info)
            elif len(parts) == 2 and parts[1] and info.get("type") != "directory":
                folder.objects[parts[1]] = modified_time(info)
            elif len(parts) > 2 and info.get("type") != "directory":
                folder.add_tree_file(parts[1], modified_time(info))
        if folders or step is not None or self._container_seen:
            self._container_seen = self._container_seen or bool(folders)
            return folders
        self._check_container()  # nothing listed: a missing bucket must not read as "no checkpoint"
        return folders

    def _check_container(self) -> None:
        """Raise StorageNotFound when the bucket or container is missing; asked until it once exists."""
        if self._container_seen:
            return
        if self.root.container_missing():
            raise StorageNotFound(f"could not list {self.directory}: the bucket or container does not exist. "
                                  "Create it, or fix the URI.")
        self._container_seen = True

    # -- deleting and sweeping -----------------------------------------------------------------------------

    def committed(self, step: int) -> None:
        """Note that this manager committed ``step`` (for retention between listings)."""
        if self._known is not None:
            self._known.add(step)

    def tidy(self, choose: Callable[[set[int], dict[int, Folder] | None], list[int]], grace: float) -> list[str]:
        """After a commit: delete the steps retention lets go (``choose(committed, folders)``, ``folders`` when
        just listed) and sweep leftovers.

        The directory is listed on the first save, and again once the grace period has passed since the last
        listing (leftovers can only be swept once older than it; with ``grace`` 0, every time). In between,
        retention works from the steps listed plus those committed here, so a small save costs no listing:
        steps that other writers added meanwhile wait for the next listing. Returns the leftovers swept.
        """
        if self._known is None or time.time() - self._listed_at >= grace:
            self._listed_at = time.time()
            folders = self.scan()
            self._known = {step for step, folder in folders.items() if folder.committed}
            self.retire(choose(set(self._known), folders), folders, grace)
            return self.sweep(folders, grace)
        gone = choose(set(self._known), None)
        self.retire(gone, {step: Folder() for step in gone}, grace)
        return []

    def retire(self, steps: list[int], folders: dict[int, Folder], grace: float) -> None:
        """Delete ``steps`` (retention's choice), taking each out of ``folders``; a step being restored in this
        process is skipped (a later save deletes it)."""
        for step in steps:
            if not self._in_use.start_delete(step):
                continue
            try:
                self.delete_step(step, folders.pop(step), grace)
            finally:
                self._in_use.end_delete(step)

    def delete_step(self, step: int, folder: Folder, grace: float) -> None:
        """Delete a step: its manifest first (so it stops existing at once), then its payload and leftovers."""
        manifest = self.manifest(step, tolerate_corrupt=True)
        self.object(step, MANIFEST_NAME).remove()
        self.deleted += 1
        if self._known is not None:
            self._known.discard(step)
        removed = set() if manifest is None else self.kinds.kind(manifest.kind, self.step_uri(step)).delete(
            self, step, manifest)
        self.sweep_folder(step, folder, grace, {MANIFEST_NAME, *removed})
        # The folder of a step just deleted goes too when empty (also when retention worked from the steps it
        # knew, without a listing of the folder's objects).
        self.folder(step).remove_empty_folder()

    def sweep(self, folders: dict[int, Folder], grace: float, *, dry_run: bool = False) -> list[str]:
        """Remove the leftovers in ``folders`` older than ``grace``; return their URIs (``dry_run``: only
        return them)."""
        removed: list[str] = []
        for step, folder in sorted(folders.items()):
            keep: set[str] = set()
            if folder.committed:
                if self._in_use.is_restoring(step):
                    continue
                extras = [name for name in folder.objects if name != MANIFEST_NAME and self.ours(name, True)]
                if len(extras) <= 1:
                    continue  # the usual committed step: its manifest and its payload
                manifest = self.manifest(step, tolerate_corrupt=True)
                try:
                    named = None if manifest is None else self.named(step, manifest)
                except (CheckpointCorruptError, FileNotFoundError):
                    named = None
                if named is None:
                    continue  # never guess what an unreadable manifest commits
                keep = {MANIFEST_NAME, *named.files}
            removed += self.sweep_folder(step, folder, grace, keep, dry_run=dry_run)
        return removed

    def sweep_folder(self, step: int, folder: Folder, grace: float, keep: set[str], *,
                     dry_run: bool = False) -> list[str]:
        """Remove our objects in ``folder`` that are not in ``keep`` and older than ``grace``; nothing while rank
        0 holds a fresh lease on the folder (it is gathering the shards to commit them). ``keep`` empty: the
        folder was listed with no manifest, which is read again before the first removal."""
        now = time.time()
        if any(COMMIT_LEASE.fullmatch(name) and alive(mtime, now, grace, self.object(step, name).read_small)
               for name, mtime in folder.objects.items()):
            return []
        doomed = [name for name, mtime in folder.objects.items()
                  if name not in keep and self.ours(name, bool(keep)) and not fresh(mtime, now, grace)]
        if doomed and not keep and not dry_run and self.object(step, MANIFEST_NAME).read_small() is not None:
            return []  # committed since it was listed: the next sweep reads what its manifest names
        removed: list[str] = []
        for name in doomed:
            target = self.object(step, name)
            if not dry_run:
                target.remove_tree() if name in folder.trees else target.remove()
            removed.append(target.uri)
        if dry_run:
            return removed
        # Object stores have no folders; elsewhere an empty one goes (rmdir refuses a non-empty folder). A
        # folder listed empty goes only once it is itself older than the grace: until then it may be a save's,
        # made just before its first object (a killed save leaves it so).
        if folder.objects or (folder.mtime is not None and not fresh(folder.mtime, now, grace)):
            self.folder(step).remove_empty_folder()
        return removed

    def sweep_uploads(self, grace: float, *, dry_run: bool = False) -> list[str]:
        """S3: abort the unfinished multipart uploads of payloads that saves killed mid-upload left behind
        (invisible as objects, but billed). Only our payload names, only older than ``grace`` by the server's
        initiation time. Run by ``gc()`` only, not after every save: a server whose clock (or whose fake
        initiation time: moto's is always 2010) is off would otherwise abort another writer's upload in
        flight. Best effort and quiet: a role may lack the ListBucketMultipartUploads permission."""
        root = self.root.path.rstrip("/") + "/"
        bucket = root.partition("/")[0]
        now, removed = time.time(), []
        try:
            uploads = self.root.unfinished_uploads()
        except Exception:
            return []
        for key, upload_id, initiated in uploads:
            path = f"{bucket}/{key}"
            folder, _, name = path[len(root):].partition("/") if path.startswith(root) else ("", "", "")
            step = STEP_FOLDER.fullmatch(folder)
            if step is None or not PAYLOAD_NAME.fullmatch(name):
                continue  # not a payload of ours
            if grace > 0 and now - initiated < grace:
                continue  # maybe a save still in progress
            try:
                if not dry_run:
                    self.root.abort_upload(key, upload_id)
            except Exception:
                continue
            removed.append(self.object(int(step.group(1)), name).uri)
        return removed


def save_clock() -> float:
    """Seconds on a clock that keeps counting while the machine sleeps (``CLOCK_BOOTTIME`` where there is one):
    how long ago a save's writes began, judged against the age a sweep elsewhere sees."""
    boot = getattr(time, "CLOCK_BOOTTIME", None)
    return time.clock_gettime(boot) if boot is not None else time.monotonic()


def steps_there(steps: Iterable[int]) -> str:
    """Which steps exist, for a message about one that does not: all of them when few, else the count, the
    newest :data:`NEWEST_SHOWN` and the oldest."""
    ordered = sorted(set(steps), reverse=True)
    if not ordered:
        return "it holds no step"
    count = f"its {len(ordered)} step{'s' if len(ordered) > 1 else ''}"
    if len(ordered) <= NEWEST_SHOWN + 1:
        return f"{count}: {', '.join(map(str, reversed(ordered)))}"
    return f"{count}: newest {', '.join(map(str, ordered[:NEWEST_SHOWN]))}, ..., oldest {ordered[-1]}"


def best_effort(action: Callable[[], object]) -> None:
    """Best-effort cleanup: whatever it leaves is a leftover that gc removes later."""
    with contextlib.suppress(Exception):
        action()
