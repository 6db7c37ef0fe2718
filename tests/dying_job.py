"""A staged save's job that ends the save process's main thread alone (``pthread_exit``): the process is then a
zombie in ``/proc`` whose other thread still runs, as a SIGKILLed process is for a while on a loaded machine (its
threads end one by one), and ``poll()`` does not see it end. That thread ends the process once the parent writes to
it or closes its pipe, or after :data:`LINGER_SECONDS`."""

from __future__ import annotations

import ctypes
import os
import select
import threading

#: How long the process lingers at most.
LINGER_SECONDS = 60.0


def _linger() -> None:
    select.select([0], [], [], LINGER_SECONDS)  # the pipe from the parent: a message, or its end
    os._exit(0)


class EndMainThread:
    def run(self, segment: object, progress: object) -> None:
        threading.Thread(target=_linger, name="linger").start()
        ctypes.CDLL(None).pthread_exit(None)
