"""A sweeper that halts at a chosen removal of a chunk sweep, for tests/e2e/test_dead_sweeper.py.

One JSON argument: ``directory``, ``options``, ``grace`` (the gc's), ``at`` (how many chunks it removes before
halting) and ``how``:

``hang``  prints ``{"event": "removing", "removed": n}`` and sleeps (at most 10 minutes) for the test to SIGKILL it
``stop``  prints ``{"event": "stopping", ...}`` and stops itself with a real SIGSTOP; once continued, it goes on

It halts inside the check a sweep makes before each removal, before the check itself: everything else is the
library's own ``gc()`` on the real store. Prints ``{"event": "swept", "removed": [...]}`` once gc returns, and
the ``taskpoint`` logger's records on stderr.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from typing import Any

import taskpoint
from taskpoint.manager import dedup

#: The longest a hanging sweeper waits to be killed (seconds).
HANG = 600


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def halt_at(at: int, how: str) -> None:
    real = dedup.Dedup._may_remove

    def may_remove(self: Any, pulse: Any, own: Any, done: int, total: int) -> bool:
        if done == at:
            say(event="removing" if how == "hang" else "stopping", removed=done, total=total)
            if how == "hang":
                time.sleep(HANG)
            else:
                os.kill(os.getpid(), signal.SIGSTOP)
        return real(self, pulse, own, done, total)

    dedup.Dedup._may_remove = may_remove  # type: ignore[method-assign]


def main() -> None:
    args = json.loads(sys.argv[1])
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    halt_at(args["at"], args["how"])
    with taskpoint.CheckpointManager(args["directory"], storage_options=args["options"], dedup=True,
                                     preemption=False, background_process=False) as mgr:
        removed = mgr.gc(args["grace"])
    say(event="swept", removed=removed)


if __name__ == "__main__":
    main()
