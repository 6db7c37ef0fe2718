"""The local tier with several ranks: each rank's local tier holds its own shard, on its own node.

A rank's local step is a plain step of its own local manager (its shard, with its manifest and sha256). Since
no rank sees another node's local tier, the ranks agree on what a tier holds in two ways:

- **The remote tier commits a step as any multi-rank step** (:mod:`.shards`): each rank promotes its own shard
  (a byte copy of its local payload, checked against its local manifest) and records it; rank 0 writes the
  manifest once every rank's shard is there. That manifest is the agreement on a remote step: a rank reads its
  shard of a remote step from its local copy when that copy's sha256 is the one the remote manifest names for
  its rank, and from the remote copy otherwise (with a WARNING when the local copy fails verification, or is
  not the committed step's shard: then it is removed).
- **A step on the local tiers alone** is restored only through an initialized ``torch.distributed`` process
  group (:class:`~taskpoint.group.TorchGroup`): the ranks gather which local steps each holds, try the newest
  step every rank holds (locally or remotely; a step on the remote tier too is read locally only as above), and
  all move to the next older step unless every rank read its shard. Without a process group, restores choose
  among the remote steps only (local copies still serve the reads).
"""

from __future__ import annotations

import dataclasses

from ..format.records import ObjectRecord, StepManifest
from ..group import TorchGroup
from .kinds.sharded import Shards
from .shards import ShardOrphan


def common_steps(group: TorchGroup, steps: set[int]) -> set[int]:
    """The steps every rank holds (each rank passes its own)."""
    return set.intersection(*(set(each) for each in group.all_gather(sorted(steps), "the local steps of every rank")))


def everyone(group: TorchGroup, ok: bool) -> bool:
    """Whether every rank passed True (also a barrier)."""
    return all(group.all_gather(bool(ok), "whether every rank restored its shard"))


def own_shard(manifest: StepManifest, rank: int) -> ObjectRecord | None:
    """The record a remote multi-rank manifest holds of ``rank``'s shard (None: no such shard)."""
    if not isinstance(manifest.content, Shards) or rank >= len(manifest.content.shards):
        return None
    return manifest.content.shards[rank].record


@dataclasses.dataclass(frozen=True)
class RecordedKind:
    """What the shard writer reads of a payload it records (its kind): the kind of the local step promoted."""

    kind: str


@dataclasses.dataclass(frozen=True)
class VerifiedShard:
    """A promoted shard's part for the save process when the trainer died while it copied the shard: finish it
    (record it; on rank 0, commit the step once every shard is there) only when the copy's size and digest are
    the local manifest's (``digest``: its hash and hex), so a torn local shard is never recorded."""

    shard: ShardOrphan
    size: int
    digest: tuple[str, str] | None

    def finish(self, size: int, digest: str, deadline: float) -> None:
        if (size, (self.shard.hash_name, digest)) == (self.size, self.digest):
            self.shard.finish(size, digest, deadline)
