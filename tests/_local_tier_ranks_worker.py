"""One rank of a 2-rank job with a local tier, run as a real process by tests/e2e/test_local_tier_ranks.py.

The rank comes from torchrun's variables; the argument is one JSON object: ``remote`` and ``options`` (the
remote tier), ``local`` (this job's local folders, one per rank: ``<local>/rank-<k>``, as each node has its
own disk), ``group`` (start a gloo process group first), ``tag`` (in this job's state, which then differs
from another job's state of the same step), and the mode. Prints one JSON line per event on
stdout, flushed, with the WARNING (and the restore INFO) records of taskpoint's logger, so that the test can
tell which tier each rank read.

Modes:

``save``     save ``steps`` (this rank's state of each step), wait for the promotions, print the tiers' steps.
``restore``  restore the newest step; print it, whether the bytes are this rank's state of it, and the logs.
``train``    restore the newest step (as ``restore``; none on a first launch), then save the steps after it for ever
             (blocking and background in turn), printing each step once ``save()`` returned (with the pids of
             the save processes): the kill test SIGKILLs the ranks at random moments of it.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import taskpoint


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def state(rank: int, step: int, tag: str = "") -> bytes:
    """Rank ``rank``'s state at ``step`` (each rank's shard differs; ``tag``: a job's own, when two jobs save
    the same step number)."""
    return f"rank {rank} at step {step} {tag}".encode() * 3000


class Records(logging.Handler):
    """The messages of taskpoint's logger at INFO and above."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append((record.levelname, record.getMessage()))


def main(args: dict[str, Any]) -> None:
    rank, tag = int(os.environ["RANK"]), args.get("tag", "")
    if args.get("group"):
        import torch.distributed as dist

        dist.init_process_group("gloo")
    records = Records()
    logger = logging.getLogger("taskpoint")
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    local = Path(args["local"]) / f"rank-{rank}"
    with taskpoint.CheckpointManager(args["remote"], storage_options=args.get("options"), local_dir=local,
                                     remote_every=args.get("remote_every", 3), local_keep=args.get("local_keep", 2),
                                     commit_timeout=args.get("commit_timeout", 20), grace_seconds=900,
                                     preemption=False) as mgr:
        if args["mode"] == "save":
            for step in args["steps"]:
                mgr.save(state(rank, step, tag), step)
            mgr.wait_until_finished()
            say(event="saved", remote=mgr.steps(tier="remote"), local=mgr.steps(tier="local"))
            return
        try:  # every rank restores together (a collective with a process group), even with nothing to restore
            data: bytes | None = mgr.restore().read_bytes()
        except FileNotFoundError:
            data = None
        restored = mgr.restored_step
        say(event="restored", step=restored, exact=data is not None and data == state(rank, restored or 0, tag),
            logs=records.messages, local=mgr.steps(tier="local"))
        if args["mode"] == "restore":
            return
        step = restored or 0
        while True:
            step += 1
            mgr.save(state(rank, step, tag), step, blocking=step % 2 == 0)
            # the save processes (the promotions' and the local tier's), which finish their part for a dead rank
            savers = (mgr._background.saver, mgr._tier.local._background.saver)  # type: ignore[union-attr]
            say(event="step", step=step, helpers=[saver.pid for saver in savers if saver])


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
