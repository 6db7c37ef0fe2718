"""A quick measurement of multi-rank steps (issue 13, items 1-2), small enough for the shared 2-core machine.

    PYTHONPATH=src:tests python benchmarks/ranks_quick.py [--mib 16] [--ranks 4] [--runs 3] [--stores local,s3]

For each store (local disk, and moto's S3 in this process: slower than a real server), ``--ranks`` real
processes save ``--runs`` steps of ``--mib`` MiB each (their shards), blocking; it reports each rank's save
time (rank 0's includes waiting for the others and the commit) next to one process saving one shard of the
same size and one of ``ranks x`` that size. Then the same ranks start a task attempt in root mode at once
and it reports how long agreeing on the attempt took (the rendezvous), from the processes' own clocks.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from taskpoint import CheckpointManager

_TIMED = r"""
import json, os, sys, time
import taskpoint
args = json.loads(sys.argv[1])
if args["mode"] == "save":
    mgr = taskpoint.CheckpointManager(args["directory"], storage_options=args["options"], preemption=False)
    data = os.urandom(args["size"])
    for step in range(1, args["runs"] + 1):
        start = time.perf_counter()
        mgr.save(data, step)
        print(json.dumps({"event": "timed", "step": step, "seconds": time.perf_counter() - start}), flush=True)
    mgr.close()
else:
    taskpoint.storage.Location(os.environ["TASKPOINT_ROOT"], taskpoint.runtime.layout.env_storage_options()).exists()
    start = time.time()  # the client is connected: from here on, only the rendezvous
    context = taskpoint.ctx()
    print(json.dumps({"event": "timed", "attempt": context.attempt, "seconds": [start, time.time()]}), flush=True)
"""


def run_ranks(ranks: int, args: dict[str, Any], env: dict[str, str] | None = None) -> list[list[Any]]:
    """Each rank's timed events' seconds, after running :data:`_TIMED` in ``ranks`` processes at once."""
    script = Path(tempfile.mkdtemp()) / "timed.py"
    script.write_text(_TIMED)
    procs = []
    for rank in range(ranks):
        child = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(ranks), **(env or {})}
        procs.append(subprocess.Popen([sys.executable, str(script), json.dumps(args)], env=child,
                                      stdout=subprocess.PIPE, text=True))
    out = []
    for proc in procs:
        stdout, _ = proc.communicate(timeout=600)
        assert proc.returncode == 0
        out.append([json.loads(line)["seconds"] for line in stdout.splitlines()])
    return out


def single(directory: str, options: dict[str, Any], size: int, runs: int) -> float:
    data = os.urandom(size)
    with CheckpointManager(directory, storage_options=options, preemption=False, rank=0, world_size=1) as mgr:
        times = []
        for step in range(1, runs + 1):
            start = time.perf_counter()
            mgr.save(data, step)
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--ranks", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--stores", default="local,s3")
    opts = parser.parse_args()
    size = opts.mib << 20
    from _servers import running_s3_server

    with running_s3_server() as server:
        print("| store | what | median s |")
        print("|---|---|---|")
        for store in opts.stores.split(","):
            if store == "local":
                base, options = tempfile.mkdtemp(), {}
            else:
                location = server.new_location()
                base, options = location.base, location.storage_options
            times = run_ranks(opts.ranks, {"mode": "save", "directory": f"{base}/ranks", "options": options,
                                           "size": size, "runs": opts.runs})
            for rank, seconds in enumerate(times):
                print(f"| {store} | rank {rank} of {opts.ranks}: save {opts.mib} MiB shard"
                      f"{' + wait + commit' if rank == 0 else ' + record'} | {statistics.median(seconds):.3f} |")
            print(f"| {store} | one process, {opts.mib} MiB | {single(f'{base}/one', options, size, opts.runs):.3f} |")
            print(f"| {store} | one process, {opts.mib * opts.ranks} MiB | "
                  f"{single(f'{base}/all', options, size * opts.ranks, opts.runs):.3f} |")
            env = {"TASKPOINT_ROOT": f"{base}/root", "TASKPOINT_RUN_NAME": "bench", "TASKPOINT_ACTION_NAME": "main",
                   "TASKPOINT_STORAGE_OPTIONS": json.dumps(options)}
            for _ in range(opts.runs):
                spans = [s[0] for s in run_ranks(opts.ranks, {"mode": "ctx"}, env)]
                last_in, last_out = max(start for start, _ in spans), max(end for _, end in spans)
                print(f"| {store} | {opts.ranks} ranks agree on the attempt: last rank in to last rank out | "
                      f"{last_out - last_in:.3f} |")


if __name__ == "__main__":
    main()
