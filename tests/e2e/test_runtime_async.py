"""An ``async def`` task keeps its event loop running while taskpoint talks to a slow store: the attempt's
set-up (listing attempts, the attempt marker, the lineage probes) and its end (closing the manager, which
waits for a background upload) run in worker threads. Real S3 server, behind a proxy that delays every
request; asyncio and trio."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time

import anyio
import pytest

from helpers import AcceptLoop
from taskpoint import ctx, task

DELAY = 0.15  # seconds added to every chunk the client sends: every request is slow


class DelayingProxy:
    """127.0.0.1:<port> -> the server, holding each chunk the client sends for ``delay`` seconds."""

    def __init__(self, upstream: tuple[str, int], delay: float) -> None:
        self._upstream, self._delay = upstream, delay
        self._sockets: list[socket.socket] = []
        self._accepting = AcceptLoop(self._connected, "delaying-proxy-accept")
        self.url = self._accepting.url

    def _connected(self, client: socket.socket) -> None:
        server = socket.create_connection(self._upstream)
        self._sockets += [client, server]
        threading.Thread(target=self._pipe, args=(client, server, self._delay), daemon=True).start()
        threading.Thread(target=self._pipe, args=(server, client, 0.0), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay: float) -> None:
        try:
            while data := src.recv(65536):
                if delay:
                    time.sleep(delay)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._accepting.close()
        for s in self._sockets:
            with contextlib.suppress(OSError):
                s.close()


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.fixture
def slow_s3(s3_server):
    host, port = s3_server.endpoint.removeprefix("http://").split(":")
    proxy = DelayingProxy((host, int(port)), DELAY)
    location = s3_server.new_location()
    options = {**s3_server.storage_options, "endpoint_url": proxy.url}
    try:
        yield location.base, options
    finally:
        proxy.close()


@pytest.mark.anyio
async def test_attempt_set_up_and_end_do_not_block_the_event_loop(slow_s3):
    root, options = slow_s3
    ticks = 0
    done = anyio.Event()
    seen: dict[str, int] = {}

    async def heartbeat() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await anyio.sleep(0.01)

    @task(retries=1, root=root, run_name="slow", storage_options=options,
          checkpoints={"background_process": False})
    async def job() -> int:
        c = ctx()
        seen[f"entered {c.attempt}"] = ticks
        if c.attempt == 1:
            seen["raised 1"] = ticks
            raise RuntimeError("fail the first attempt: the second sets up with an earlier attempt to probe")
        await c.checkpoints.save_async(b"x" * 10_000, 1, blocking=False)  # uploads while the task ends
        seen["returned 2"] = ticks
        return c.attempt

    async with anyio.create_task_group() as tg:
        tg.start_soon(heartbeat)
        await anyio.sleep(0.05)
        seen["called"] = ticks
        assert await job() == 2
        seen["came back"] = ticks
        done.set()
    # Ticks of the heartbeat while taskpoint worked: each phase makes several requests of DELAY seconds or
    # more, and a loop that kept running ticked meanwhile (a blocked loop ticks 0 times).
    phases = {
        "set-up of attempt 1 (listing, marker)": seen["entered 1"] - seen["called"],
        "end of attempt 1, set-up of attempt 2 (marker, lineage probes)": seen["entered 2"] - seen["raised 1"],
        "end of attempt 2 (manager close waits for the upload)": seen["came back"] - seen["returned 2"],
    }
    assert all(count >= 3 for count in phases.values()), phases


def test_gathered_async_subtasks_are_named_in_call_order(tmp_path):
    """Names are decided when each call starts, before its set-up goes to a worker thread: gathered calls
    are named in the order they were made (asyncio starts gathered coroutines in order), whatever order
    their storage I/O finishes in."""

    @task(retries=0)
    async def part(i: int) -> str:
        await asyncio.sleep(0.01 * (3 - i))
        return ctx().action_name

    async def gather() -> list[str]:
        return list(await asyncio.gather(*(part(i) for i in range(3))))

    for n in range(3):  # a run of its own each time: numbering is per run
        parent = task(retries=0, root=str(tmp_path), run_name=f"gathered-{n}", name="parent")(gather)
        assert asyncio.run(parent()) == ["parent.part", "parent.part-2", "parent.part-3"]
