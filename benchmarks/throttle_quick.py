"""Saves and restores through the fault proxy in front of moto's S3, fault-free and with a share of the requests
answered ``503 SlowDown`` (issue 44 item 1: "at most 1.5x the fault-free run"), on s3fs and on obstore.

Run: ``PYTHONPATH=src:tests python benchmarks/throttle_quick.py [--steps 30] [--rate 0.1] [--kib 64]``. Prints one
row per client and rate: requests at the proxy, throttling answers injected and counted in the log records,
seconds, and the ratio to the fault-free run of the same client. moto answers in well under a millisecond, so
the ratio is that of the backoff pauses to almost nothing: an upper bound on what a store that answers in
5-30 ms would show.
"""

from __future__ import annotations

import argparse
import logging
import os
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


def _run(server: Any, client: str, rate: float, steps: int, size: int) -> dict[str, Any]:
    counted = _Counted()
    logger = logging.getLogger("taskpoint")
    logger.addHandler(counted)
    logger.setLevel(logging.INFO)
    try:
        with fault_proxy(server.endpoint, seed=44, rate=rate, kinds=("503",)) as proxy:
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
    args = parser.parse_args()
    print("| client | 503 rate | requests | 503 injected | counted in records | seconds | x fault-free |")
    print("|---|---|---|---|---|---|---|")
    with running_s3_server() as server:
        for client in ("s3fs", "obstore"):
            base = _run(server, client, 0.0, args.steps, args.kib << 10)
            for row in (base, _run(server, client, args.rate, args.steps, args.kib << 10)):
                print(f"| {row['client']} | {row['rate']:.0%} | {row['requests']} | {row['injected']} | "
                      f"{row['counted']} | {row['seconds']:.2f} | {row['seconds'] / base['seconds']:.2f} |")


if __name__ == "__main__":
    main()
