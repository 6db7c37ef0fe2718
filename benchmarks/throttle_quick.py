"""Saves and restores through the fault proxy in front of moto's S3, fault-free and with a share of the requests
answered ``503 SlowDown`` (issue 44 item 1: "at most 1.5x the fault-free run"), on s3fs and on obstore.

Run: ``PYTHONPATH=src:tests python benchmarks/throttle_quick.py [--steps 30] [--rate 0.1] [--kib 64] [--delay-ms 10]
[--rounds 3]``. Prints one row per client and rate: requests at the proxy, throttling answers injected and counted
in the log records, the median seconds of ``--rounds`` rounds (the fault-free and the throttled run alternating
which goes first), and the median of each round's ratio to the fault-free run of the same client. moto answers in
well under a millisecond: with ``--delay-ms 0`` the ratio is that of the backoff pauses to almost nothing, an upper
bound; the proxy's ``--delay-ms`` each way (10 by default) makes it a store in the same region (5-30 ms).
"""

from __future__ import annotations

import argparse
import logging
import os
import statistics
import time
import uuid
from typing import Any

import taskpoint
from _fault_proxy import fault_proxy
from _servers import running_s3_server
from taskpoint import TransferStats


class _Counted(logging.Handler):
    """Adds up the throttling answers of the records of saves and loads."""

    def __init__(self) -> None:
        super().__init__()
        self.throttled = 0

    def emit(self, record: logging.LogRecord) -> None:
        stats = getattr(record, "transfer", None)
        if isinstance(stats, TransferStats):
            self.throttled += stats.throttled


def _run(server: Any, client: str, rate: float, steps: int, size: int, delay: float) -> dict[str, Any]:
    counted = _Counted()
    logger = logging.getLogger("taskpoint")
    logger.addHandler(counted)
    logger.setLevel(logging.INFO)
    try:
        with fault_proxy(server.endpoint, seed=44, rate=rate, kinds=("503",), delay=delay) as proxy:
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
            stats = proxy.stats()
    finally:
        logger.removeHandler(counted)
    return {"client": client, "rate": rate, "requests": stats["requests"], "injected": stats["503"],
            "counted": counted.throttled, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--rate", type=float, default=0.1)
    parser.add_argument("--kib", type=int, default=64)
    parser.add_argument("--delay-ms", type=float, default=10.0, help="latency the proxy adds each way")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    delay = args.delay_ms / 1000
    print(f"{args.steps} saves and restores of {args.kib} KiB, {args.delay_ms:g} ms added each way, median of "
          f"{args.rounds} alternating rounds")
    print("| client | 503 rate | requests | 503 injected | counted in records | seconds | x fault-free |")
    print("|---|---|---|---|---|---|---|")
    with running_s3_server() as server:
        for client in ("s3fs", "obstore"):
            rounds: list[tuple[dict[str, Any], dict[str, Any]]] = []
            for index in range(args.rounds):
                rates = (0.0, args.rate) if index % 2 == 0 else (args.rate, 0.0)
                runs = {rate: _run(server, client, rate, args.steps, args.kib << 10, delay) for rate in rates}
                rounds.append((runs[0.0], runs[args.rate]))
            for which in (0, 1):
                rows = [pair[which] for pair in rounds]
                row = rows[len(rows) // 2]
                ratio = statistics.median(pair[which]["seconds"] / pair[0]["seconds"] for pair in rounds)
                seconds = statistics.median(r["seconds"] for r in rows)
                print(f"| {row['client']} | {row['rate']:.0%} | {row['requests']} | {row['injected']} | "
                      f"{row['counted']} | {seconds:.2f} | {ratio:.2f} |")


if __name__ == "__main__":
    main()
