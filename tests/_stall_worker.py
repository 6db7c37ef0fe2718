"""A saver that stops itself with a real SIGSTOP at a chosen moment of a save, for tests/e2e/test_stalls.py.

One JSON argument: ``directory``, ``options``, ``grace``, ``dedup``, ``files`` and ``size`` (the payload: that
many pseudo-random files of that many bytes), ``seed``, ``step``, ``at``, the moment, and ``stop_after`` for
``writing``:

``chunk``    a deduplicated save, once its first new chunk is stored (others may be on their way)
``payload``  a plain save, once its payload object has landed and before its manifest is written
``writing``  a plain save, in the middle of writing its payload (once ``stop_after`` bytes of it are written)

The moment is chosen by wrapping the one call that precedes it; everything else is the library's own code on
the real store. Prints JSON lines: ``{"event": "stopping"}`` just before the SIGSTOP, then ``committed`` or
``failed`` (with the exception's type and message) once the save returns.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

import taskpoint
from taskpoint import transfer
from taskpoint.manager import chunks
from taskpoint.manager.kinds import payload as commit


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def stop_here() -> None:
    say(event="stopping")
    os.kill(os.getpid(), signal.SIGSTOP)


def stop_after_first_chunk() -> None:
    lock, calls = threading.Lock(), [0]
    real = chunks.ChunkStore.put

    def put(self: Any, *args: Any) -> None:
        real(self, *args)
        with lock:
            calls[0] += 1
            first = calls[0] == 1
        if first:
            stop_here()

    chunks.ChunkStore.put = put  # type: ignore[method-assign]


def stop_after_payload() -> None:
    real = commit.store_payload

    def store_payload(*args: Any, **kwargs: Any) -> Any:
        result = real(*args, **kwargs)
        stop_here()
        return result

    commit.store_payload = store_payload  # type: ignore[assignment]


def stop_while_writing(after: int) -> None:
    real, written = transfer.HashingWriter.write, [0]

    def write(self: Any, b: bytes) -> int:
        out = real(self, b)
        before, written[0] = written[0], written[0] + len(b)
        if before < after <= written[0]:
            stop_here()
        return out

    transfer.HashingWriter.write = write  # type: ignore[method-assign]


def main() -> None:
    args = json.loads(sys.argv[1])
    payload = Path(tempfile.mkdtemp(prefix="stall-payload-"))
    for i in range(args["files"]):
        (payload / f"w{i}.bin").write_bytes(random.Random(args["seed"] * 1000 + i).randbytes(args["size"]))
    if args["at"] == "writing":
        stop_while_writing(args["stop_after"])
    else:
        {"chunk": stop_after_first_chunk, "payload": stop_after_payload}[args["at"]]()
    with taskpoint.CheckpointManager(args["directory"], storage_options=args["options"], dedup=args["dedup"],
                                     grace_seconds=args["grace"], preemption=False,
                                     background_process=False) as mgr:
        try:
            mgr.save(payload, args["step"], blocking=True)
        except taskpoint.CheckpointError as exc:
            say(event="failed", type=type(exc).__name__, message=str(exc))
        else:
            say(event="committed")


if __name__ == "__main__":
    main()
