"""The names in a manager directory: its step folders, and the objects a step folder holds.

Layout under the manager's directory (any fsspec URL)::

    ckpt-{step}/payload-{save_id}   the payload, stored as a Checkpoint stores it (raw, or a tar archive)
    ckpt-{step}/taskpoint.json      the step's manifest, written after the payload: the commit
    ckpt-{step}/rank-{k}.json       a step saved by several ranks: rank k's record of its shard (a payload
                                    like the above), until rank 0 commits the step (see :mod:`.shards`)
    ckpt-{step}/commit-{id}.json    rank 0's lease while it gathers the shards and commits (:mod:`.leases`)
    ckpt-{step}/rank-{k}.failed-{r} rank k's save of the step failed (the error's message): rank 0 stops waiting
    ckpt-{step}/...                 what another kind of step stores (:mod:`.kinds`: a plug-in's own files)
    chunks/, leases/                the chunk store of deduplicated steps (see :mod:`.chunks`)

Names and patterns only: what a listing holds and what may be swept is :mod:`.steps`'s.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

#: Name of a step's manifest inside its folder; its presence is the step's commit.
MANIFEST_NAME = "taskpoint.json"

STEP_FOLDER = re.compile(r"ckpt-(0|[1-9][0-9]*)")
#: An object holding one payload (of a step, or of one rank's shard of it): unique per save.
PAYLOAD_NAME = re.compile(r"payload-[0-9a-f]{32}")
#: Rank 0's lease on a step it is gathering the shards of: while fresh, no sweep removes anything in the folder.
COMMIT_LEASE = re.compile(r"commit-[0-9a-f]{32}\.json")
#: A restore's lease on the step it reads: while fresh, retention in other processes keeps the step.
RESTORE_LEASE = re.compile(r"restore-[0-9a-f]{32}\.json")
#: Rank k's record of its shard of a step saved by several ranks.
RANK_RECORD = re.compile(r"rank-(0|[1-9][0-9]*)\.json")
#: Rank k's note that its save of a step failed in the round whose tag (:func:`round_tag`) follows.
RANK_FAILURE = re.compile(r"rank-(0|[1-9][0-9]*)\.failed-([0-9a-f]{12})")


def stored_names(pattern: str) -> re.Pattern[str]:
    """The names an object matching ``pattern`` has in a step folder: itself, and the temp files of its
    atomic writes (``.<name>.<12 hex>.tmp``)."""
    return re.compile(rf"\.?(?:{pattern})(?:\.[0-9a-f]{{12}}\.tmp)?")


def name_in(body: dict[str, Any], key: str, pattern: re.Pattern[str], what: str) -> str:
    """The object name a step kind's manifest content holds under ``key``; ValueError (which the manifest's
    reader reports as a corrupt record) when it does not match ``pattern``, the names of ``what``."""
    name = str(body[key])
    if not pattern.fullmatch(name):
        raise ValueError(f"it names {name!r}, which is not {what}")
    return name


def commit_lease_name(save_id: str) -> str:
    """The name of rank 0's lease on a step folder while it gathers the shards of save ``save_id``."""
    return f"commit-{save_id}.json"


def round_tag(round_: str) -> str:
    """12 hex digits naming a save's round (:func:`~.shards.save_round`) in an object's name."""
    return hashlib.sha256(round_.encode()).hexdigest()[:12]


def rank_failure_name(rank: int, round_: str) -> str:
    """The name of rank ``rank``'s note that its save of the step in ``round_`` failed."""
    return f"rank-{rank}.failed-{round_tag(round_)}"


def shard_record_name(rank: int) -> str:
    """The name of rank ``rank``'s record of its shard, in the step's folder."""
    return f"rank-{rank}.json"
