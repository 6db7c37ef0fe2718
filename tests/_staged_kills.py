"""The two kills of a staged background save (issue 43), for every kind that is staged (state dicts, PyTrees,
bytes): the trainer SIGKILLed right after ``save()`` returned, and the save process SIGKILLed in the middle of its
write, its upload held by a proxy. Each test module gives the trainer's script and checks what restores."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _fault_proxy import fault_proxy
from helpers import ORPHAN_EXIT_SLACK, own_staging_folder, pid_alive, process_gone, staged_segments, wait_until
from taskpoint import CheckpointManager

#: The bound of a trainer's exit and of a killed save process's end.
TIMEOUT = 120
#: The bound of the wait for the save process's held upload: it imports the framework first, at nice +10.
HELD_TIMEOUT = 400
#: The grace of a save process whose upload is held (longer than the test, so that only the SIGKILL ends it).
HELD_GRACE_SECONDS = 300


def kill_trainer_after_return(script: str, argv: list[str], grace: float, delay: float) -> tuple[int, int]:
    """Run ``script`` (``python -c``, with ``argv``), which prints its save process's pid once ``save()`` returned,
    SIGKILL it ``delay`` seconds later, and wait until its save process, whose grace is ``grace`` seconds, is gone;
    the pids of the trainer and of its save process."""
    trainer = subprocess.Popen([sys.executable, "-c", script, *argv], stdout=subprocess.PIPE, text=True,
                               env={**os.environ, "TASKPOINT_GRACE_SECONDS": str(grace)})
    try:
        helper = int(trainer.stdout.readline())
        time.sleep(delay)
        trainer.kill()
        assert trainer.wait(TIMEOUT) == -signal.SIGKILL
    finally:
        trainer.kill()
        trainer.wait(TIMEOUT)
        trainer.stdout.close()
    assert process_gone(helper, grace + ORPHAN_EXIT_SLACK), "the save process outlived its grace"
    return trainer.pid, helper


#: The trainer of :func:`kill_save_process_mid_write`: saves step 1 blocking and step 2 in the background, each the
#: data ``<module>:<function>`` (its last argument) makes of the step, then prints its save process's pid and waits.
_HELD_TRAINER = textwrap.dedent("""
    import importlib, json, sys, time
    sys.path[:0] = [sys.argv[3], sys.argv[3] + "/.."]  # the test modules, and the helpers they import
    from taskpoint import CheckpointManager

    module, name = sys.argv[4].split(":")
    data = getattr(importlib.import_module(module), name)
    m = CheckpointManager(sys.argv[1], storage_options=json.loads(sys.argv[2]), async_save=True, preemption=False)
    m.save(data(1), 1, blocking=True)
    m.save(data(2), 2)
    print(m._background.saver.pid, flush=True)
    time.sleep(600)
""")


def kill_save_process_mid_write(data: str, s3_server: Any, uri: str, held_object: str,
                                restores: Callable[[CheckpointManager], None]) -> None:
    """Run a trainer that saves ``data(1)`` as step 1 blocking and ``data(2)`` as step 2 in the background
    (``data``: ``<test module>:<function>``) to ``uri`` on ``s3_server``, the upload of step 2's object
    ``held_object`` (a fragment of its path) held by a proxy. The trainer is SIGKILLed, then its save process while
    it writes: step 2 is not committed, step 1 restores (``restores(manager)`` checks it), and the next manager's
    save process frees the segment the killed one left. The segments are made in a folder of the test's own, that
    no other test's sweep reaches."""
    with own_staging_folder():
        _kill_save_process_mid_write(data, s3_server, uri, held_object, restores)


def _kill_save_process_mid_write(data: str, s3_server: Any, uri: str, held_object: str,
                                 restores: Callable[[CheckpointManager], None]) -> None:
    held: list[str] = []

    def hold(method: str, path: str) -> bool:
        if method in ("PUT", "POST") and f"/ckpt-2/{held_object}" in path:
            held.append(path)
            return True
        return False

    with fault_proxy(s3_server.endpoint, stall_seconds=math.inf) as proxy:
        proxy.hold = hold
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        trainer = subprocess.Popen([sys.executable, "-c", _HELD_TRAINER, uri, json.dumps(options),
                                    str(Path(__file__).parent / "e2e"), data], stdout=subprocess.PIPE, text=True,
                                   env={**os.environ, "TASKPOINT_GRACE_SECONDS": str(HELD_GRACE_SECONDS)})
        try:
            helper = int(trainer.stdout.readline())
            # the save process is in the middle of its write (after importing the framework at nice +10)
            assert wait_until(lambda: held, HELD_TIMEOUT)
            trainer.kill()
            trainer.wait(TIMEOUT)
            assert staged_segments(helper), "the save process holds the segment while it writes"
            os.kill(helper, signal.SIGKILL)
            assert process_gone(helper, TIMEOUT)
        finally:
            trainer.kill()
            trainer.wait(TIMEOUT)
            trainer.stdout.close()
            if pid_alive(helper):
                os.kill(helper, signal.SIGKILL)
    left = staged_segments(helper)
    assert left, "the killed save process's segment is there for the next manager to free"
    with CheckpointManager(uri, storage_options=s3_server.storage_options, async_save=True) as m:
        assert wait_until(lambda: m._background.saver is not None)
        assert [path for path in left if path.exists()] == []
        assert m.steps() == [1]
        restores(m)
