"""How the ranks of one launch agree on their attempt number through storage, with no process group.

The ranks of a job start at about the same moment, and each used to take "the next free attempt" from a
listing: two ranks listing at once took the same number, a rank listing after another had begun took the
next one. Now rank 0 alone chooses, and the others wait for its choice. The difficulty is to tell rank 0's
choice *for this launch* from one a previous launch left in storage, without trusting clocks; fresh random
nonces on both sides do it, in ``{action}/rendezvous/``:

1. Rank 0 writes ``open.json`` with a fresh nonce ``R`` (the round).
2. Rank k > 0 draws its own nonce ``n_k`` and polls: whenever ``open.json`` holds a round it has not seen,
   it writes ``rank-k.json`` = ``{nonce: n_k, saw: round}``; and it reads ``claim.json``.
3. Rank 0 polls the ``rank-k.json`` records until every rank's says ``saw: R``. Only then does it choose
   the attempt (the next free one, or the one it was given), write the attempt's marker, and write
   ``claim.json`` = ``{round: R, attempt, members: {k: n_k}}``.
4. Rank k takes the attempt of a ``claim.json`` whose ``members[k]`` is its own ``n_k``.

Why a rank never takes a previous launch's claim: ``n_k`` was drawn by this process, so only a claim written
after rank 0 read ``rank-k.json`` with ``n_k`` can name it, and rank 0 accepts that record only with
``saw: R``, its own fresh round. A record a previous launch left has an old ``saw``, and a claim it left
names old nonces. A rank that read an old ``open.json`` first writes a record rank 0 ignores, then sees the
new round and writes again. All ranks leave step 3 together: it is also a barrier. Listings and reads must
show an object once its write returned (S3, GCS, Azure, local disk and ``memory://`` do).
"""

from __future__ import annotations

import json
import re
import time
import uuid
from collections.abc import Callable
from typing import Any

from ..ranks import Ranks
from ..storage import Location

#: First and longest pause between two polls of the rendezvous folder (seconds).
POLL_FIRST, POLL_LONGEST = 0.05, 1.0
_RECORD = re.compile(r"rank-(0|[1-9][0-9]*)\.json")


def agree(folder: Location, ranks: Ranks, choose: Callable[[], int], timeout: float) -> int:
    """The attempt every rank of this launch runs: ``choose()`` called on rank 0 once every rank has joined,
    then read by the others. TimeoutError when the other ranks (or rank 0) do not show up in ``timeout``."""
    if ranks.rank == 0:
        return _lead(folder, ranks.world_size, choose, timeout)
    return _follow(folder, ranks, timeout)


def _read(location: Location) -> dict[str, Any] | None:
    data = location.read_small()
    if data is None:
        return None
    try:
        doc = json.loads(data)
    except ValueError:
        return None  # not ours, or damaged: as good as absent, and rewritten by this launch
    return doc if isinstance(doc, dict) else None


def _write(location: Location, doc: dict[str, Any]) -> None:
    location.write_small(json.dumps(doc, sort_keys=True).encode(), action="agree on the attempt at")


def _lead(folder: Location, world: int, choose: Callable[[], int], timeout: float) -> int:
    round_ = uuid.uuid4().hex
    _write(folder.child("open.json"), {"round": round_, "world_size": world})
    members: dict[str, str] = {}
    for pause in _pauses(timeout, f"rank 0 waited for the other {world - 1} ranks to join at {folder.uri}"):
        # Records not accepted yet are read again on every poll: one may be rewritten within the second
        # (the resolution of some stores' modification times), so a time never says it is unchanged.
        for name in folder.list_names():
            match = _RECORD.fullmatch(name)
            key = match.group(1) if match else None
            if key is None or not 0 < int(key) < world or key in members:
                continue
            record = _read(folder.child(name))
            if record is not None and record.get("saw") == round_ and isinstance(record.get("nonce"), str):
                members[key] = record["nonce"]
        if len(members) == world - 1:
            break
        time.sleep(pause)
    attempt = choose()
    _write(folder.child("claim.json"), {"round": round_, "attempt": attempt, "members": members})
    return attempt


def _follow(folder: Location, ranks: Ranks, timeout: float) -> int:
    nonce, saw = uuid.uuid4().hex, None
    key = str(ranks.rank)
    for pause in _pauses(timeout, f"rank {ranks.rank} waited for rank 0 to choose the attempt at {folder.uri}"):
        opened = _read(folder.child("open.json"))
        if opened is not None and opened.get("round") != saw:
            if opened.get("world_size") != ranks.world_size:
                raise ValueError(f"rank 0 runs with world_size {opened.get('world_size')} and rank {ranks.rank} "
                                 f"with {ranks.world_size} ({folder.uri}): give every rank the same world size")
            saw = opened.get("round")
            _write(folder.child(f"rank-{key}.json"), {"nonce": nonce, "saw": saw})
        claim = _read(folder.child("claim.json"))
        if claim is not None and claim.get("members", {}).get(key) == nonce:
            return int(claim["attempt"])
        time.sleep(pause)
    raise AssertionError("unreachable: _pauses raises at the deadline")  # pragma: no cover


def _pauses(timeout: float, what: str) -> Any:
    """Pauses between polls, growing from POLL_FIRST to POLL_LONGEST; TimeoutError once ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    pause = POLL_FIRST
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"{what} for {timeout:g} s; start every rank of the job (same world size, run "
                               "and action), or raise $TASKPOINT_RENDEZVOUS_TIMEOUT. If only one process runs "
                               "the task, set TASKPOINT_RANK=0 and TASKPOINT_WORLD_SIZE=1 for it.")
        yield min(pause, remaining)
        pause = min(pause * 1.5, POLL_LONGEST)
