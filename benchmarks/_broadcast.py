"""The broadcast section of ``make bench`` (issue 44, item 4): 4 ranks restoring one step, with
``restore(broadcast=True)`` against each rank reading it for itself.

One step of ``size`` x 256 MiB of random bytes is saved to moto; then one job of 4 gloo ranks, started by the real
``torchrun`` (tests/_broadcast_worker.py), restores it ``runs`` times each way, the two ways alternated (broadcast
first in even runs, each-rank-reads first in odd ones). Each way's ranks reach the store through a proxy of their
own (tests/_fault_proxy.py, passing everything), which counts the response bytes it served: what the store was
asked to send. Reported per way: the slowest rank's restore (median over runs), the bytes served per restore in
copies of the step, and whether every rank's bytes matched what was saved.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from ._runner import REPO_ROOT, Options, open_store

METHOD = "broadcast"
RANKS = 4
#: The step's bytes at ``--size 1``.
STEP_BYTES = 256 << 20
_WAYS = (("broadcast", True), ("each", False))


def _proxies() -> Any:
    """tests/_fault_proxy.py's ``fault_proxy`` (``tests`` is not a package: its modules import each other by name)."""
    tests = str(REPO_ROOT / "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    from _fault_proxy import fault_proxy

    return fault_proxy


def run(size: float, opts: Options, work: Path) -> list[dict[str, Any]]:
    import taskpoint

    work.mkdir(parents=True, exist_ok=True)
    nbytes = int(size * STEP_BYTES)
    data = os.urandom(nbytes)
    expected = hashlib.sha256(data).hexdigest()
    fault_proxy = _proxies()
    with open_store("s3", work, opts.log, opts.moto_fast_ranges) as store:
        directory = f"{store.root}/broadcast"
        with taskpoint.CheckpointManager(directory, storage_options=store.storage_options) as manager:
            manager.save(data, 1)
        del data
        with fault_proxy(store.storage_options["endpoint_url"]) as once, \
                fault_proxy(store.storage_options["endpoint_url"]) as each:
            proxy = {"broadcast": once, "each": each}
            phases = []
            for i in range(opts.runs):
                for way, broadcast in (_WAYS if i % 2 == 0 else reversed(_WAYS)):
                    phases.append({"name": f"{way}-{i}", "directory": directory, "call": "restore",
                                   "broadcast": broadcast,
                                   "options": {**store.storage_options, "endpoint_url": proxy[way].url}})
            outcomes = _torchrun(phases)
            served = {way: proxy[way].stats()["served"] / opts.runs for way, _ in _WAYS}
        store.clear(directory)
    shutil.rmtree(work, ignore_errors=True)
    rows = []
    for way, _ in _WAYS:
        runs = [outcomes[f"{way}-{i}"] for i in range(opts.runs)]
        rows.append({"store": "s3", "op": way, "step_bytes": nbytes, "runs": opts.runs,
                     "seconds": statistics.median(max(r["seconds"] for r in ranks.values()) for ranks in runs),
                     "served": served[way],
                     "verified": all(r.get("sha256") == expected for ranks in runs for r in ranks.values())})
    rows[0]["ratio"] = rows[0]["seconds"] / rows[1]["seconds"]
    return rows


def _torchrun(phases: list[dict[str, Any]]) -> dict[str, dict[int, dict[str, Any]]]:
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "src"), str(REPO_ROOT / "tests"),
                                          os.environ.get("PYTHONPATH", "")])}
    torchrun = Path(sys.executable).with_name("torchrun")
    done = subprocess.run([str(torchrun), "--standalone", f"--nproc-per-node={RANKS}",
                           str(REPO_ROOT / "tests" / "_broadcast_worker.py"), json.dumps(phases)],
                          env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode:
        raise RuntimeError(f"the broadcast benchmark's ranks failed ({done.returncode}): {done.stderr[-2000:]}")
    outcomes: dict[str, dict[int, dict[str, Any]]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            outcomes.setdefault(event["name"], {})[event["rank"]] = event
    return outcomes


def table(rows: list[dict[str, Any]]) -> str:
    labels = {"broadcast": "restore(broadcast=True)", "each": "restore(), each rank reads"}
    lines = ["| 4 gloo ranks, one step | slowest rank's restore | read from the store per restore | every rank "
             "verified | time ratio |", "|---|---|---|---|---|"]
    for r in rows:
        ratio = f"{r['ratio']:.2f}x each-rank-reads" if "ratio" in r else ""
        lines.append(f"| {labels[r['op']]}, {r['step_bytes'] / 2**20:.0f} MiB ({r['runs']} runs) | "
                     f"{r['seconds']:.2f} s | {r['served'] / 2**20:.1f} MiB ({r['served'] / r['step_bytes']:.2f} "
                     f"copies) | {'yes' if r['verified'] else 'NO'} | {ratio} |")
    return "\n".join(lines)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 44's target for item 4: the bytes 4 ranks read from the store with broadcast, in copies of the step."""
    row = next((r for r in rows if r["op"] == "broadcast"), None)
    copies = None if row is None else row["served"] / row["step_bytes"]
    return [{"target": "issue 44: 4 ranks restoring one step with broadcast read <= 1.2 copies from the store",
             "case": "s3/broadcast/restore", "measured": "-" if copies is None else f"{copies:.3f} copies",
             "result": "n/a" if copies is None else ("PASS" if copies <= 1.2 and row["verified"] else "FAIL"),
             "note": "" if row is None else f"{row['seconds']:.2f} s"}]
