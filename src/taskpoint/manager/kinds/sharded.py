"""The ``sharded`` step kind: a step saved by several ranks, one payload object per rank (its shard), committed
by rank 0 once every rank's shard is stored (:mod:`..shards`). A restore reads this rank's shard, so it needs
as many ranks as saved. Its manifest keeps the layout of format version 3."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from ..._progress import Progress
from ...errors import CheckpointError
from ...format.records import BLAKE3_VERSION, KIND_VERSION, Shard, StepManifest
from ...payloads import Payload
from ..background import store_payload
from ..shards import ShardWriter
from ..step_commit import Stored
from ..step_names import PAYLOAD_NAME, RANK_FAILURE, RANK_RECORD, stored_names
from ..steps import StepObjects, StepStore
from . import Checked, Described, SaveJob, StepContext, read_object, register_step_kind, stored_object

_OWNED = stored_names(rf"{PAYLOAD_NAME.pattern}|{RANK_RECORD.pattern}|{RANK_FAILURE.pattern}")


@dataclass(frozen=True)
class Shards:
    """The content of a step saved by several ranks: rank k's shard is ``shards[k]``."""

    kind: ClassVar[str] = "sharded"
    shards: tuple[Shard, ...]

    def to_json(self) -> dict[str, Any]:
        return {"payload": "", "shards": [shard.to_json() for shard in self.shards]}

    @property
    def manifest_version(self) -> int:
        """The manifest's version: :data:`BLAKE3_VERSION` when a shard is recorded by BLAKE3 (else the kind keeps
        version 3's layout)."""
        return BLAKE3_VERSION if any(shard.record.blake3 is not None for shard in self.shards) else KIND_VERSION


def _shards(manifest: StepManifest) -> tuple[Shard, ...]:
    content = manifest.content
    assert isinstance(content, Shards)
    return content.shards


class ShardedKind:
    """Steps saved by several ranks (see the module); saved when the manager's ``world_size`` is above 1."""

    name = Shards.kind
    helper = True

    def decode(self, body: dict[str, Any]) -> Shards:
        shards = tuple(Shard.from_json(s) for s in body["shards"])
        if [shard.rank for shard in shards] != list(range(len(shards))) or len(shards) < 2:
            raise ValueError("the shards are not ranks 0 .. world_size - 1 in order")
        if body["payload"] != "" or not all(PAYLOAD_NAME.fullmatch(shard.payload) for shard in shards):
            raise ValueError("a shard names something other than a payload object")
        return Shards(shards)

    def accepts(self, payload: Payload | object, context: StepContext) -> bool:
        return context.plan.ranks.distributed and isinstance(payload, Payload)

    def store(self, context: StepContext, job: SaveJob) -> Stored:
        payload = job.payload
        assert isinstance(payload, Payload)
        writer = ShardWriter(context.steps, context.plan, context.grace, context.waiting)
        codec = context.codec.name if payload.archived else "raw"
        # The save process finishes this rank's part (its record; on rank 0, the commit) if we die meanwhile.
        return writer.write(job.step, job.metadata, job.attempt, payload, codec, Shards,
                            lambda location, orphan: store_payload(location, payload, context.codec, context.level,
                                                                   job.saver, orphan, progress=job.progress),
                            job.until_committed)

    def _own(self, context: StepContext, step: int, manifest: StepManifest) -> Shard:
        """This rank's shard; CheckpointError when the step was saved by another number of ranks."""
        shards, ranks = _shards(manifest), context.plan.ranks
        if len(shards) != ranks.world_size:
            raise CheckpointError(
                f"step {step} in {context.steps.directory} was saved by {len(shards)} ranks and holds one shard per "
                f"rank; this manager is rank {ranks.rank} of {ranks.world_size}. Restore it with {len(shards)} ranks "
                "(for another number of ranks, save through taskpoint.torch, whose checkpoints reshard).")
        return shards[ranks.rank]

    def restore(self, context: StepContext, step: int, manifest: StepManifest, workspace: Path,
                progress: Progress) -> Path:
        shard = self._own(context, step, manifest)
        return read_object(context, step, shard.payload, shard.record, workspace, progress)

    def reads(self, context: StepContext, step: int, manifest: StepManifest) -> StepObjects:
        """What this rank's restore reads: its own shard (a broadcast restore shares no object of such a step)."""
        shard = self._own(context, step, manifest)
        return StepObjects(files={shard.payload: shard.record.size})

    def verify(self, context: StepContext, step: int, manifest: StepManifest, progress: object) -> Checked:
        shards = _shards(manifest)
        size = sum(stored_object(context, step, shard.payload, shard.record, progress,
                                 f"verify step {step}: {shard.payload}") for shard in shards)
        return Checked(size, f"{len(shards)} shards, {shards[0].record.hash_name} matches its manifest")

    def objects(self, steps: StepStore, step: int, manifest: StepManifest) -> StepObjects:
        shards = _shards(manifest)
        return StepObjects(files={shard.payload: shard.record.size for shard in shards},
                           digests={shard.payload: shard.record.digest for shard in shards if shard.record.digest})

    def delete(self, steps: StepStore, step: int, manifest: StepManifest) -> set[str]:
        names = {shard.payload for shard in _shards(manifest)}
        for name in names:
            steps.object(step, name).remove()
        return names

    def describe(self, context: StepContext, step: int, manifest: StepManifest) -> Described:
        return Described(payload="", details={"shards": [
            {"rank": s.rank, "payload": s.payload, "size": s.record.size, "sha256": s.record.sha256,
             **({} if s.record.blake3 is None else {"blake3": s.record.blake3})}
            for s in _shards(manifest)]})

    def owns(self, name: str, committed: bool) -> bool:
        return bool(_OWNED.fullmatch(name))


SHARDED = register_step_kind(ShardedKind())
