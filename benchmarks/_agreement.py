"""The agreement section of ``make bench`` (issue 28): what agreeing on a stopping step costs a training step of
a 4-rank job while no preemption notice is pending.

4 real processes with torchrun's variables run the same loop of ``ITERATIONS`` steps, each a small numpy
product; with the process group, every step also all-reduces 1024 floats (the gradients' place in data-parallel
training). The loop runs with ``should_save(step)`` asked every step of a ``CheckpointManager`` of 4 ranks (no
save falls due: only the agreement runs) and without it, alternated ``runs`` times; the ratio is that of the
medians of the slowest rank's loop. With the process group, the agreement starts one all-reduce of one int per
step and reads it at the next; without one, a thread of each rank lists the agreement folder on local disk
every 0.5 s and a step reads a flag.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

METHOD = "agreement"
RANKS = 4
ITERATIONS = 3000

_RANK = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    import taskpoint
    directory, group, out = sys.argv[1], sys.argv[2] == "1", sys.argv[5]
    runs, iterations = int(sys.argv[3]), int(sys.argv[4])
    if group:
        import torch, torch.distributed as dist
        dist.init_process_group("gloo")
        grads = torch.ones(1024)
    mgr = taskpoint.CheckpointManager(directory, commit_timeout=60)
    a = np.random.default_rng(1).random((48, 48))
    def loop(agree):
        global a
        if group:
            dist.barrier()
        start = time.perf_counter()
        for step in range(1, iterations + 1):
            a = np.tanh(a @ a.T / 48.0)
            if group:
                dist.all_reduce(grads)
            if agree and mgr.should_save(step):
                raise SystemExit("a save fell due: no notice was sent")
        return time.perf_counter() - start
    times = {"with": [], "without": []}
    for run in range(runs):
        for agree in ((True, False) if run % 2 == 0 else (False, True)):
            times["with" if agree else "without"].append(loop(agree))
    with open(out, "w") as f:
        json.dump(times, f)
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _job(group: bool, runs: int, work: Path) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"agreement-{int(group)}-", dir=work))
    port = _free_port()
    src = str(Path(__file__).resolve().parents[1] / "src")
    procs = []
    for rank in range(RANKS):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(RANKS), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, "-c", _RANK, str(folder / "steps"), "1" if group else "0",
                                       str(runs), str(ITERATIONS), str(folder / f"rank-{rank}.json")],
                                      env=env, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        _, err = proc.communicate(timeout=900)
        if proc.returncode:
            raise RuntimeError(f"an agreement benchmark rank failed ({proc.returncode}): {err[-800:]}")
    ranks = [json.loads((folder / f"rank-{rank}.json").read_text()) for rank in range(RANKS)]
    slowest = {kind: [max(r[kind][run] for r in ranks) for run in range(runs)] for kind in ("with", "without")}
    subprocess.run(["rm", "-rf", str(folder)], check=False)
    on, off = statistics.median(slowest["with"]), statistics.median(slowest["without"])
    return {"group": group, "runs": runs, "iterations": ITERATIONS, "with_s": on, "without_s": off,
            "per_step_us": (on - off) / ITERATIONS * 1e6, "ratio": on / off}


def run(runs: int, work: Path) -> list[dict[str, Any]]:
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    try:
        import torch.distributed  # noqa: F401

        rows.append(_job(True, max(3, runs), work))
    except ImportError:
        pass
    rows.append(_job(False, max(3, runs), work))
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| 4 ranks, loop of steps | with should_save(step) | without | per step | ratio |",
             "|---|---|---|---|---|"]
    for r in rows:
        how = ("gloo process group, an all-reduce per step" if r["group"]
               else "no process group (agreement through storage, local disk)")
        lines.append(f"| {how}, {r['iterations']} steps ({r['runs']} runs) | {r['with_s']:.3f} s | "
                     f"{r['without_s']:.3f} s | {r['per_step_us']:+.1f} us | {r['ratio']:.3f} |")
    return "\n".join(lines)
