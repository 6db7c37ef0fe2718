"""The local tier with several ranks: each rank's local tier holds its own part of each step, on its own node.

A rank's local step is a plain step of its own local manager (its part, of the kind one rank chose for its data,
with its manifest). Since no rank sees another node's local tier, the ranks agree on what a tier holds in two ways:

- **The remote tier commits a step as any multi-rank step** (:mod:`.shards`): each rank promotes its own part
  (a byte copy of its local step's objects, checked against its local manifest) and records it; rank 0 writes
  the manifest once every rank's part is there. That manifest is the agreement on a remote step: a rank reads
  its part of a remote step from its local copy when that copy's size and sha256 are the ones the remote
  manifest records for its rank, and from the remote copy otherwise (with a WARNING when the local copy fails
  verification, or is not the committed step's part: then it is removed).
- **A step on the local tiers alone** is restored only through an initialized ``torch.distributed`` process
  group (:class:`~taskpoint.group.TorchGroup`): the ranks gather which local steps each holds, try the newest
  step every rank holds (locally or remotely; a step on the remote tier too is read locally only as above), and
  all move to the next older step unless every rank read its shard. Without a process group, restores choose
  among the remote steps only (local copies still serve the reads).
"""

from __future__ import annotations

from ..group import TorchGroup


def common_steps(group: TorchGroup, steps: set[int]) -> set[int]:
    """The steps every rank holds (each rank passes its own)."""
    return set.intersection(*(set(each) for each in group.all_gather(sorted(steps), "the local steps of every rank")))


def everyone(group: TorchGroup, ok: bool) -> bool:
    """Whether every rank passed True (also a barrier)."""
    return all(group.all_gather(bool(ok), "whether every rank restored its shard"))
