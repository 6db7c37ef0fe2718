"""One rank of a 4-rank training job that a preemption stops, run as a real process by tests/e2e/test_preempt_ranks.py.

The rank comes from torchrun's variables; the argument is one JSON object. Prints one JSON line per event on
stdout (``{"event": ...}``), flushed, so that the test can follow it.

Modes:

``train``   resume from the newest step (printing the sha256 of the restored shard), then train: each step
            takes ``base * factor[rank]`` seconds (a schedule the test draws from its seed; one rank up to 3x
            slower) and changes the state; ``should_save(step)`` every step and ``save`` when it says so (every
            ``every`` steps, and at the agreed stop after a notice, where the manager's emergency save of
            ``on_preemption`` ends the process with 128 + signal). With ``group``, a gloo process group and one
            all-reduce per step (the gradients' place), as data-parallel training has. With ``restarted_ends``,
            a process that torchrun's agent restarted (``TORCHELASTIC_RESTART_COUNT`` > 0) ends with 0 once
            it printed where it resumed (without a process group: see ``train``).
``handed``  save steps in the background; after the save of ``kill_step`` returned, print ``handed`` with the
            save process's pid and wait to be SIGKILLed.
``resume``  print the newest committed step and the sha256 of this rank's shard of it, then exit 0.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
from typing import Any

import taskpoint


def say(**event: Any) -> None:
    """One JSON line, in one write: the ranks share torchrun's stdout, and unbuffered (PYTHONUNBUFFERED) ``print``
    writes the newline apart, so two ranks' lines could run together."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def advance(state: bytes, rank: int, step: int) -> bytes:
    """The training step: the next state, a function of the last one (so a resumed run continues it exactly)."""
    return hashlib.sha256(state + f"{rank}:{step}".encode()).digest() * 512  # 16 KiB


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def manager(args: dict[str, Any], **more: Any) -> taskpoint.CheckpointManager:
    return taskpoint.CheckpointManager(args["directory"], storage_options=args.get("options"),
                                       commit_timeout=args.get("commit_timeout", 20), grace_seconds=900, **more)


def train(args: dict[str, Any]) -> None:
    group = None
    restarted = bool(args.get("restarted_ends")) and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0
    # A gloo group of workers the agent restarted does not connect under torch 2.13 (connectFullMesh:
    # connection refused, with a plain script too; pytorch/pytorch#167288 for NCCL): restarted workers only resume.
    if args.get("group") and not restarted:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        group = (torch, dist)
    state = b"start"
    mgr = manager(args, save_interval_steps=args["every"], on_preemption=lambda: state)
    rank, step = mgr.rank, 0
    latest = mgr.latest_step()
    if latest is not None:
        state, step = mgr.restore(latest).read_bytes(), latest
    say(event="resumed", rank=rank, step=latest, sha=digest(state),
        restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    if restarted:
        mgr.close()
        return
    pause = args["base"] * args["factor"][rank]
    try:
        while True:
            step += 1
            time.sleep(pause)
            state = advance(state, rank, step)
            if group is not None:
                torch, dist = group
                dist.all_reduce(torch.ones(4))
            if step == args["ready_at"]:
                say(event="ready", rank=rank, pid=os.getpid())
            if mgr.should_save(step):
                mgr.save(state, step)
                say(event="saved", rank=rank, step=step)
    except taskpoint.Preempted as exc:
        say(event="preempted", rank=rank, step=exc.step, at=step, sha=digest(state), status=exc.code)
        raise


def handed(args: dict[str, Any]) -> None:
    mgr = manager(args, preemption=False)
    rank = mgr.rank
    for step in range(1, args["kill_step"] + 1):
        data = advance(b"", rank, step) * args.get("copies", 4)
        mgr.save(data, step, blocking=False)
        if step < args["kill_step"]:
            mgr.wait_until_finished()
    saver = mgr._background.saver
    say(event="handed", rank=rank, step=args["kill_step"], sha=digest(data), helper=saver.pid if saver else None)
    time.sleep(600)


def resume(args: dict[str, Any]) -> None:
    mgr = manager(args, preemption=False)
    latest = mgr.latest_step()
    data = None if latest is None else mgr.restore(latest).read_bytes()
    say(event="resumed", rank=mgr.rank, step=latest, sha=None if data is None else digest(data))
    mgr.close()


if __name__ == "__main__":
    arguments = json.loads(sys.argv[1])
    {"train": train, "handed": handed, "resume": resume}[arguments["mode"]](arguments)
