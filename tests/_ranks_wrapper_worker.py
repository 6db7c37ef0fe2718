"""One rank of tests/e2e/test_ranks_wrapper.py's job, started by the real ``torchrun`` (gloo, CPU).

The argument is one JSON object: ``directory`` (the manager's, on local disk). Every rank saves step 1 (rank 1
bytes, the others a state dict), step 2 (a state dict each) and step 3 (a state dict each, in the background)
through one ``CheckpointManager`` of the job's ranks, then reads them back with the kinds' own readers; each
rank prints one JSON line saying what it read back, then ``{"event": "done", "rank": k}``.
"""

from __future__ import annotations

import datetime
import json
import sys
from typing import Any

import torch
import torch.distributed as dist

from taskpoint import CheckpointManager, Shards
from taskpoint.torch import StateDict, load_state_dict_sync

#: Rank 1's step 1: bytes, a payload object, beside the other ranks' state dicts.
RANK_ONE_BYTES = b"rank one's step 1, raw bytes\n" * 40


def state(rank: int, step: int) -> dict[str, Any]:
    """Rank ``rank``'s state dict of ``step``: its own, so that a rank reading another's part would be seen."""
    return {"w": torch.arange(64, dtype=torch.float32) * step + rank, "rank": torch.tensor(rank)}


def saved(rank: int, step: int) -> Any:
    """What rank ``rank`` saves as ``step``."""
    return RANK_ONE_BYTES if (rank, step) == (1, 1) else StateDict(state(rank, step))


def read_back(manager: CheckpointManager, rank: int, step: int) -> bool:
    """Whether this rank reads its own part of ``step`` back as it saved it, with the kind's own reader."""
    if (rank, step) == (1, 1):
        return manager.restore(step).read_bytes() == RANK_ONE_BYTES
    loaded = load_state_dict_sync(manager, step)
    return all(torch.equal(loaded[key], value) for key, value in state(rank, step).items())


def say(**event: Any) -> None:
    """One JSON line in one write (the ranks share torchrun's stdout)."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def main() -> None:
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
    rank, world = dist.get_rank(), dist.get_world_size()
    with CheckpointManager(args["directory"], shards=Shards(rank=rank, world_size=world, commit_timeout=120),
                           grace_seconds=240, preemption=False) as manager:
        for step in (1, 2, 3):
            manager.save(saved(rank, step), step, blocking=step < 3)
        manager.wait_until_finished()
        dist.barrier()  # every rank's saves returned: rank 0's commits are done
        say(rank=rank, steps=manager.steps(), read=[read_back(manager, rank, step) for step in (1, 2, 3)])
        dist.barrier()
    dist.destroy_process_group()
    say(event="done", rank=rank)


if __name__ == "__main__":
    main()
