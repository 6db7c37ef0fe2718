"""The fast door into the suite (``make check``, ``pytest --fast``): the tests that start no server and no process.

Every test that starts an object-store server, a subprocess (torchrun, ``python -c``, the CLI as a process, a save
process, a pool of processes) or a framework lives in ``tests/e2e/``, or is marked ``e2e`` in a module whose other
tests start none; ``--fast`` leaves those out, and the runs on a server (``store[s3]``, a ``kind`` of ``"gcs"``).
What remains must keep to the rule, and :class:`ProcessGuard` makes sure it does: under ``--fast`` every way of
starting a process in the test's own process refuses and is remembered, so that a test that swallows the refusal
fails all the same (tests/conftest.py fails it, naming what it started). The servers are refused at their one door,
the server fixtures (tests/conftest.py).
"""

from __future__ import annotations

import _posixsubprocess
import functools
import os
import subprocess
import threading
from pathlib import Path
from typing import Any

__all__ = ["E2E", "RULE", "SYSTEM_TOOLS", "ProcessForbidden", "ProcessGuard"]

#: The folder of the tests that start servers, processes or frameworks (``make test`` runs them, ``make check`` not).
E2E = Path(__file__).resolve().parent / "e2e"
#: What every refusal says: the rule and where such a test belongs.
RULE = ("make check (pytest --fast) runs only tests that start no server and no process; a test that does belongs "
        "in tests/e2e/, or is marked e2e in a module whose other tests start none")


#: Programs allowed to run, none of them a server or a worker: ``platform`` runs ``uname -p`` (pytest's own session
#: start asks), ``ctypes.util.find_library`` runs ``ldconfig -p`` and the compiler, and the tests of a full or
#: read-only disk mount a small tmpfs (``helpers.mounted_tmpfs``).
SYSTEM_TOOLS = frozenset({"uname", "ldconfig", "gcc", "cc", "ld", "mount", "umount"})


class ProcessForbidden(RuntimeError):
    """A test of the fast set tried to start a process."""


class ProcessGuard:
    """Replaces every function through which Python starts a process, for the rest of this process's life:
    ``fork_exec`` as :mod:`subprocess` holds it (under asyncio's subprocesses too) and as ``_posixsubprocess``
    does (multiprocessing's spawn and forkserver), ``os.posix_spawn(p)`` (which :mod:`subprocess` uses when it
    can), ``os.system``, and ``os.fork`` and ``os.forkpty`` (multiprocessing's fork, :mod:`pty`). Each refuses
    with :class:`ProcessForbidden` and records what it was asked to start, but lets :data:`SYSTEM_TOOLS` run;
    :meth:`take` hands the records over (tests/conftest.py fails the test with them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._started: list[str] = []

    def install(self) -> None:
        self._refuse(subprocess, "_fork_exec", 0)  # its own name for _posixsubprocess.fork_exec, bound at import
        self._refuse(_posixsubprocess, "fork_exec", 0)
        self._refuse(os, "posix_spawn", 1)
        self._refuse(os, "posix_spawnp", 1)
        self._refuse(os, "system", 0)
        self._refuse(os, "fork", None)
        self._refuse(os, "forkpty", None)

    def take(self) -> list[str]:
        """What was started (refused) since the last call, and forget it."""
        with self._lock:
            started, self._started = self._started, []
        return started

    def _refuse(self, module: Any, name: str, argv_at: int | None) -> None:
        """Replace ``module.name`` by a refusal; its positional argument ``argv_at`` is what it starts."""
        original = getattr(module, name)

        @functools.wraps(original)
        def refused(*args: Any, **kwargs: Any) -> Any:
            argv = args[argv_at] if argv_at is not None else ""
            program = argv if isinstance(argv, (str, bytes)) else (argv[0] if argv else "")
            if program and Path(os.fsdecode(program).split()[0]).name in SYSTEM_TOOLS:
                return original(*args, **kwargs)
            what = f"{module.__name__}.{name}({argv!r})"
            with self._lock:
                self._started.append(what)
            raise ProcessForbidden(f"{what} refused: {RULE}")

        setattr(module, name, refused)

