"""The steps of a directory as one listing shows them (``CheckpointManager.inventory``, ``taskpoint ls``): each
folder's state judged from the listed sizes and the manifests, without reading a byte of the data."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..errors import CheckpointCorruptError, NewerFormatError
from ..format.records import StepManifest
from .chunks import CHUNK_FOLDER
from .kinds import StepContext, StepKinds
from .step_names import MANIFEST_NAME, RESTORE_LEASE, STEP_FOLDER

#: The fields of a kind's description that a summary carries, as counts.
COUNTED = ("shards", "chunks", "files")


@dataclass(frozen=True)
class StepSummary:
    """One ``ckpt-N`` folder as listed. ``state``: ``committed`` (its manifest reads and every object it names
    is listed at its size, every chunk present), ``damaged`` (``problem`` says why), ``newer`` (its manifest, or a
    document it names, is of a format version newer than this taskpoint reads: no damage, ``problem`` says which)
    or ``incomplete`` (no manifest: a save in progress, or a leftover). ``kind`` is the payload kind;
    ``leftovers`` the objects no manifest names; ``extras`` what a committed step's manifest and kind add
    (``payload``, ``checked``, counts of ``shards``, ``chunks`` or ``files``); ``metadata`` is None unless the
    manifest was read."""

    step: int
    uri: str
    state: str
    size: int | None = None
    created: float | None = None
    attempt: int | None = None
    kind: str | None = None
    leftovers: list[str] = field(default_factory=list)
    restore_leases: list[str] = field(default_factory=list)
    metadata: dict[str, Any] | None = None
    problem: str | None = None
    extras: dict[str, Any] = field(default_factory=dict)


def inventory(context: StepContext, kinds: StepKinds) -> list[StepSummary]:
    """Every ``ckpt-N`` folder of the directory, oldest first, from one recursive listing."""
    steps = context.steps
    root = steps.root.path.rstrip("/")
    sizes: dict[int, dict[str, int]] = {}
    stored_chunks: set[str] = set()  # the chunk store of deduplicated steps, by key
    for path, info in steps.root.list_tree().items():
        names = path[len(root) + 1:].split("/") if path.startswith(root + "/") else []
        if len(names) == 3 and names[0] == CHUNK_FOLDER and info.get("type") != "directory":
            stored_chunks.add(names[2])
        match = STEP_FOLDER.fullmatch(names[0]) if names else None
        if match is None:
            continue
        folder = sizes.setdefault(int(match.group(1)), {})
        if len(names) >= 2 and names[-1] and info.get("type") != "directory":  # nested: a PyTree step's files
            folder["/".join(names[1:])] = int(info.get("size") or 0)
    return [_summary(context, kinds, step, folder, stored_chunks) for step, folder in sorted(sizes.items())]


def _summary(context: StepContext, kinds: StepKinds, step: int, names: dict[str, int], stored_chunks: set[str]
             ) -> StepSummary:
    steps = context.steps
    leases = sorted(n for n in names if RESTORE_LEASE.fullmatch(n))
    names = {n: size for n, size in names.items() if n not in leases}
    base = StepSummary(step, steps.step_uri(step), "incomplete", restore_leases=leases,
                       leftovers=sorted(n for n in names if n != MANIFEST_NAME))
    if MANIFEST_NAME not in names:
        return base
    try:
        manifest = steps.manifest(step)
    except CheckpointCorruptError as exc:
        return StepSummary(**{**base.__dict__, "state": _refused(exc), "problem": " ".join(str(exc).split())})
    assert manifest is not None
    return _committed(context, kinds, base, manifest, names, stored_chunks)


def _committed(context: StepContext, kinds: StepKinds, base: StepSummary, manifest: StepManifest, names: dict[str, int],
               stored_chunks: set[str]) -> StepSummary:
    """A committed step's summary: what its manifest and its kind say, and whether every object it names is
    listed at its size (every chunk present)."""
    step, record = base.step, manifest.record
    fields: dict[str, Any] = {**base.__dict__, "size": record.size, "created": record.created,
                              "attempt": manifest.attempt, "kind": record.kind, "metadata": manifest.metadata,
                              "state": "committed", "extras": {"checked": manifest.checked}}
    try:
        named = context.steps.named(step, manifest)
        described = kinds.kind(manifest.kind, base.uri).describe(context, step, manifest)
    except (CheckpointCorruptError, FileNotFoundError) as exc:
        return StepSummary(**{**fields, "state": _refused(exc), "problem": " ".join(str(exc).split())})
    details = described.details
    fields.update(size=details.get("size", record.size),
                  leftovers=sorted(n for n in names if n != MANIFEST_NAME and n not in named.files),
                  extras={"payload": described.payload, "checked": manifest.checked,
                          **{k: len(v) if isinstance(v, list) else v for k, v in details.items() if k in COUNTED}})
    missing = next(((path, key) for key, path in named.chunks.items() if key not in stored_chunks), None)
    if missing is not None:  # deduplicated: its bytes are chunks in the shared store
        return StepSummary(**{**fields, "state": "damaged",
                              "problem": f"file {missing[0]!r} needs chunk {missing[1]}, which is missing"})
    for name, size in named.files.items():
        stored = names.get(name)
        if stored != size:
            problem = (f"its {named.noun} {name} is missing" if stored is None else
                       f"its {named.noun} {name} holds {stored} bytes, its manifest records {size}")
            return StepSummary(**{**fields, "state": "damaged", "problem": problem})
    return StepSummary(**fields)


def _refused(exc: BaseException) -> str:
    """The state of a step whose documents did not read: ``newer`` for :class:`NewerFormatError` (a
    CheckpointCorruptError that is no damage), else ``damaged``."""
    return "newer" if isinstance(exc, NewerFormatError) else "damaged"
