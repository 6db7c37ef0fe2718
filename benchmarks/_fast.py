"""The ``fast`` section of ``make bench`` (issue 26 item 3): manager steps against the tools users would pick instead.

In one worker process (``benchmarks/_fast_worker.py``), alternating rounds (medians of ``--runs``), on local disk:

- ``pytree`` (256 MiB of float32 at size 1): Orbax's ``StandardCheckpointer`` save (+ ``wait_until_finished``)
  and restore with the abstract tree, against ``CheckpointManager.save(PyTree(tree))`` and
  ``load_pytree_sync(manager, abstract)``;
- ``state_dict`` (256 MiB): ``torch.save`` into a file + fsync and ``torch.load``, against
  ``CheckpointManager.save(StateDict(sd))`` and ``load_state_dict_sync`` (``taskpoint``), and the way before
  ``StateDict``, ``torch.save`` into bytes + ``CheckpointManager.save`` and ``restore`` + ``torch.load``
  (``bytes``);
- ``directory`` (the main data set's directory, 961 MiB at size 1): ``raw`` (``shutil.copytree``, no fsync) and
  ``baseline`` (Flyte's ``tar czf`` at level 9, ``extractall``), against ``CheckpointManager.save(dir)`` and
  ``restore(into=...)``.

Columns: median seconds, MB/s, ``x ref`` (time / the reference's), the worker's CPU seconds. The targets are the
issue's: PyTree save <= 1.1x and restore <= 1.2x Orbax; state dict save <= 1.3x ``torch.save`` + fsync and restore
<= 1.3x ``torch.load``; the directory's restore <= 1.5x the raw copy and >= 3x faster than the baseline's load.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import _dataset
from ._runner import REPO_ROOT, Options, _environment

METHOD = "fast"
CASES = ("pytree", "state_dict", "directory")
#: The reference each case's ratios divide by.
REFERENCE = {"pytree": "orbax", "state_dict": "torch", "directory": "raw"}
#: The issue's targets: (case, op, reference method, largest ratio, or smallest speedup when negative).
GOALS = (("pytree", "save", "orbax", 1.1), ("pytree", "load", "orbax", 1.2),
         ("state_dict", "save", "torch", 1.3), ("state_dict", "load", "torch", 1.3),
         ("directory", "load", "raw", 1.5), ("directory", "load", "baseline", -3.0))
WORKER_TIMEOUT_SECONDS = 3600


def run(size: float, opts: Options, data_dir: Path, cases: tuple[str, ...] = CASES) -> list[dict[str, Any]]:
    """Every case in one worker, ``opts.runs`` alternating rounds; one row per case, method and operation."""
    dataset = _dataset.prepare(data_dir, size, opts.log)
    work = data_dir / "work-fast"
    work.mkdir(parents=True, exist_ok=True)
    spec = {"cases": list(cases), "runs": opts.runs, "settle": opts.settle, "work": str(work / "cases"),
            "pytree_bytes": int(size * (256 << 20)), "state_dict_bytes": int(size * (256 << 20)),
            "directory": str(dataset.directory)}
    spec_path, result_path = work / "spec.json", work / "result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    subprocess.run([sys.executable, "-m", "benchmarks._fast_worker", str(spec_path), str(result_path)],
                   cwd=REPO_ROOT, env=_environment(tmp), check=True, timeout=WORKER_TIMEOUT_SECONDS)
    result = json.loads(result_path.read_text())
    logical = {"pytree": spec["pytree_bytes"], "state_dict": spec["state_dict_bytes"],
               "directory": dataset.sizes["directory"]}
    rows = []
    for case, methods in result.items():
        for op in ("save", "load"):
            ref = statistics.median(methods[REFERENCE[case]][op])
            for method, times in methods.items():
                seconds = statistics.median(times[op])
                rows.append({"store": "local", "payload": case, "op": op, "method": method, "seconds": seconds,
                             "logical_bytes": logical[case], "time_ratio": seconds / ref,
                             "cpu_s": statistics.median(times[f"{op}_cpu"]), "runs": times[op]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The section's table (MB = 10^6 bytes)."""
    head = ["case", "op", "method", "s", "MB/s", "x ref", "cpu s"]
    lines = [head] + [[r["payload"], r["op"], r["method"], f"{r['seconds']:.3f}",
                       f"{r['logical_bytes'] / r['seconds'] / 1e6:.1f}", f"{r['time_ratio']:.2f}",
                       f"{r['cpu_s']:.2f}"] for r in rows]
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths,
                                                                                                strict=True)))
                     for line in lines)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals, PASS or FAIL from the run."""
    seconds = {(r["payload"], r["op"], r["method"]): r["seconds"] for r in rows}
    out = []
    for case, op, ref, bound in GOALS:
        ours, theirs = seconds.get((case, op, "taskpoint")), seconds.get((case, op, ref))
        if ours is None or theirs is None:
            continue
        if bound > 0:
            ratio, ok, want = ours / theirs, ours / theirs <= bound, f"<= {bound}x {ref}"
        else:
            ratio, ok, want = theirs / ours, theirs / ours >= -bound, f">= {-bound}x faster than {ref}"
        out.append({"target": f"issue 26: {case} {op} {want}", "case": f"local/{case}/{op}",
                    "measured": f"{ratio:.2f}x", "result": "PASS" if ok else "FAIL",
                    "note": f"{ours:.2f} s vs {theirs:.2f} s"})
    return out
