"""A TCP proxy on 127.0.0.1 that can cut the network between a client and a real storage server.

This is not a mock of the storage: the server is real and so is the failure the client sees (connections
reset mid-request, then refused), as when a network link or a load balancer dies during an upload.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from urllib.parse import urlsplit

from helpers import AcceptLoop


class CuttableProxy:
    """Forwards 127.0.0.1:<port> to ``upstream``; after ``cut_after`` bytes sent upstream, it goes dark."""

    def __init__(self, upstream_url: str) -> None:
        parts = urlsplit(upstream_url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self._lock = threading.Lock()
        self._budget: int | None = None
        self._dark = False
        self._conns: list[socket.socket] = []
        self.sent_upstream = 0
        self._accepting = AcceptLoop(self._connected, "cuttable-proxy-accept")
        self.port, self.url = self._accepting.port, self._accepting.url

    def cut_after(self, nbytes: int) -> None:
        """Go dark once ``nbytes`` more bytes have been sent to the server."""
        with self._lock:
            self._budget = self.sent_upstream + nbytes

    def heal(self) -> None:
        with self._lock:
            self._budget = None
            self._dark = False

    @property
    def dark(self) -> bool:
        return self._dark

    def _go_dark(self) -> None:
        self._dark = True
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                conn.close()
        self._conns.clear()

    def _connected(self, client: socket.socket) -> None:
        if self._dark:
            client.close()
            return
        try:
            server = socket.create_connection(self._upstream)
        except OSError:
            client.close()
            return
        with self._lock:
            self._conns += [client, server]
        threading.Thread(target=self._pipe, args=(client, server, True), daemon=True).start()
        threading.Thread(target=self._pipe, args=(server, client, False), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, upstream: bool) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if upstream:
                    with self._lock:
                        if self._dark:
                            break
                        self.sent_upstream += len(data)
                        if self._budget is not None and self.sent_upstream >= self._budget:
                            self._go_dark()
                            break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self._accepting.close()
        with self._lock:
            self._go_dark()


@contextlib.contextmanager
def cuttable_proxy(upstream_url: str) -> Iterator[CuttableProxy]:
    proxy = CuttableProxy(upstream_url)
    try:
        yield proxy
    finally:
        proxy.close()


def closed_port_url() -> str:
    """An http URL on 127.0.0.1 where nothing listens (bound, then released)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"http://127.0.0.1:{port}"
