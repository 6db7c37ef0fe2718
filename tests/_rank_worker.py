"""One rank of a multi-rank job, run as a real process by tests/e2e/test_manager_ranks.py and test_ranks_runtime.py.

The rank comes from the environment (``RANK``/``WORLD_SIZE`` as torchrun sets them); arguments are one JSON
object. Prints one JSON line per event on stdout (``{"event": ...}``), flushed, so the test can follow it.

Modes:

``steps``  save ``steps`` (a list of [step, size, blocking]) through a CheckpointManager of ``directory``;
           before the step ``wait_step``, wait for the file ``go`` to exist. Prints each save, or the error.
``ctx``    print ``ctx()``'s rank, world size and attempt (root mode from ``TASKPOINT_*`` variables).
``job``    a ``@taskpoint.task`` training loop: restore the newest step of ``ctx().checkpoints`` and
           ``ctx().checkpoint``, then save a shard per step (and ``ctx().checkpoint``) until ``until``, then
           sleep (to be killed) or return.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import taskpoint


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def shard(rank: int, step: int, size: int) -> bytes:
    head = f"rank={rank} step={step};".encode()
    return head + bytes([rank + 1]) * max(0, size - len(head))


def run_steps(args: dict[str, Any]) -> None:
    mgr = taskpoint.CheckpointManager(args["directory"], storage_options=args.get("options"),
                                      commit_timeout=args.get("commit_timeout", 30), keep=args.get("keep"),
                                      grace_seconds=args.get("grace", 900), preemption=False,
                                      background_process=args.get("background_process", True))
    rank = mgr.rank
    say(event="ready", rank=rank, world_size=mgr.world_size)
    for step, size, blocking in args["steps"]:
        if step == args.get("wait_step"):
            while not Path(args["go"]).exists():
                time.sleep(0.01)
            say(event="go", rank=rank, step=step)
        try:
            mgr.save(shard(rank, step, size), step, metadata={"by": rank}, blocking=blocking)
        except taskpoint.CheckpointError as exc:
            say(event="error", rank=rank, step=step, type=type(exc).__name__, message=str(exc))
            sys.exit(3)
        say(event="saved", rank=rank, step=step)
    mgr.close()
    say(event="closed", rank=rank)


def run_ctx() -> None:
    context = taskpoint.ctx()
    assert context is not None
    say(event="ctx", rank=context.rank, world_size=context.world_size, local_rank=context.local_rank,
        attempt=context.attempt)


def run_job(args: dict[str, Any]) -> None:
    @taskpoint.task(root=args["root"], run_name=args["run_name"], retries=0, preemption=False)
    def train() -> None:
        context = taskpoint.ctx()
        assert context is not None and context.checkpoints is not None and context.checkpoint is not None
        mgr = context.checkpoints
        latest = mgr.latest_step()
        restored = None if latest is None else mgr.restore(latest).read_bytes().split(b";")[0].decode()
        own = context.checkpoint.load_sync()
        previous = None if own is None else Path(own).read_bytes().decode()
        say(event="resumed", rank=context.rank, attempt=context.attempt, latest=latest, restored=restored,
            checkpoint=previous)
        for step in range((latest or 0) + 1, args["until"] + 1):
            mgr.save(shard(context.rank, step, 1000), step)
            context.checkpoint.save_sync(f"rank={context.rank} attempt={context.attempt} step={step}".encode())
            say(event="saved", rank=context.rank, step=step)
        if args.get("hang"):
            time.sleep(600)

    train()
    say(event="done")


def main() -> None:
    mode, args = sys.argv[1], json.loads(sys.argv[2]) if len(sys.argv) > 2 else {}
    {"steps": lambda: run_steps(args), "ctx": run_ctx, "job": lambda: run_job(args)}[mode]()


if __name__ == "__main__":
    main()
