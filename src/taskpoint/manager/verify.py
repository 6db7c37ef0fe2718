"""Verifying and describing steps: every byte of a step read against its manifest's checksums, and what a
manifest says, as typed results (``CheckpointManager.verify`` and ``describe``; ``taskpoint verify`` and
``show`` print them). The step's kind does the reading (:mod:`.kinds`); this module tells damage from a step
that another writer overwrote or deleted meanwhile."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointCorruptError, CheckpointError, NewerFormatError
from ..format.conformance import document_problem
from ..format.pieces import checked_by
from ..format.records import StepManifest
from .kinds import StepContext, StepKind, StepKinds
from .step_names import MANIFEST_NAME

HEALTHY, DAMAGED, CHANGED, NEWER = "healthy", "damaged", "changed", "newer"


@dataclass(frozen=True)
class StepVerification:
    """One step, verified. ``state`` is ``healthy`` (every byte matched), ``damaged``, ``changed``
    (overwritten or deleted by another writer while it was verified) or ``newer`` (a document of it is of a format
    version newer than this taskpoint reads: not damage, upgrade taskpoint to check it); ``detail`` says what
    matched, or the problem. ``size`` is the data the step holds; ``checked`` is False for a manifest written
    before manifests carried a check of their own (damage to it cannot be told)."""

    step: int
    state: str
    detail: str
    kind: str | None = None
    size: int | None = None
    checked: bool = True

    @property
    def healthy(self) -> bool:
        return self.state == HEALTHY


@dataclass(frozen=True)
class Verification:
    """The steps of a directory, verified (oldest first)."""

    directory: str
    steps: tuple[StepVerification, ...]

    @property
    def healthy(self) -> bool:
        return all(step.healthy for step in self.steps)

    @property
    def damaged(self) -> list[int]:
        return [s.step for s in self.steps if s.state == DAMAGED]

    @property
    def changed(self) -> list[int]:
        return [s.step for s in self.steps if s.state == CHANGED]

    @property
    def newer(self) -> list[int]:
        return [s.step for s in self.steps if s.state == NEWER]


@dataclass(frozen=True)
class StepDescription:
    """What a step's manifest says, read without its payload: its step kind; the object holding its payload
    (empty when none); the commit record (``payload_kind``, ``codec``, ``save_id``, ``created``, ``size``, ``sha256``,
    ``crc32``, ``blake3``: a payload's digest in manifest version 6, and ``pieces``: the BLAKE3 of each 16 MiB piece
    of a payload since version 7); the task attempt and the user's metadata;
    and the kind's own ``details`` (shards, files, chunks; a ``size`` there is the data the step holds, where it differs
    from the record's)."""

    step: int
    uri: str
    kind: str
    payload: str
    attempt: int | None
    payload_kind: str
    codec: str
    save_id: str
    created: float
    size: int | None
    sha256: str | None
    crc32: str | None
    checked: bool
    metadata: dict[str, Any]
    details: dict[str, Any] = field(default_factory=dict)
    blake3: str | None = None
    pieces: tuple[str, ...] = ()

    @property
    def checked_by(self) -> dict[str, Any]:
        """What the record checks the payload by, as ``taskpoint show`` prints it
        (:func:`~taskpoint.format.pieces.checked_by`): its pieces' count, size, hash and digests, else its BLAKE3, and
        its sha256 (None when it has none)."""
        return checked_by(self.sha256, self.blake3, self.pieces)

    def not_a_copy_of(self, committed: StepDescription) -> str | None:
        """Why this step (a local tier's copy) is not the step ``committed`` describes (the remote tier's, whose
        manifest is the truth), or None when it is: when its size and digest are the ones ``committed`` records
        (for a multi-rank step, some rank's shard: a tool that does not know which rank wrote a local_dir accepts
        any; a tiered restore asks for its own rank's)."""
        shards = committed.details.get("shards")
        # A record holds one of sha256, BLAKE3 and pieces: a shard's piece digests count only without the other two
        # (a state dict's shard lists its file's pieces beside the sha256 of them that its record holds).
        recorded = ({(shard["size"], shard["sha256"] or shard.get("blake3") or "".join(shard.get("piece_digests", ())))
                     for shard in shards}
                    if shards
                    else {(committed.size, committed.sha256 or committed.blake3 or "".join(committed.pieces))})
        if (self.size, self.sha256 or self.blake3 or "".join(self.pieces)) in recorded:
            return None
        digest = (f"BLAKE3 of {len(self.pieces)} pieces" if self.pieces else f"BLAKE3 {self.blake3}"
                  if self.blake3 is not None else f"sha256 {self.sha256}")
        return (f"not the committed step: its {digest} is not the one {committed.uri} records for "
                f"{'any shard' if shards else 'its payload'} (a save never promoted, whose step number another "
                "save committed since); a restore with this local_dir reads the remote copy and removes this one")


class StepChanged(CheckpointError):
    """The step was deleted or overwritten (by another writer, or its retention) between the read of its
    manifest and the end of the check: an error, not damage, and not "no such step"."""

    def __init__(self, directory: str, step: int) -> None:
        super().__init__(f"step {step} in {directory} was overwritten or deleted while it was verified; verify it "
                         "again")


def verify_step(context: StepContext, kinds: StepKinds, step: int, progress: object, *, listed: bool = False,
                manifest: StepManifest | None = None) -> StepVerification:
    """Verify ``step`` (the save ``manifest`` commits, when given; else its manifest now). Damage is
    CheckpointCorruptError only when the manifest, read again, still commits that save; otherwise
    :class:`StepChanged`. A step with no manifest is FileNotFoundError, or StepChanged when ``listed``."""
    steps = context.steps
    manifest = manifest or steps.manifest(step)
    if manifest is None:
        if listed:
            raise StepChanged(steps.directory, step)
        raise steps.missing(step)
    try:
        kind = kinds.kind(manifest.kind, steps.step_uri(step))
        off_format = format_problem(context, kind, step, manifest)
        if off_format is not None:
            raise CheckpointCorruptError(f"step {step} in {steps.directory} is damaged: {off_format}")
        checked = kind.verify(context, step, manifest, progress)
    except (CheckpointCorruptError, FileNotFoundError) as exc:
        # A retention or an overwrite deletes the manifest first, then the objects it names: what is missing
        # or short is damage only if the step is still the save that was read.
        if not manifest.same_save(steps.manifest(step, tolerate_corrupt=True)):
            raise StepChanged(steps.directory, step) from None
        if isinstance(exc, CheckpointCorruptError):
            raise
        raise CheckpointCorruptError(f"step {step} in {steps.directory} is damaged: {exc}") from None
    return StepVerification(step, HEALTHY, checked.detail, manifest.kind, checked.size, manifest.checked)


def format_problem(context: StepContext, kind: StepKind, step: int, manifest: StepManifest) -> str | None:
    """The first document of ``step`` (its manifest, the file-set manifests it names) with a field that does not
    follow the specification (:func:`~taskpoint.format.conformance.format_problems`), named with the field; None
    when every one does (the JSON objects at the top of its folder), checked before the bytes they describe."""
    steps = context.steps
    named = kind.objects(steps, step, manifest).files
    for name in [MANIFEST_NAME, *sorted(n for n in named if n.endswith(".json") and "/" not in n)]:
        problem = document_problem(name, steps.object(step, name).read_small())
        if problem is not None:
            return problem
    return None


def verify_steps(context: StepContext, kinds: StepKinds, listed: list[int], progress: object) -> Verification:
    """Verify each of the steps a listing found, recording damage and changes per step."""
    results = []
    for step in listed:
        try:
            results.append(verify_step(context, kinds, step, progress, listed=True))
        except NewerFormatError as exc:  # a CheckpointCorruptError, but no damage: caught first
            results.append(StepVerification(step, NEWER, " ".join(str(exc).split())))
        except CheckpointCorruptError as exc:
            results.append(StepVerification(step, DAMAGED, " ".join(str(exc).split())))
        except StepChanged as exc:
            results.append(StepVerification(step, CHANGED, str(exc)))
    return Verification(context.steps.directory, tuple(results))


def describe_step(context: StepContext, kinds: StepKinds, step: int) -> StepDescription:
    """The description of ``step``; FileNotFoundError when it does not exist."""
    steps = context.steps
    manifest = steps.manifest(step)
    if manifest is None:
        raise steps.missing(step)
    described = kinds.kind(manifest.kind, steps.step_uri(step)).describe(context, step, manifest)
    record = manifest.record
    return StepDescription(step=manifest.step, uri=steps.step_uri(step), kind=manifest.kind,
                           payload=described.payload, attempt=manifest.attempt, payload_kind=record.kind,
                           codec=record.codec, save_id=record.save_id, created=record.created, size=record.size,
                           sha256=record.sha256, crc32=record.crc32, checked=manifest.checked,
                           metadata=manifest.metadata, details=described.details, blake3=record.blake3,
                           pieces=record.pieces)
