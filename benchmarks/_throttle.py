"""The throttling section of ``make bench`` (issue 44 item 1): saves and restores through the fault proxy in front
of moto's S3, fault-free and with a share of the requests answered ``503 SlowDown`` ("at most 1.5x the fault-free
run"), on s3fs and on obstore.

Each run is :data:`STEPS` saves of :data:`KIB` KiB and the restore of each, through the project's fault proxy
(``tests/_fault_proxy.py``) adding :data:`DELAY` each way (a store in the same region, 5-30 ms). A round is a
fault-free run and a throttled one, alternating which goes first; a row reports the median seconds of the rounds
and the median of each round's ratio to its fault-free run. The ratio is blurred by the machine's load (the
fault-free run is slower on a busy machine while the pauses are not); the retry column is not: the mean time,
at the proxy, from a throttled request's arrival to its next one, which is the 503's own round trip, the pause
the client chose, and its reconnection (the proxy closes the connection of its own answers).
"""

from __future__ import annotations

import logging
import os
import statistics
import sys
import time
import uuid
from typing import Any

from . import _report
from ._s3server import REPO_ROOT, load_test_servers

METHOD = "throttle"
#: The latency the proxy adds each way (seconds).
DELAY = 0.010
#: Saves and restores of one run, and the size of each payload (KiB).
STEPS, KIB = 30, 64
#: The share of requests answered 503 SlowDown in the throttled runs, and the target's bound on their time.
RATE, TARGET = 0.1, 1.5
#: Rounds at least (each a fault-free and a throttled run, alternating in order).
ROUNDS = 3
CLIENTS = ("s3fs", "obstore")


def _counted() -> Any:
    """A logging handler that adds up the throttling answers in the records of saves and loads."""
    from taskpoint import TransferStats

    class Counted(logging.Handler):
        throttled = 0

        def emit(self, record: logging.LogRecord) -> None:
            stats = getattr(record, "transfer", None)
            if isinstance(stats, TransferStats):
                self.throttled += stats.throttled
    return Counted()


def _run(server: Any, client: str, rate: float, steps: int, size: int, delay: float) -> dict[str, Any]:
    """One run: ``steps`` saves and restores through the proxy, ``rate`` of the requests answered 503."""
    import taskpoint
    from _fault_proxy import fault_proxy

    counted = _counted()
    logger = logging.getLogger("taskpoint")
    logger.addHandler(counted)
    level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with fault_proxy(server.endpoint, seed=44, rate=rate, kinds=("503",), delay=delay,
                         log_size=100 * steps) as proxy:
            options = {**server.storage_options, "endpoint_url": proxy.url, "s3_client": client}
            manager = taskpoint.CheckpointManager(f"s3://{server.bucket}/bench-{uuid.uuid4().hex}",
                                                  storage_options=options, keep=2)
            data = os.urandom(size)
            started = time.perf_counter()
            for step in range(steps):
                manager.save(data, step)
                if manager.restore().read_bytes() != data:
                    raise AssertionError(f"step {step} restored other bytes")
            seconds = time.perf_counter() - started
            stats, retried = proxy.stats(), [after for _, _, after in proxy.retried("503")]
    finally:
        logger.removeHandler(counted)
        logger.setLevel(level)
    return {"client": client, "rate": rate, "requests": stats["requests"], "injected": stats["503"],
            "counted": counted.throttled, "seconds": seconds,
            "retry_ms": statistics.mean(retried) * 1e3 if retried else None}


def run(rounds: int = ROUNDS, *, steps: int = STEPS, rate: float = RATE, kib: int = KIB,
        delay: float = DELAY) -> list[dict[str, Any]]:
    """A fault-free and a throttled row per client, each of ``rounds`` rounds (alternating in order)."""
    servers = load_test_servers()
    servers.apply_default_environment()
    sys.path.insert(0, str(REPO_ROOT / "tests"))  # the fault proxy and its helpers are the test suite's
    rows: list[dict[str, Any]] = []
    with servers.running_s3_server() as server:
        for client in CLIENTS:
            pairs: list[dict[float, dict[str, Any]]] = []
            for index in range(rounds):
                order = (0.0, rate) if index % 2 == 0 else (rate, 0.0)
                pairs.append({each: _run(server, client, each, steps, kib << 10, delay) for each in order})
            for each in (0.0, rate):
                runs_of = [pair[each] for pair in pairs]
                gaps = [r["retry_ms"] for r in runs_of if r["retry_ms"] is not None]
                rows.append({**runs_of[len(runs_of) // 2], "seconds": statistics.median(r["seconds"] for r in runs_of),
                             "ratio": statistics.median(pair[each]["seconds"] / pair[0.0]["seconds"] for pair in pairs),
                             "retry_ms": statistics.median(gaps) if gaps else None})
    return rows


def notes(delay: float = DELAY, steps: int = STEPS, kib: int = KIB) -> str:
    return (f"throttling (issue 44 item 1): {steps} saves and restores of {kib} KiB through the fault proxy on moto, "
            f"{delay * 1e3:g} ms added each way, fault-free and with a share of the requests answered 503 SlowDown; "
            "medians of alternating rounds; retry = ms from a throttled request to the same request sent again, at "
            "the proxy (benchmarks/_throttle.py)")


#: The table's columns: heading, and the cell of a row.
_COLUMNS: tuple[tuple[str, Any], ...] = (
    ("client", lambda r: r["client"]), ("503 rate", lambda r: f"{r['rate']:.0%}"),
    ("requests", lambda r: str(r["requests"])), ("503 injected", lambda r: str(r["injected"])),
    ("counted in records", lambda r: str(r["counted"])), ("seconds", lambda r: f"{r['seconds']:.2f}"),
    ("x fault-free", lambda r: f"{r['ratio']:.2f}"),
    ("retry ms", lambda r: "-" if r["retry_ms"] is None else f"{r['retry_ms']:.0f}"),
)


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as text columns, client and rate on the left."""
    return _report.aligned([[name for name, _ in _COLUMNS]] + [[cell(r) for _, cell in _COLUMNS] for r in rows], 2)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 44's target for item 1: a tenth of the requests throttled costs at most 1.5x the fault-free run."""
    return [{"target": f"issue 44: {r['rate']:.0%} of requests answered 503 SlowDown: <= {TARGET:g}x fault-free",
             "case": f"s3/{r['client']}/save+restore", "measured": f"{r['ratio']:.2f}x",
             "result": "PASS" if r["ratio"] <= TARGET else "FAIL", "note": f"{r['injected']} retried"}
            for r in rows if r["rate"] > 0]
