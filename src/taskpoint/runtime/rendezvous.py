"""How the ranks of one launch agree on their attempt number through storage, with no process group.

The ranks of a job start at about the same moment, and each used to take "the next free attempt" from a
listing: two ranks listing at once took the same number, a rank listing after another had begun took the
next one. Now rank 0 alone chooses, and the others wait for its choice. The difficulty is to tell rank 0's
choice *for this launch* from one a previous launch left in storage, without trusting clocks; fresh random
nonces on both sides do it, in the group records (:class:`~taskpoint.group.StorageGroup`) of
``{action}/rendezvous/``:

1. Rank 0 writes ``open-0.json`` of a fresh round ``R``.
2. Rank k > 0 draws its own nonce ``n_k`` and polls: whenever ``open-0.json`` is of a round it has not seen,
   it writes ``rank-k.json`` of that round, holding ``n_k``; and it reads ``claim-0.json``.
3. Rank 0 polls the ``rank-k.json`` records until every rank's is of round ``R``. Only then does it choose the
   attempt (the next free one, or the one it was given), write the attempt's marker, and write
   ``claim-0.json`` of round ``R``, holding ``{attempt, members: {k: n_k}}``.
4. Rank k takes the attempt of a claim whose ``members[k]`` is its own ``n_k``.

Why a rank never takes a previous launch's claim: ``n_k`` was drawn by this process, so only a claim written
after rank 0 read ``rank-k.json`` with ``n_k`` can name it, and rank 0 accepts that record only of round ``R``,
its own fresh round. A record a previous launch left is of an old round, and a claim it left names old nonces.
A rank that read an old ``open-0.json`` first writes a record rank 0 ignores, then sees the new round and writes
again. All ranks leave step 3 together: it is also a barrier. Listings and reads must show an object once its
write returned (S3, GCS, Azure, local disk and ``memory://`` do).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from .._log import safe_uri
from ..group import RanksMissing, StorageGroup, poll
from ..ranks import Ranks
from ..storage import Location


def agree(folder: Location, ranks: Ranks, choose: Callable[[], int], timeout: float) -> int:
    """The attempt every rank of this launch runs: ``choose()`` called on rank 0 once every rank has joined,
    then read by the others. TimeoutError when the other ranks (or rank 0) do not show up in ``timeout``."""
    group = StorageGroup(folder, ranks, uuid.uuid4().hex, timeout)
    if ranks.rank == 0:
        group.publish("open", None)
        try:
            joined = group.wait_for("rank", range(1, ranks.world_size), "waiting for the others to join")
        except RanksMissing as exc:
            raise _timed_out(f"rank 0 waited for the other {ranks.world_size - 1} ranks to join", group) from exc
        attempt = choose()
        group.publish("claim", {"attempt": attempt, "members": {str(k): r.value for k, r in joined.items()}})
        return attempt
    nonce, saw = uuid.uuid4().hex, None

    def claimed() -> int | None:
        nonlocal saw
        opened = group.read("open", 0)
        if opened is not None and opened.round != saw:
            if opened.world_size != ranks.world_size:
                raise ValueError(f"rank 0 runs with world_size {opened.world_size} and rank {ranks.rank} with "
                                 f"{ranks.world_size} ({folder.uri}): give every rank the same world size")
            saw = opened.round
            group.publish("rank", nonce, round_=saw)
        claim = group.read("claim", 0)
        value = claim.value if claim is not None and isinstance(claim.value, dict) else {}
        members = value.get("members")
        return int(value["attempt"]) if isinstance(members, dict) and members.get(str(ranks.rank)) == nonce else None

    try:
        return poll(f"rank {ranks.rank}: waiting for rank 0's attempt at {safe_uri(folder.uri)}", claimed, timeout,
                    missing=lambda: [0])
    except RanksMissing as exc:
        raise _timed_out(f"rank {ranks.rank} waited for rank 0 to choose the attempt", group) from exc


def _timed_out(what: str, group: StorageGroup) -> TimeoutError:
    return TimeoutError(f"{what} at {group.folder.uri} for {group.timeout:g} s; start every rank of the job (same "
                        "world size, run and action), or raise $TASKPOINT_RENDEZVOUS_TIMEOUT. If only one process "
                        "runs the task, set TASKPOINT_RANK=0 and TASKPOINT_WORLD_SIZE=1 for it.")
