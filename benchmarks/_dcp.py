"""The DCP section of ``make bench`` (issue 13): 4 ranks save a sharded model with ``torch.distributed.checkpoint``.

Compared in the same run, each a gloo job of 4 real processes on CPU (``benchmarks/_dcp_rank.py``), saving
``--size`` GiB in total (1 GiB at size 1: 8 float32 DTensors sharded on dim 0) and loading it back on the same
4 ranks:

| method | store | writer / reader |
|---|---|---|
| `taskpoint` | s3, local | `taskpoint.torch.Writer` / `Reader`: atomic parallel uploads, sha256, verified load |
| `fsspec` | s3 | DCP's `FsspecWriter` / `FsspecReader`, DCP's defaults (one thread, `sync_files=True`) |
| `fsspec-t4` | s3 | `FsspecWriter(thread_count=4, sync_files=False)`: DCP's fastest settings on an object store |
| `filesystem` | local | DCP's `FileSystemWriter` / `FileSystemReader`, defaults (one thread, fsync) |

Per case: wall seconds of the save (and the load) from a barrier before to a barrier after, on the slowest rank;
client CPU, the sum of the 4 ranks' process CPU (all threads); the S3 server's CPU; the stored bytes; the time
relative to DCP's writer on the same store (``fsspec`` on s3, ``filesystem`` locally); the cores other processes
used meanwhile (``!``: a busy machine). Every load is checked bit for bit after its clock stops.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from ._runner import BUSY_CORES, REPO_ROOT, Options, OtherLoad, _environment, _process_cpu_seconds, _settle, open_store

METHOD = "dcp"
RANKS = 4
#: (store, method) in the order they run and are reported; the reference of each store comes first.
CASES = (("s3", "fsspec"), ("s3", "fsspec-t4"), ("s3", "taskpoint"), ("local", "filesystem"), ("local", "taskpoint"))
REFERENCE = {"s3": "fsspec", "local": "filesystem"}
RANK_TIMEOUT_SECONDS = 1800


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(spec: dict[str, Any], work: Path) -> dict[str, Any]:
    """One gloo job of :data:`RANKS` processes; rank 0's result."""
    spec_path, result_path = work / "dcp-case.json", work / "dcp-result.json"
    result_path.unlink(missing_ok=True)
    spec_path.write_text(json.dumps({**spec, "result": str(result_path)}))
    tmp = work / "dcp-tmp"
    tmp.mkdir(exist_ok=True)
    env = {**_environment(tmp), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
           "WORLD_SIZE": str(RANKS), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-m", "benchmarks._dcp_rank", str(spec_path)], cwd=REPO_ROOT,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for r in range(RANKS)]
    outputs = [p.communicate(timeout=RANK_TIMEOUT_SECONDS)[0] for p in procs]
    failed = [out for p, out in zip(procs, outputs, strict=True) if p.returncode != 0]
    if failed or not result_path.exists():
        raise RuntimeError("a rank failed:\n" + "\n".join((failed or outputs)[0].strip().splitlines()[-15:]))
    return dict(json.loads(result_path.read_text()))


def run(size: float, opts: Options, work: Path) -> list[dict[str, Any]]:
    """Every case of :data:`CASES`, ``opts.runs`` times each (each after the runner's wait for a quiet machine);
    one row per case and operation (median of the runs)."""
    total, runs, log = int(size * (1 << 30)), opts.runs, opts.log
    work.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    with open_store("s3", work, log, opts.moto_fast_ranges) as s3, open_store("local", work, log) as local:
        stores = {"s3": s3, "local": local}
        for kind, method in CASES:
            store = stores[kind]
            runs_done: list[dict[str, Any]] = []
            error = None
            for i in range(runs):
                uri = f"{store.root}/dcp/{method}"
                store.clear(uri)
                os.sync()
                _settle(store, opts)
                server0 = _process_cpu_seconds(store.server_pid)
                others = OtherLoad(store.server_pid)
                try:
                    result = _job({"method": method, "uri": uri, "storage_options": store.storage_options,
                                   "total_bytes": total}, work)
                except Exception as exc:  # a failed case is reported in its row, the others still run
                    error = str(exc)
                    log(f"  dcp {kind}/{method} run {i + 1}/{runs}: FAILED\n{error}")
                    break
                result["server_cpu_s"] = _process_cpu_seconds(store.server_pid) - server0
                result["other_cores"] = others.cores_since_mark()
                result["stored_bytes"] = store.stored_bytes(uri)
                if not result["same"]:
                    error = "the load did not return the saved tensors"
                runs_done.append(result)
                log(f"  dcp {kind}/{method:<10} run {i + 1}/{runs}: save {result['save_s']:7.3f} s "
                    f"(cpu {result['save_cpu_s']:6.2f} s), load {result['load_s']:7.3f} s "
                    f"(cpu {result['load_cpu_s']:6.2f} s), stored {result['stored_bytes'] / 2**20:7.1f} MiB, "
                    f"others {result['other_cores']:.2f} cores")
                store.clear(uri)
            for op in ("save", "load"):
                row: dict[str, Any] = {"store": kind, "method": method, "op": op, "error": error, "runs": runs_done}
                if runs_done:
                    row.update(seconds=statistics.median(r[f"{op}_s"] for r in runs_done),
                               cpu_s=statistics.median(r[f"{op}_cpu_s"] for r in runs_done),
                               server_cpu_s=statistics.median(r["server_cpu_s"] for r in runs_done),
                               other_cores=max(r["other_cores"] for r in runs_done),
                               stored_bytes=runs_done[-1]["stored_bytes"], logical_bytes=runs_done[-1]["logical_bytes"])
                rows.append(row)
    for row in rows:
        ref = next((r for r in rows if (r["store"], r["method"], r["op"]) == (row["store"], REFERENCE[row["store"]],
                                                                             row["op"])), None)
        if ref and ref.get("seconds") and row.get("seconds"):
            row["time_ratio"] = row["seconds"] / ref["seconds"]
            row["cpu_ratio"] = row["cpu_s"] / ref["cpu_s"] if ref["cpu_s"] else None
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The DCP section's table (MB = 10^6 bytes)."""
    head = ["store", "op", "method", "s", "MB/s", "x ref", "cpu s", "cpu x ref", "srv cpu s", "stored MiB", "others"]
    lines = [head]
    for r in rows:
        if r.get("seconds") is None:
            lines.append([r["store"], r["op"], r["method"], "FAILED", "", "", "", "", "", "", ""])
            continue
        ratio, cpu_ratio = r.get("time_ratio"), r.get("cpu_ratio")
        lines.append([r["store"], r["op"], r["method"], f"{r['seconds']:.3f}",
                      f"{r['logical_bytes'] / r['seconds'] / 1e6:.1f}",
                      "" if ratio is None else f"{ratio:.2f}", f"{r['cpu_s']:.2f}",
                      "" if cpu_ratio is None else f"{cpu_ratio:.2f}",
                      f"{r['server_cpu_s']:.2f}" if r["store"] == "s3" else "-",
                      f"{r['stored_bytes'] / 2**20:.1f}",
                      f"{r['other_cores']:.2f}{'!' if r['other_cores'] > BUSY_CORES else ''}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths,
                                                                                                strict=True)))
                     for line in lines)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 13's goal: saves no slower than DCP's writers (each of them, on its store) while verifying every
    byte."""
    out = []
    for store in ("s3", "local"):
        ours = next((r for r in rows if (r["store"], r["method"], r["op"]) == (store, "taskpoint", "save")), None)
        for ref in (r for r in rows if r["store"] == store and r["op"] == "save" and r["method"] != "taskpoint"):
            if ours is None or ours.get("seconds") is None or ref.get("seconds") is None:
                continue
            ratio = ours["seconds"] / ref["seconds"]
            out.append({"target": f"issue 13: DCP save <= DCP's {ref['method']}", "case": f"{store}/dcp/save",
                        "measured": f"{ratio:.2f}x", "result": "PASS" if ratio <= 1.0 else "FAIL",
                        "note": f"{ours['seconds']:.2f} s vs {ref['seconds']:.2f} s, {RANKS} ranks"})
    return out
