"""One rank of a 3-rank gloo job started by the real ``torchrun``, for tests/e2e/test_transfer_stalls_torchrun.py.

The argument is one JSON object: ``directory``, ``options`` (through the test's fault proxy), ``deadline`` and
``stall`` (the retry policy), ``commit_timeout`` and ``grace``, ``big_rank`` (the rank whose shard of step 2 is a
folder of ``big`` random bytes: a multipart upload; the others save a few bytes) and ``workspace``. Every rank
saves step 1, meets the others at a barrier (so step 1 is committed), saves step 2, prints how that went, and
meets the others again before it ends: a rank whose save failed stays until every rank is done with step 2, so
torchrun's agent, which tears the job down when one worker exits with an error, cuts nobody's save short. Prints
one JSON line per event on stdout.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

import taskpoint


def say(**event: Any) -> None:
    """One JSON line, in one write: the ranks share torchrun's stdout, and unbuffered (PYTHONUNBUFFERED) ``print``
    writes the newline apart, so two ranks' lines could run together."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def shard(rank: int, step: int) -> bytes:
    return f"rank={rank} step={step}".encode()


def main() -> None:
    args = json.loads(sys.argv[1])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=240))
    rank = dist.get_rank()
    retry = taskpoint.RetryPolicy(deadline=args["deadline"], stall_timeout=args["stall"])
    mgr = taskpoint.CheckpointManager(args["directory"], storage_options=args["options"], preemption=False,
                                      commit_timeout=args["commit_timeout"], grace_seconds=args["grace"],
                                      background_process=False, retry=retry)
    assert (mgr.rank, mgr.world_size) == (rank, dist.get_world_size())
    mgr.save(shard(rank, 1), 1)
    dist.barrier()
    say(event="ready", rank=rank)
    data: Any = shard(rank, 2)
    if rank == args["big_rank"]:
        data = Path(args["workspace"]) / f"rank-{rank}"
        data.mkdir(parents=True, exist_ok=True)
        (data / "weights.bin").write_bytes(os.urandom(args["big"]))
    try:
        mgr.save(data, 2)
    except taskpoint.CheckpointError as exc:
        say(event="error", rank=rank, type=type(exc).__name__, message=str(exc))
    else:
        say(event="saved", rank=rank)
    dist.barrier()
    mgr.close()
    dist.destroy_process_group()
    say(event="done", rank=rank)


if __name__ == "__main__":
    main()
