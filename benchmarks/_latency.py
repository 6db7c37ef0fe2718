"""The latency section of ``make bench`` (issue 44 item 3): small operations on a store that answers in 20 ms.

moto's S3 on 127.0.0.1 answers in well under a millisecond; a store in the same region answers in 5-30 ms, and
then the requests a small operation waits on are its time. Here every request goes through the project's fault
proxy (``tests/_fault_proxy.py``) with :data:`DELAY` added each way (20 ms a round trip), and each operation is
measured against its floor: the fewest requests that could do it, made directly with boto3 through the same
proxy (a save: one PUT; a restore of the newest step: the listing and one GET). Per run the two alternate in
order; the table reports the median time of :data:`RUNS` runs (``--runs`` when larger), and the requests
counted at the proxy during the last run.

The operations, through s3fs and through obstore (``s3_client="obstore"``):

- ``CheckpointManager.save(100 bytes, step)``, a manager that has saved before (its first save lists the
  directory once for retention);
- ``restore()`` of the newest step by a new manager, as a retried task does;
- ``Checkpoint.save_sync(1 KiB)`` at a new name, and again at the same name.
"""

from __future__ import annotations

import statistics
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from ._s3server import REPO_ROOT, load_test_servers

METHOD = "latency"
#: The latency the proxy adds each way (seconds): 20 ms a round trip, a store in the same region.
DELAY = 0.010
#: Runs of each operation at least (it is small: the median of a few more costs little).
RUNS = 5
CLIENTS = ("s3fs", "obstore")
#: (key, what the operation is, its floor).
OPERATIONS = (
    ("save", "CheckpointManager.save(100 B, step)", "1 PUT"),
    ("restore", "restore() of the newest step, new manager", "LIST + GET"),
    ("first", "Checkpoint.save_sync(1 KiB), new name", "1 PUT"),
    ("again", "Checkpoint.save_sync(1 KiB), same name", "1 PUT"),
)


class _Case:
    """One client's operations and their floors, each ready to run once more (what they need made untimed)."""

    def __init__(self, taskpoint: Any, boto: Any, url: str, bucket: str, options: dict[str, Any]) -> None:
        self.tp, self.boto, self.url, self.bucket, self.options = taskpoint, boto, url, bucket, options
        self.manager = taskpoint.CheckpointManager(f"{url}/steps", storage_options=options)
        self.manager.save(b"s" * 100, 0)  # the first save's listing is not what this section measures
        self.step = 0
        self.again = taskpoint.Checkpoint(f"{url}/again", storage_options=options)
        self.again.save_sync(b"a" * 1024)

    def prepare(self, key: str) -> tuple[Callable[[], object], Callable[[], object]]:
        """(taskpoint's operation, its floor), both ready to run; the setup they need is done here."""
        tp, boto, bucket = self.tp, self.boto, self.bucket
        prefix = self.url.split("/", 3)[3]
        if key == "save":
            self.step += 1
            step, name = self.step, f"{prefix}/floor/payload-{uuid.uuid4().hex}"
            return (lambda: self.manager.save(b"x" * 100, step),
                    lambda: boto.put_object(Bucket=bucket, Key=name, Body=b"x" * 100))
        if key == "restore":
            reader = tp.CheckpointManager(f"{self.url}/steps", storage_options=self.options)
            steps = f"{prefix}/steps/"

            def floor() -> bytes:
                listed = boto.list_objects_v2(Bucket=bucket, Prefix=steps)["Contents"]
                newest = max(listed, key=lambda item: item["LastModified"])["Key"]
                return boto.get_object(Bucket=bucket, Key=newest)["Body"].read()  # type: ignore[no-any-return]
            return lambda: reader.restore().read_bytes(), floor
        if key == "first":
            name = uuid.uuid4().hex
            checkpoint = tp.Checkpoint(f"{self.url}/first-{name}", storage_options=self.options)
            return (lambda: checkpoint.save_sync(b"f" * 1024),
                    lambda: boto.put_object(Bucket=bucket, Key=f"{prefix}/floor-{name}", Body=b"f" * 1024))
        return (lambda: self.again.save_sync(b"g" * 1024),
                lambda: boto.put_object(Bucket=bucket, Key=f"{prefix}/floor-again", Body=b"g" * 1024))


def _timed(proxy: Any, call: Callable[[], object]) -> tuple[float, int]:
    since = len(proxy.log)
    began = time.perf_counter()
    call()
    return time.perf_counter() - began, len(proxy.log) - since


def run(runs: int) -> list[dict[str, Any]]:
    """Every operation of every client, :data:`RUNS` (or ``runs``) times, alternating with its floor."""
    servers = load_test_servers()
    servers.apply_default_environment()
    sys.path.insert(0, str(REPO_ROOT / "tests"))  # the fault proxy and its helpers are the test suite's
    import boto3

    import taskpoint
    from _fault_proxy import fault_proxy

    rows: list[dict[str, Any]] = []
    with servers.running_s3_server() as server, fault_proxy(server.endpoint, delay=DELAY) as proxy:
        options = {**server.storage_options, "endpoint_url": proxy.url}
        boto = boto3.client("s3", endpoint_url=proxy.url, aws_access_key_id=options["key"],
                            aws_secret_access_key=options["secret"], region_name="us-west-2")
        for client in CLIENTS:
            case = _Case(taskpoint, boto, f"s3://{server.bucket}/latency-{uuid.uuid4().hex}", server.bucket,
                         {**options, "s3_client": client})
            for key, what, floor_what in OPERATIONS:
                times: dict[str, list[float]] = {"taskpoint": [], "floor": []}
                counts: dict[str, int] = {}
                for index in range(max(runs, RUNS)):
                    ours, floor = case.prepare(key)
                    order = [("taskpoint", ours), ("floor", floor)]
                    for name, call in order if index % 2 == 0 else reversed(order):
                        seconds, counts[name] = _timed(proxy, call)
                        times[name].append(seconds)
                ours_s, floor_s = statistics.median(times["taskpoint"]), statistics.median(times["floor"])
                rows.append({"client": client, "op": what, "requests": counts["taskpoint"], "floor": floor_what,
                             "floor_requests": counts["floor"], "ms": ours_s * 1e3, "floor_ms": floor_s * 1e3,
                             "ratio": ours_s / floor_s})
    return rows


def notes() -> str:
    return (f"few round trips (issue 44): moto's S3 behind the fault proxy adding {DELAY * 1e3:.0f} ms each way "
            "(benchmarks/_latency.py); floor = the fewest requests that do the operation, made with boto3 through "
            "the same proxy; medians, the two alternating in order")


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| client | operation | requests | ms | floor | floor requests | floor ms | x floor |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['client']} | {r['op']} | {r['requests']} | {r['ms']:.1f} | {r['floor']} | {r['floor_requests']} "
              f"| {r['floor_ms']:.1f} | {r['ratio']:.2f} |" for r in rows]
    return "\n".join(lines)
