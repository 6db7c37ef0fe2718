"""The preemption section of ``make bench`` (issue 12): how long from SIGTERM to a committed emergency step, and
what the preemption handling costs a training loop that is never preempted.

1. **Signal to commit.** A trainer process (``CheckpointManager(on_preemption=...)`` on local disk, a state of
   ``--size`` x 256 MiB) loops and saves in the background every few steps; at a random moment it gets a real
   ``SIGTERM``. The time from the signal to the emergency step's commit (``Preempted.committed_at``, written by
   the trainer before it exits) is set beside a blocking save of the same state in the same process.
2. **Loop slowdown.** The same single-threaded numpy loop with a manager created with ``preemption=True`` (the
   handlers and the deadline thread installed, ``reached_preemption()`` asked every iteration) and with
   ``preemption=False``, alternated; the ratio of the medians must be within noise of 1.
"""

from __future__ import annotations

import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

METHOD = "preemption"

_TRAINER = textwrap.dedent("""
    import json, os, sys, time
    import numpy as np
    import taskpoint
    state_size, log = int(sys.argv[2]), sys.argv[3]
    state = np.random.default_rng(0).random(state_size // 8)
    def emergency():
        return state.tobytes()
    mgr = taskpoint.CheckpointManager(sys.argv[1], async_save=True, keep=2, on_preemption=emergency)
    start = time.perf_counter()
    mgr.save(state.tobytes(), 0, blocking=True)
    blocking = time.perf_counter() - start
    print(json.dumps({"ready": True, "blocking_save_s": blocking}), flush=True)
    step = 0
    try:
        while True:
            step += 1
            state[:1024] += 1.0  # a step of "training"
            time.sleep(0.01)
            if step % 20 == 0:
                mgr.save(state.tobytes(), step)
            mgr.checkpoint_if_preempted()
    except taskpoint.Preempted as exc:
        with open(log, "w") as f:
            json.dump({"committed_at": exc.committed_at, "step": exc.step}, f)
        raise
""")


def signal_to_commit(size: float, trials: int, work: Path) -> dict[str, Any]:
    """Median and max seconds from SIGTERM to the emergency commit, and the blocking save of the same state."""
    state_size = max(1 << 20, int(size * (256 << 20)))
    rng = random.Random(12)
    delays, blocking = [], []
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                                         os.environ.get("PYTHONPATH", "")])}
    for trial in range(trials):
        folder = Path(tempfile.mkdtemp(prefix=f"preempt-{trial}-", dir=work))
        log = folder / "preempted.json"
        proc = subprocess.Popen([sys.executable, "-c", _TRAINER, str(folder / "steps"), str(state_size), str(log)],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        assert proc.stdout is not None
        ready = json.loads(proc.stdout.readline())
        blocking.append(ready["blocking_save_s"])
        time.sleep(rng.uniform(0.2, 1.5))
        sent = time.time()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
        if not log.exists():
            raise RuntimeError(f"trial {trial}: no emergency step was committed (exit {proc.returncode}): {err[-500:]}")
        delays.append(json.loads(log.read_text())["committed_at"] - sent)
        subprocess.run(["rm", "-rf", str(folder)], check=False)
    return {"state_mib": state_size / 2**20, "trials": trials, "median_s": statistics.median(delays),
            "max_s": max(delays), "blocking_median_s": statistics.median(blocking)}


def _loop(iterations: int, preemption: bool, folder: Path) -> float:
    import numpy as np

    import taskpoint

    mgr = taskpoint.CheckpointManager(folder, preemption=preemption)
    a = np.random.default_rng(1).random((160, 160))
    start = time.perf_counter()
    for _ in range(iterations):
        a = np.tanh(a @ a.T / 160.0)
        if mgr.reached_preemption():
            break
    elapsed = time.perf_counter() - start
    mgr.close()
    return elapsed


def loop_slowdown(runs: int, iterations: int, work: Path) -> dict[str, Any]:
    """Seconds of a numpy loop with the preemption handling installed and without, alternated."""
    on, off = [], []
    for run in range(runs):
        for preemption, into in ((True, on), (False, off)) if run % 2 == 0 else ((False, off), (True, on)):
            into.append(_loop(iterations, preemption, work / f"loop-{run}-{preemption}"))
    return {"runs": runs, "iterations": iterations, "with_s": statistics.median(on),
            "without_s": statistics.median(off), "ratio": statistics.median(on) / statistics.median(off)}


def run(size: float, runs: int, work: Path) -> dict[str, Any]:
    work.mkdir(parents=True, exist_ok=True)
    return {"signal": signal_to_commit(size, max(3, runs), work), "loop": loop_slowdown(max(5, runs), 4000, work)}


def table(result: dict[str, Any]) -> str:
    s, loop = result["signal"], result["loop"]
    return "\n".join([
        "| measure | value | reference | ratio |",
        "|---|---|---|---|",
        f"| SIGTERM to committed emergency step, {s['state_mib']:.0f} MiB state, local disk ({s['trials']} trials) | "
        f"median {s['median_s']:.3f} s, max {s['max_s']:.3f} s | blocking save {s['blocking_median_s']:.3f} s | "
        f"{s['median_s'] / s['blocking_median_s']:.2f} |",
        f"| numpy loop, {loop['iterations']} iterations, preemption handling installed ({loop['runs']} runs) | "
        f"{loop['with_s']:.3f} s | without {loop['without_s']:.3f} s | {loop['ratio']:.3f} |",
    ])
