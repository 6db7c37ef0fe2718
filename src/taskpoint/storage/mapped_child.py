"""The child process of :func:`~taskpoint.storage.localio.hash_mapped`: the pieces of an open file hashed from a
memory map, so that a SIGBUS (the file truncated under the map, a page that fails to read) ends this process and
never the caller's.

Run as ``python -I -S mapped_child.py FD SIZE PIECE HASH THREADS PATH...``: it hashes each ``PIECE`` bytes of the
first ``SIZE`` of the inherited descriptor ``FD`` by ``HASH`` (``blake3``, or a :mod:`hashlib` name) on ``THREADS``
threads, and writes ``INDEX HEXDIGEST`` on a line of its own for each piece, in the order they finish; ``PATH...``
is the caller's ``sys.path``, so that it imports the hash module the caller uses. It imports nothing of taskpoint
(a start of 0.01-0.02 CPU-s). Any other failure is one line ``error TEXT`` and exit status 1.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False  # not typing's: its import is 5 ms of a start of 25
if TYPE_CHECKING:
    from collections.abc import Callable
    from typing import Any

#: Linux's ``MADV_POPULATE_READ`` (5.14): the pages of a piece mapped in one call rather than a fault each.
MADV_POPULATE_READ = 22


def main(argv: list[str]) -> int:
    import resource

    # A SIGBUS here is expected (the file truncated under the map): no core dump of it.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    fd, size, piece, hash_name, threads, *paths = argv
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [path for path in paths if path and os.path.abspath(path) != here]
    try:
        hash_pieces(int(fd), int(size), int(piece), hash_name, int(threads))
    except Exception as exc:  # one line for the caller's log; the caller reads what is left
        os.write(1, f"error {type(exc).__name__}: {exc}\n".encode())
        return 1
    return 0


def hash_pieces(fd: int, size: int, piece: int, hash_name: str, threads: int) -> None:
    import mmap
    import threading

    make: Callable[[], Any]
    if hash_name == "blake3":
        import blake3

        make = blake3.blake3
    else:  # hashlib only here: its import is 3 ms of a start of 25
        import functools
        import hashlib

        make = functools.partial(hashlib.new, hash_name)
    mapped = mmap.mmap(fd, size, access=mmap.ACCESS_READ)
    view = memoryview(mapped)
    starts = iter(range(0, size, piece))
    lock = threading.Lock()

    def work() -> None:
        while True:
            with lock:
                start = next(starts, None)
            if start is None:
                return
            length = min(piece, size - start)
            if sys.platform.startswith("linux"):
                # OSError: an older kernel, or a page that would fault (the hash below then ends this process).
                # Not contextlib.suppress: its import is 4 ms of a start of 25.
                try:  # noqa: SIM105
                    mapped.madvise(MADV_POPULATE_READ, start, length)
                except OSError:
                    pass
            hasher = make()
            hasher.update(view[start:start + length])
            os.write(1, f"{start // piece} {hasher.hexdigest()}\n".encode())  # one write of a line: whole

    workers = [threading.Thread(target=work) for _ in range(max(1, threads))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
