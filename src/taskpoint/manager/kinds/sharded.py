"""Ranks as a wrapper around any step kind: a step saved by several ranks, where each rank stores its part through
the kind one rank would choose for its data (a payload object, a state dict's file, a PyTree's files) and rank 0
commits one manifest once every rank's part is recorded (:mod:`..shards`). A restore hands this rank's part to its
kind, so it needs as many ranks as saved; verify, objects, delete and describe go through every rank's kind.

A step whose every part is one payload object keeps the ``sharded`` layout of format version 3 (a payload wrapped
is exactly a shard), which every taskpoint reads; any other is a ``ranks`` step (version 4), whose manifest names
each rank's kind, that kind's content and its record."""

from __future__ import annotations

import dataclasses
import functools
import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..._progress import Progress
from ...errors import CheckpointError
from ...format.pieces import PAYLOAD_PIECES, checked_by
from ...format.records import (
    BLAKE3_VERSION,
    KIND_VERSION,
    PIECES_VERSION,
    ObjectRecord,
    Shard,
    StepContent,
    StepManifest,
)
from ...payloads import Payload
from ..background import store_payload
from ..shards import ShardWriter, shards_record
from ..step_commit import Stored
from ..step_names import PAYLOAD_NAME, RANK_FAILURE, RANK_RECORD, stored_names
from ..steps import StepObjects, StepStore
from . import Checked, Described, SaveJob, StepContext, StepKind, in_place_folder, partial_kind, register_step_kind
from . import step_kind as kind_named
from .payload import PAYLOAD, PayloadObject

_OWNED = stored_names(rf"{PAYLOAD_NAME.pattern}|{RANK_RECORD.pattern}|{RANK_FAILURE.pattern}")


@dataclass(frozen=True)
class Shards:
    """The content of a step saved by several ranks, each rank's part one payload object: rank k's is
    ``shards[k]``."""

    kind: ClassVar[str] = "sharded"
    shards: tuple[Shard, ...]

    def to_json(self) -> dict[str, Any]:
        return {"payload": "", "shards": [shard.to_json() for shard in self.shards]}

    @property
    def manifest_version(self) -> int:
        """The manifest's version: :data:`BLAKE3_VERSION` when a shard is recorded by BLAKE3 (else the kind keeps
        version 3's layout)."""
        return by_blake3(self.shards)


@dataclass(frozen=True)
class RankParts:
    """The content of a step saved by several ranks whose parts are of other kinds: rank k's part is
    ``shards[k]`` (its kind, that kind's content as JSON, its record), decoded as ``contents[k]``."""

    kind: ClassVar[str] = "ranks"
    shards: tuple[Shard, ...]
    contents: tuple[StepContent, ...] = dataclasses.field(compare=False)

    def to_json(self) -> dict[str, Any]:
        return {"shards": [shard.to_json() for shard in self.shards]}

    @property
    def manifest_version(self) -> int:
        """The manifest's version: :data:`BLAKE3_VERSION` when a part is recorded by BLAKE3 (a payload's)."""
        return by_blake3(self.shards)


def by_blake3(shards: tuple[Shard, ...]) -> int:
    """The manifest version of a step whose ranks' parts are ``shards``: :data:`PIECES_VERSION` when one is
    recorded by BLAKE3 pieces (a payload step of a rank's local tier, promoted), :data:`BLAKE3_VERSION` when one is
    recorded by BLAKE3, which readers of older versions would check as sha256; else version 4."""
    if any(shard.record.pieces for shard in shards):
        return PIECES_VERSION
    return BLAKE3_VERSION if any(shard.record.blake3 is not None for shard in shards) else KIND_VERSION


def content_of_shards(shards: tuple[Shard, ...]) -> Shards | RankParts:
    """The content that commits every rank's part: ``sharded`` when each is one payload object (a payload wrapped
    is exactly a shard), else ``ranks``, a payload object among them then a part of the ``payload`` kind."""
    payloads = [shard.payload if shard.step_kind is None else (shard.content or {}).get("payload", "")
                if shard.step_kind == PAYLOAD.name else "" for shard in shards]
    if all(payloads):
        return Shards(tuple(Shard(s.rank, name, s.record) for s, name in zip(shards, payloads, strict=True)))
    return _decoded(tuple(shard if shard.step_kind is not None else dataclasses.replace(
        shard, payload="", step_kind=PAYLOAD.name, content=PayloadObject(shard.payload).to_json()) for shard in shards))


def _decoded(parts: tuple[Shard, ...]) -> RankParts:
    """The ``ranks`` content of ``parts``, each part's content decoded by its kind."""
    return RankParts(parts, tuple(kind_named(str(part.step_kind)).decode(part.content or {}) for part in parts))


def _parts(manifest: StepManifest) -> list[tuple[StepKind, StepManifest]]:
    """Each rank's part of ``manifest``'s step, by rank: its kind, and the manifest that kind reads it from."""
    content = manifest.content
    if isinstance(content, Shards):
        pairs: list[tuple[StepKind, Shard, StepContent]] = [
            (PAYLOAD, shard, PayloadObject(shard.payload)) for shard in content.shards]
    else:
        assert isinstance(content, RankParts)
        pairs = [(kind_named(str(shard.step_kind)), shard, part)
                 for shard, part in zip(content.shards, content.contents, strict=True)]
    return [(kind, dataclasses.replace(manifest, record=shard.record, content=part)) for kind, shard, part in pairs]


def own_record(manifest: StepManifest, rank: int) -> ObjectRecord | None:
    """The record of ``rank``'s part of a step of several ranks (None: not such a step, or no such rank)."""
    content = manifest.content
    if not isinstance(content, (Shards, RankParts)) or rank >= len(content.shards):
        return None
    return content.shards[rank].record


def rank_part(rank: int, manifest: StepManifest) -> Shard:
    """Rank ``rank``'s part of a step of several ranks, of another kind than one payload object: what
    ``manifest`` commits, as rank 0 gathers it (:mod:`..shards`)."""
    return Shard(rank, "", manifest.record, manifest.kind, manifest.content.to_json())


def commit_parts(steps: StepStore, step: int, shards: tuple[Shard, ...]) -> Stored:
    """What rank 0 commits of every rank's part of ``step``: their content, and the objects each kind names."""
    content, record = content_of_shards(shards), shards_record(shards)
    named = [kind.objects(steps, step, part) for kind, part in _parts(StepManifest(step, record, None, {}, content))]
    return Stored(content, record, {name: size or 0 for each in named for name, size in each.files.items()})


class RanksKind:
    """Steps saved by several ranks (see the module), in either layout (``name``). The manager saves through one
    around the kind a rank chose (:meth:`around`); the registered ones read."""

    def __init__(self, name: str, inner: StepKind | None = None) -> None:
        self.name, self._inner = name, inner
        #: As the kind a rank chose: a background save's snapshot (a state dict's bytes, a PyTree's folder) is a
        #: payload, uploaded as a shard by the save process, which finishes it if this process dies. A part of
        #: another kind is always stored in this process: the save process would commit it as a step of its own.
        self.helper = inner is not None and inner.helper

    def around(self, inner: StepKind) -> RanksKind:
        """What saves ``inner``'s data with several ranks: each rank stores its part through ``inner``."""
        return RanksKind(SHARDED.name if inner is PAYLOAD else RANKS.name, inner)

    def decode(self, body: dict[str, Any]) -> Shards | RankParts:
        shards = tuple(Shard.from_json(s) for s in body["shards"])
        if [shard.rank for shard in shards] != list(range(len(shards))) or len(shards) < 2:
            raise ValueError("the shards are not ranks 0 .. world_size - 1 in order")
        if self.name == SHARDED.name:
            if body["payload"] != "" or not all(PAYLOAD_NAME.fullmatch(s.payload) and s.step_kind is None
                                                for s in shards):
                raise ValueError("a shard names something other than a payload object")
            return Shards(shards)
        if any(shard.step_kind in (None, SHARDED.name, RANKS.name) for shard in shards):
            raise ValueError("a rank's part names no step kind, or a step of several ranks")
        return _decoded(shards)

    def accepts(self, payload: Payload | object, context: StepContext) -> bool:
        return False  # chosen by the manager's writer around the kind a rank chose (:meth:`around`)

    def store(self, context: StepContext, job: SaveJob) -> Stored:
        inner, steps, step = self._inner, context.steps, job.step
        if inner is None:
            raise CheckpointError(f"a {self.name!r} step is saved by a manager of several ranks, each rank through "
                                  "the kind it chose for its data")
        writer = ShardWriter(steps, context.plan, context.grace, context.waiting)
        if inner is not PAYLOAD:
            def part() -> tuple[Shard, int]:
                stored = inner.store(context, dataclasses.replace(job, saver=None))
                return rank_part(context.plan.ranks.rank, stored.manifest(step, job.attempt, job.metadata)), \
                    stored.sent

            return writer.write(step, job.attempt, part, functools.partial(commit_parts, steps, step),
                                job.until_committed)
        payload = job.payload
        assert isinstance(payload, Payload)
        orphan = writer.orphan(step, job.metadata, job.attempt, payload.kind,
                               context.codec.name if payload.archived else "raw", content_of_shards)

        def shard() -> tuple[Shard, int]:
            # The save process finishes this rank's part (its record; on rank 0, the commit) if we die meanwhile.
            size, digest = store_payload(steps.object(step, orphan.name), payload, context.codec, context.level,
                                         job.saver, orphan, progress=job.progress, digest=PAYLOAD_PIECES)
            return orphan.shard(size, digest), size

        return writer.write(step, job.attempt, shard, orphan.stored, job.until_committed)

    def _own(self, context: StepContext, step: int, manifest: StepManifest) -> tuple[StepKind, StepManifest]:
        """This rank's part; CheckpointError when the step was saved by another number of ranks."""
        parts, ranks = _parts(manifest), context.plan.ranks
        if len(parts) != ranks.world_size:
            raise CheckpointError(
                f"step {step} in {context.steps.directory} was saved by {len(parts)} ranks and holds one shard per "
                f"rank; this manager is rank {ranks.rank} of {ranks.world_size}. Restore it with {len(parts)} ranks "
                "(for another number of ranks, save through taskpoint.torch, whose checkpoints reshard).")
        return parts[ranks.rank]

    def restore(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                progress: Progress) -> Path:
        kind, part = self._own(context, step, manifest)
        return kind.restore(context, step, part, workspace, progress)

    def restore_in_place(self, context: StepContext, step: int, manifest: StepManifest, progress: Progress
                         ) -> Path | None:
        kind, part = self._own(context, step, manifest)
        return in_place_folder(kind, context, step, part, progress)

    def restore_paths(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                      paths: Sequence[str], progress: Progress) -> Path:
        kind, part = self._own(context, step, manifest)
        return partial_kind(kind).restore_paths(context, step, part, workspace, paths, progress)

    def open_file(self, context: StepContext, step: int, manifest: StepManifest, path: str) -> io.BufferedReader:
        kind, part = self._own(context, step, manifest)
        return partial_kind(kind).open_file(context, step, part, path)

    def reads(self, context: StepContext, step: int, manifest: StepManifest) -> StepObjects:
        """What this rank's restore reads: its own part (a broadcast restore shares no object of such a step)."""
        kind, part = self._own(context, step, manifest)
        reads: Callable[..., StepObjects] | None = getattr(kind, "reads", None)
        return reads(context, step, part) if reads is not None else kind.objects(context.steps, step, part)

    def verify(self, context: StepContext, step: int, manifest: StepManifest, progress: object) -> Checked:
        checked = [kind.verify(context, step, part, progress) for kind, part in _parts(manifest)]
        details = sorted({each.detail for each in checked})
        return Checked(sum(each.size for each in checked), f"{len(checked)} shards, {'; '.join(details)}")

    def objects(self, steps: StepStore, step: int, manifest: StepManifest) -> StepObjects:
        named = [kind.objects(steps, step, part) for kind, part in _parts(manifest)]
        return StepObjects(files={k: v for each in named for k, v in each.files.items()},
                           chunks={k: v for each in named for k, v in each.chunks.items()},
                           digests={k: v for each in named for k, v in each.digests.items()}, noun=named[0].noun)

    def delete(self, steps: StepStore, step: int, manifest: StepManifest) -> set[str]:
        return {name for kind, part in _parts(manifest) for name in kind.delete(steps, step, part)}

    def describe(self, context: StepContext, step: int, manifest: StepManifest) -> Described:
        shards = []
        for (kind, part), shard in zip(_parts(manifest), getattr(manifest.content, "shards", ()), strict=True):
            described = kind.describe(context, step, part)
            named = {} if shard.step_kind is None else {**described.details, "step_kind": shard.step_kind}
            shards.append({**named, "rank": shard.rank, "payload": described.payload, "size": shard.record.size,
                           **checked_by(shard.record.sha256, shard.record.blake3, shard.record.pieces)})
        return Described(payload="", details={"shards": shards})

    def owns(self, name: str, committed: bool) -> bool:
        return bool(_OWNED.fullmatch(name))


SHARDED, RANKS = RanksKind(Shards.kind), RanksKind(RankParts.kind)
register_step_kind(SHARDED)
register_step_kind(RANKS)
