"""An HTTP-aware TCP proxy on 127.0.0.1 that injects faults into real traffic to a real storage server.

Where :mod:`_faults` cuts the whole network at once, this proxy decides per HTTP request, with a seeded
random generator, whether to let it through or to fail it in one of these ways:

``reset``
    the request body is forwarded halfway (or, for a request without a body, not at all), then both
    connections are reset (TCP RST): a connection dying in the middle of an upload.
``stall``
    the request is read but never answered; the connection is held open for :attr:`stall_seconds`
    (longer than the client's timeout), then closed: a server or load balancer that hangs.
``500`` / ``503`` / ``429``
    the proxy answers itself with that status (an S3-style XML body, ``SlowDown`` for 503; an Azure-style
    XML body, ``ServerBusy``; or a GCS-style JSON body, as the client expects), with ``Retry-After`` when
    :attr:`retry_after` is set, and closes the connection: an overloaded, failing or throttling server.
    ``429`` (Too Many Requests) is not among the kinds drawn by default.
``cut``
    the request goes to the server, but its response is cut short: the head and half the body reach
    the client, then the connection is reset (or, for a response without a body, half of the head).

``hold`` (a function of a request's method and path) stalls the requests it picks, whatever the rate: with
``stall_seconds=math.inf`` they are never answered (until the client gives up or the proxy closes). ``choose``
(a function of the same) names the fault of each request it picks, whatever the rate: any kind above, or
``403`` (S3's ``AccessDenied``: a credential that may read but not write, say).

``delay`` (seconds) is a latency added each way: each request waits that long before it goes to the server,
and each response before it goes back to the client, so that a request that fits in one send costs
``2 * delay`` more, as on a store in the same region (5-30 ms). The proxy's own ``100 Continue`` is not delayed.

The server is real and so is every byte that is let through; only the failures are made here. With
``throttle`` (bytes per second, per connection) the bodies that pass go no faster than that: a slow network; ``slow``
(a function of a request's method and path giving bytes per second, or None) slows the request bodies it picks:
one slow part of an upload. ``strip`` (header names, lower case) are removed from every request that passes: a
store that ignores ``If-None-Match``, say. ``before`` (a function of a request's method and path) is called before a
request that passes goes to the server: a test may wait in it to order requests. Requests
and responses are parsed just enough to find where each one ends (``Content-Length``, chunked transfer
coding, ``HEAD``, 1xx/204/304), so keep-alive connections carry many requests and each is judged on its
own. ``Expect: 100-continue`` is answered by the proxy (and not forwarded), so clients that wait for it
send their body to the proxy, which may then fail it.

Usage::

    with fault_proxy(server.endpoint, seed=7, rate=0.1) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        ...
        proxy.rate = 1.0        # every request fails from now on
        proxy.stats()           # {"requests": ..., "passed": ..., "served": bytes, "reset": ..., ...}
        proxy.log               # [method, path, fault, status, arrival (time.monotonic())] per request
        proxy.requests(since)   # (method, path, status) of the requests logged after the first ``since``
        proxy.retried("503")    # (method, path, seconds until it was sent again) of each request failed with 503
"""

from __future__ import annotations

import collections
import contextlib
import json
import random
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any
from urllib.parse import urlsplit

from helpers import AcceptLoop

__all__ = ["FAULT_KINDS", "THROTTLE_KINDS", "FaultProxy", "fault_proxy"]

#: The kinds of fault the proxy draws from by default.
FAULT_KINDS: tuple[str, ...] = ("reset", "stall", "500", "503", "cut")
#: The answers of a store that pushes back: 503 (S3's SlowDown, Azure's ServerBusy) and 429.
THROTTLE_KINDS: tuple[str, ...] = ("503", "429")
_KNOWN_KINDS = (*FAULT_KINDS, "429", "403")

_MAX_HEAD = 256 << 10
_CHUNK = 64 << 10


class _Closed(Exception):
    """A peer closed its connection (at a clean boundary or not); this connection pair is done."""


class _Reader:
    """Buffered reads of lines and exact byte counts from a socket."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buf = bytearray()

    def _fill(self) -> None:
        data = self.sock.recv(_CHUNK)
        if not data:
            raise _Closed
        self.buf += data

    def head(self) -> bytes:
        """Everything up to and including the blank line that ends an HTTP head."""
        return self._through(b"\r\n\r\n")

    def line(self) -> bytes:
        return self._through(b"\r\n")

    def _through(self, end_mark: bytes) -> bytes:
        """Everything up to and including ``end_mark`` (at most an HTTP head's worth)."""
        while True:
            end = self.buf.find(end_mark)
            if end >= 0:
                out = bytes(self.buf[: end + len(end_mark)])
                del self.buf[: end + len(end_mark)]
                return out
            if len(self.buf) > _MAX_HEAD:
                raise _Closed
            self._fill()

    def some(self, limit: int) -> bytes:
        """Up to ``limit`` bytes (at least one)."""
        if not self.buf:
            self._fill()
        out = bytes(self.buf[:limit])
        del self.buf[:limit]
        return out

    def until_eof(self) -> Iterator[bytes]:
        if self.buf:
            yield bytes(self.buf)
            self.buf.clear()
        while True:
            data = self.sock.recv(_CHUNK)
            if not data:
                return
            yield data


def _parse_head(head: bytes) -> tuple[str, dict[str, str]]:
    lines = head.decode("latin-1").split("\r\n")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if ":" in line:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
    return lines[0], headers


def _without_header(head: bytes, name: str) -> bytes:
    lines = head.split(b"\r\n")
    kept = [line for line in lines if not line.lower().startswith(name.encode() + b":")]
    return b"\r\n".join(kept)


def _body(reader: _Reader, headers: dict[str, str], *, to_eof: bool) -> Iterator[bytes]:
    """The raw bytes of a message body as they come (chunked framing included, so it can be relayed)."""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        while True:
            size_line = reader.line()
            yield size_line
            size = int(size_line.split(b";")[0].strip() or b"0", 16)
            if size == 0:
                while True:  # trailers, then the blank line
                    trailer = reader.line()
                    yield trailer
                    if trailer == b"\r\n":
                        return
            remaining = size + 2  # the data and its CRLF
            while remaining:
                data = reader.some(remaining)
                remaining -= len(data)
                yield data
    elif "content-length" in headers:
        remaining = int(headers["content-length"])
        while remaining > 0:
            data = reader.some(remaining)
            remaining -= len(data)
            yield data
    elif to_eof:
        yield from reader.until_eof()


def _reset(sock: socket.socket) -> None:
    """Close with a TCP RST (SO_LINGER 0), as a dying peer or middlebox does."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with contextlib.suppress(OSError):
        sock.close()


def _error_response(status: int, request_headers: dict[str, str], retry_after: float | None = None, *,
                    head: bool = False) -> bytes:
    """The proxy's own error answer; to a HEAD request, without its body (as servers answer it)."""
    reason = {500: "Internal Server Error", 503: "Service Unavailable", 429: "Too Many Requests",
              403: "Forbidden"}[status]
    s3_style = ("authorization" in request_headers and "aws4" in request_headers["authorization"].lower()) or any(
        name.startswith("x-amz-") for name in request_headers)
    azure_style = any(name.startswith("x-ms-") for name in request_headers)
    if s3_style or azure_style:
        codes = ({500: "InternalError", 503: "SlowDown", 429: "SlowDown", 403: "AccessDenied"} if s3_style else
                 {500: "InternalError", 503: "ServerBusy", 429: "TooManyRequests",
                  403: "AuthorizationPermissionMismatch"})
        body = (f'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{codes[status]}</Code>'
                f"<Message>injected by the fault proxy</Message><RequestId>fault</RequestId></Error>").encode()
        kind = "application/xml"
    else:
        why = "forbidden" if status == 403 else "backendError"
        body = json.dumps({"error": {"code": status, "message": "injected by the fault proxy",
                                     "errors": [{"reason": why, "message": "injected"}]}}).encode()
        kind = "application/json"
    wait = "" if retry_after is None else f"Retry-After: {retry_after:g}\r\n"
    return (f"HTTP/1.1 {status} {reason}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n{wait}"
            f"Connection: close\r\n\r\n").encode() + (b"" if head else body)


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to the server at ``upstream_url``, failing requests at :attr:`rate`.

    ``rate`` (0 to 1) and ``kinds`` may be changed at any time; each request draws from one random
    generator seeded with ``seed`` (under a lock), so a run's sequence of decisions is reproducible for a
    given order of requests. :meth:`stats` counts requests, those let through, and each fault injected.
    """

    def __init__(self, upstream_url: str, *, seed: int = 0, rate: float = 0.0,
                 kinds: Sequence[str] = FAULT_KINDS, stall_seconds: float = 10.0,
                 throttle: float | None = None, retry_after: float | None = None, delay: float = 0.0,
                 log_size: int = 400) -> None:
        unknown = set(kinds) - set(_KNOWN_KINDS)
        if unknown:
            raise ValueError(f"unknown fault kinds {sorted(unknown)}; choose from {_KNOWN_KINDS}")
        parts = urlsplit(upstream_url)
        self._upstream = (parts.hostname or "127.0.0.1", parts.port or 80)
        self.rate = rate
        self.kinds = tuple(kinds)
        self.stall_seconds = stall_seconds
        self.throttle = throttle
        #: Picks requests (by method and path, without the query) to stall, whatever the rate; None: none.
        self.hold: Callable[[str, str], bool] | None = None
        #: Names the fault of a request (by method and path) or None to let the rate decide; None: the rate alone.
        self.choose: Callable[[str, str], str | None] | None = None
        #: The rate (bytes per second) of the body of a request it picks (by method and path), None: :attr:`throttle`.
        self.slow: Callable[[str, str], float | None] | None = None
        #: Header names (lower case) removed from every request that passes, before it goes to the server.
        self.strip: tuple[str, ...] = ()
        #: Called with the method and path of each request that passes before it goes to the server; None: none.
        self.before: Callable[[str, str], None] | None = None
        #: Seconds each request waits before it goes to the server, and each response before it goes back.
        self.delay = delay
        #: Seconds sent as ``Retry-After`` with the proxy's own 429 and 503 answers (None: no header).
        self.retry_after = retry_after
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        #: ``served``: the bytes of the response bodies passed whole to the clients (what a store bills as read).
        self._counts: dict[str, int] = dict.fromkeys(("requests", "passed", "served", *_KNOWN_KINDS), 0)
        #: The last ``log_size`` requests: (method, path without query, fault or None, status or None, arrival on
        #: the monotonic clock), for diagnosis and for tests and benchmarks that check when a retry came.
        self.log: collections.deque[list[Any]] = collections.deque(maxlen=log_size)
        self._open: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._accepting = AcceptLoop(self._connected, "fault-proxy-accept")
        self.port: int = self._accepting.port
        self.url = self._accepting.url

    # -- control ---------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def requests(self, since: int = 0) -> list[tuple[str, str, int | None]]:
        """(method, path without the query, status: None when the proxy failed it otherwise) of each request
        logged, from the ``since``-th on (``len(proxy.log)`` taken before an operation: its requests)."""
        return [(method, path, status) for method, path, _, status, _ in list(self.log)[since:]]

    def retried(self, fault: str) -> list[tuple[str, str, float]]:
        """(method, path, seconds from its arrival to the next request of the same method and path) of each logged
        request the proxy failed with ``fault`` (a kind, such as ``"503"``) and that was sent again."""
        log = list(self.log)
        found = []
        for index, (method, path, kind, _status, arrived) in enumerate(log):
            if kind != fault:
                continue
            again = next((entry for entry in log[index + 1:] if entry[:2] == [method, path]), None)
            if again is not None:
                found.append((method, path, again[4] - arrived))
        return found

    def _decide(self, method: str, path: str) -> str | None:
        held = self.hold is not None and self.hold(method, path)
        chosen = self.choose(method, path) if self.choose is not None else None
        with self._lock:
            self._counts["requests"] += 1
            fault = "stall" if held else chosen if chosen is not None else \
                self._rng.choice(self.kinds) if self.kinds and self._rng.random() < self.rate else None
            self._counts[fault or "passed"] += 1
            return fault

    def close(self) -> None:
        self._accepting.close()
        with self._lock:
            conns = list(self._open)
            self._open.clear()
        for conn in conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                conn.close()
        for thread in list(self._threads):
            thread.join(timeout=5)

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- serving ---------------------------------------------------------------------------------------------

    def _connected(self, client: socket.socket) -> None:
        with self._lock:
            self._open.add(client)
            self._threads = [t for t in self._threads if t.is_alive()]
        thread = threading.Thread(target=self._serve, args=(client,), name="fault-proxy-conn", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _forget(self, *socks: socket.socket) -> None:
        with self._lock:
            for sock in socks:
                self._open.discard(sock)

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        try:
            reader = _Reader(client)
            upstream_reader: _Reader | None = None
            while not self._accepting.stopped:
                head = reader.head()
                request_line, headers = _parse_head(head)
                method = request_line.split(" ", 1)[0].upper()
                if headers.get("expect", "").lower() == "100-continue":
                    head = _without_header(head, "expect")
                    client.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
                path = request_line.split(" ")[1].split("?")[0] if " " in request_line else "?"
                fault = self._decide(method, path)
                entry = [method, path, fault, None, time.monotonic()]
                self.log.append(entry)
                has_body = "content-length" in headers or "transfer-encoding" in headers
                if fault == "reset":
                    if upstream is None:
                        upstream = self._connect()
                    upstream.sendall(head)
                    length = int(headers.get("content-length", "0") or 0)
                    sent = 0
                    if has_body and length:
                        for data in _body(reader, headers, to_eof=False):
                            if sent + len(data) >= length // 2:
                                upstream.sendall(data[: max(0, length // 2 - sent)])
                                break
                            upstream.sendall(data)
                            sent += len(data)
                    _reset(client)
                    _reset(upstream)
                    return
                if fault in ("stall", "500", "503", "429", "403"):
                    for _ in _body(reader, headers, to_eof=False):
                        pass  # the whole request is read (the client is done sending) ...
                    if fault == "stall":  # ... and never answered
                        self._hold(client)
                        return
                    entry[3] = int(fault)
                    self._wait(2 * self.delay)  # the way there and back
                    client.sendall(_error_response(int(fault), headers,
                                                   self.retry_after if fault in THROTTLE_KINDS else None,
                                                   head=method == "HEAD"))
                    return
                if upstream is None:
                    upstream = self._connect()
                    upstream_reader = _Reader(upstream)
                assert upstream_reader is not None
                self._wait(self.delay)
                for name in self.strip:
                    head = _without_header(head, name)
                if self.before is not None:
                    self.before(method, path)
                upstream.sendall(head)
                rate = self.slow(method, path) if self.slow is not None else None
                for data in _body(reader, headers, to_eof=False):
                    self._pass(upstream, data, rate)
                if not self._relay_response(client, upstream_reader, method, cut=fault == "cut", entry=entry):
                    return
                if headers.get("connection", "").lower() == "close":
                    return
        except (_Closed, OSError, ValueError):
            pass
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    with contextlib.suppress(OSError):
                        sock.close()
                    self._forget(sock)

    def _pass(self, sock: socket.socket, data: bytes, rate: float | None = None) -> None:
        """Send body bytes that pass, at most ``rate`` (else :attr:`throttle`) bytes per second when set."""
        rate = rate or self.throttle
        if not rate:
            sock.sendall(data)
            return
        piece = max(1, int(rate / 20))  # twenty sends a second
        for start in range(0, len(data), piece):
            sock.sendall(data[start:start + piece])
            time.sleep(min(piece, len(data) - start) / rate)

    @staticmethod
    def _wait(seconds: float) -> None:
        """The added latency (a few milliseconds: a plain pause)."""
        if seconds > 0:
            time.sleep(seconds)

    def _connect(self) -> socket.socket:
        upstream = socket.create_connection(self._upstream, timeout=60)
        with self._lock:
            self._open.add(upstream)
        return upstream

    def _hold(self, client: socket.socket) -> None:
        """Keep the connection open and silent until the stall is over or the client gives up. The stall is
        :attr:`stall_seconds` as it is at each moment: lowering it (to 0) releases the requests held now."""
        began = time.monotonic()
        while not self._accepting.stopped:
            left = began + self.stall_seconds - time.monotonic()
            if left <= 0:
                return
            readable, _, _ = select.select([client], [], [], min(left, 0.2))
            if readable:
                try:
                    if not client.recv(_CHUNK):
                        return  # the client timed out and closed
                except OSError:
                    return

    def _relay_response(self, client: socket.socket, upstream: _Reader, method: str, *, cut: bool,
                        entry: list | None = None) -> bool:
        """Pass one response (after any 1xx) to the client; False when the connection must end."""
        while True:
            head = upstream.head()
            status_line, headers = _parse_head(head)
            status = int(status_line.split(" ", 2)[1])
            if entry is not None:
                entry[3] = status
            if 100 <= status < 200:
                client.sendall(head)
                continue
            break
        self._wait(self.delay)
        no_body = method == "HEAD" or status in (204, 304)
        framed = "content-length" in headers or "transfer-encoding" in headers
        if cut:
            length = int(headers.get("content-length", "0") or 0) if not no_body else 0
            if no_body or (framed and length == 0 and "transfer-encoding" not in headers):
                client.sendall(head[: len(head) // 2])
            else:
                client.sendall(head)
                budget = max(1, length // 2) if length else 1
                for data in _body(upstream, headers, to_eof=not framed):
                    client.sendall(data[:budget])
                    budget -= len(data)
                    if budget <= 0:
                        break
            _reset(client)
            return False
        client.sendall(head)
        if no_body:
            return headers.get("connection", "").lower() != "close"
        for data in _body(upstream, headers, to_eof=not framed):
            self._pass(client, data)
            with self._lock:
                self._counts["served"] += len(data)
        return framed and headers.get("connection", "").lower() != "close"


@contextlib.contextmanager
def fault_proxy(upstream_url: str, **kwargs: object) -> Iterator[FaultProxy]:
    """A :class:`FaultProxy` in front of ``upstream_url`` for the duration of the block."""
    proxy = FaultProxy(upstream_url, **kwargs)  # type: ignore[arg-type]
    try:
        yield proxy
    finally:
        proxy.close()
