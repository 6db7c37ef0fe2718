"""A process that acts once the mapped hash of a file is under way (tests/e2e/test_verify_mapped.py).

Run as ``python _map_watcher.py PARENT PATH ACTION``: it waits for a child of process ``PARENT`` running
``mapped_child.py`` to have ``PATH`` in its memory map (``/proc/PID/maps``), then does ``ACTION`` and prints what
it did: ``truncate:SIZE`` truncates ``PATH`` to ``SIZE`` bytes (``truncated``), ``stop`` sends the child SIGSTOP
(``stopped``). It waits at most :data:`BOUND` seconds (then prints ``gave up`` and exits 1).
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

BOUND = 60.0


def mapping_child(parent: int, path: str) -> int | None:
    """The pid of a child of ``parent`` that runs ``mapped_child.py`` and has ``path`` mapped, if there is one."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != parent:
                continue
            if b"mapped_child.py" in (entry / "cmdline").read_bytes() and path in (entry / "maps").read_text():
                return int(entry.name)
        except (OSError, ValueError):
            continue  # a process that ended meanwhile
    return None


def main(parent: int, path: str, action: str) -> int:
    end = time.monotonic() + BOUND
    real = os.path.realpath(path)
    while time.monotonic() < end:
        child = mapping_child(parent, real)
        if child is not None:
            if action == "stop":
                os.kill(child, signal.SIGSTOP)
                print("stopped", flush=True)
            else:
                os.truncate(path, int(action.removeprefix("truncate:")))
                print("truncated", flush=True)
            return 0
        time.sleep(0.001)
    print(f"gave up: no mapped hash of {path} by a child of {parent} in {BOUND} s", flush=True)
    return 1


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), sys.argv[2], sys.argv[3]))
