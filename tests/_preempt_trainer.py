"""A trainer process for the preemption tests: run as ``python _preempt_trainer.py '<json options>'``.

It resumes from the newest step of its task's manager, then trains (one position every ``tick`` seconds),
saving every ``every`` positions in the background and calling ``ctx().checkpoint_if_preempted()`` once per
position. Its state is ``size`` bytes that start with the position. It appends JSON lines to ``log``:
``ready`` (handlers installed, in the loop), ``resumed`` (the restored step, position and sha256),
``emergency`` (the state the emergency save was given), ``preempted`` (the committed step and the times),
``finished``. Options: ``prior`` (a file the SIGTERM handler installed before taskpoint appends to),
``marker`` (a file the emergency function creates, then it sleeps ``linger`` seconds).
"""

from __future__ import annotations

import hashlib
import json
import random
import signal
import sys
import time
from typing import Any

opts: dict[str, Any] = json.loads(sys.argv[1])


def log(event: str, **fields: Any) -> None:
    with open(opts["log"], "a") as f:
        f.write(json.dumps({"event": event, **fields}) + "\n")


if opts.get("prior"):
    def prior(signum: int, frame: object) -> None:
        with open(opts["prior"], "a") as f:
            f.write(f"prior handler ran for {signum}\n")

    signal.signal(signal.SIGTERM, prior)

import taskpoint  # noqa: E402  (after the user's own handler, as a trainer that installs one first)

position = 0


def blob(at: int) -> bytes:
    return at.to_bytes(8, "big") + random.Random(at).randbytes(opts["size"])


def emergency_state() -> bytes:
    called = time.time()  # after the save in flight finished
    data = blob(position)
    log("emergency", position=position, sha256=hashlib.sha256(data).hexdigest(), called_at=called)
    if opts.get("marker"):
        with open(opts["marker"], "w") as f:
            f.write("saving\n")
        time.sleep(opts.get("linger", 0.0))
    return data


@taskpoint.task(name="train", retries=1, root=opts["root"], run_name=opts["run"],
                storage_options=opts["storage_options"], save_on_preemption=emergency_state,
                checkpoints={"async_save": True})
def train() -> int:
    global position
    context = taskpoint.ctx()
    assert context is not None
    mgr = context.checkpoints
    assert mgr is not None
    if mgr.latest_step() is not None:
        data = mgr.restore().read_bytes()
        position = int.from_bytes(data[:8], "big")
        log("resumed", step=mgr.restored_step, position=position, sha256=hashlib.sha256(data).hexdigest(),
            attempt=context.attempt)
    stop = position + opts["more"]
    log("ready", attempt=context.attempt)
    while position < stop:
        position += 1
        time.sleep(opts["tick"])  # the training step
        context.checkpoint_if_preempted()
        if position % opts["every"] == 0:
            mgr.save(blob(position), step=position)
    mgr.wait_until_finished()
    return position


try:
    final = train()
except taskpoint.Preempted as exc:
    notice = taskpoint.preemption.notice()
    assert notice is not None
    log("preempted", step=exc.step, signal=exc.signal, signal_at=notice.at, committed_at=exc.committed_at,
        ended_at=time.time(),
        notices=taskpoint.preemption.notices())
    raise
log("finished", position=final)
