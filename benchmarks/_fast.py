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

Columns: median seconds, MB/s, ``x ref`` (the median time / the reference's median time), ``paired`` (the median of
each round's own ratio, time / the reference's time in the same round, a few seconds apart) with the lowest and
highest round, and the worker's CPU seconds with their ratio to the reference's. On a shared machine the same
operation's time varies up to 3x between rounds (the kernel's page-cache writes, docs/performance.md), and a round's
two operations share its conditions: the targets are judged on the paired ratio. They are the issue's: PyTree save
<= 1.1x and restore <= 1.2x Orbax; state dict save <= 1.3x ``torch.save`` + fsync and restore <= 1.3x
``torch.load``; the directory's restore <= 1.5x the raw copy and >= 3x faster than the baseline's load.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import _dataset, _report
from ._runner import REPO_ROOT, Options, _environment

METHOD = "fast"
CASES = ("pytree", "state_dict", "directory")
#: The ``format`` section (issue 42): the same worker's cases ``plain`` (a directory step's save against a raw copy
#: with fsync, its restore against a raw copy), ``verify`` (``CheckpointManager.verify`` of a directory step
#: against reading its stored bytes once) and ``dcp`` (one process's DCP checkpoint through DCP's
#: ``FileSystemWriter``/``FileSystemReader`` and through ``taskpoint.torch``, state dict bytes).
FORMAT_METHOD = "format"
FORMAT_CASES = ("plain", "verify", "dcp")
#: The reference each case's ratios divide by.
REFERENCE = {"pytree": "orbax", "state_dict": "torch", "directory": "raw", "plain": "raw-fsync", "verify": "read",
             "dcp": "filesystem"}
#: The issue's targets: (case, op, reference method, largest ratio, or smallest speedup when negative).
GOALS = (("pytree", "save", "orbax", 1.1), ("pytree", "load", "orbax", 1.2),
         ("state_dict", "save", "torch", 1.3), ("state_dict", "load", "torch", 1.3),
         ("directory", "load", "raw", 1.5), ("directory", "load", "baseline", -3.0),
         ("plain", "save", "raw-fsync", 1.1), ("plain", "load", "raw-fsync", 1.5), ("verify", "load", "read", 1.2),
         ("dcp", "load", "filesystem", 1.2))
#: The issue each case's goals are from.
ISSUE = {**dict.fromkeys(CASES, 26), **dict.fromkeys(FORMAT_CASES, 42)}
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
               "directory": dataset.sizes["directory"], "plain": dataset.sizes["directory"],
               "verify": dataset.sizes["directory"], "dcp": spec["state_dict_bytes"]}
    rows = []
    for case, methods in result.items():
        for op in ("save", "load"):
            refs = methods[REFERENCE[case]]
            ref = statistics.median(refs[op])
            for method, times in methods.items():
                seconds = statistics.median(times[op])
                paired = [ours / theirs for ours, theirs in zip(times[op], refs[op], strict=True)]
                cpu = statistics.median(times[f"{op}_cpu"])
                rows.append({"store": "local", "payload": case, "op": op, "method": method, "seconds": seconds,
                             "logical_bytes": logical[case], "time_ratio": seconds / ref,
                             "paired_ratio": statistics.median(paired), "paired_range": [min(paired), max(paired)],
                             "cpu_s": cpu, "cpu_ratio": cpu / max(statistics.median(refs[f"{op}_cpu"]), 1e-9),
                             "runs": times[op]})
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The section's table (MB = 10^6 bytes)."""
    head = ["case", "op", "method", "s", "MB/s", "x ref", "paired", "rounds", "cpu s", "cpu x ref"]
    lines = [head] + [[r["payload"], r["op"], r["method"], f"{r['seconds']:.3f}",
                       f"{r['logical_bytes'] / r['seconds'] / 1e6:.1f}", f"{r['time_ratio']:.2f}",
                       f"{r['paired_ratio']:.2f}", "{:.2f}-{:.2f}".format(*r["paired_range"]),
                       f"{r['cpu_s']:.2f}", f"{r['cpu_ratio']:.2f}"] for r in rows]
    return _report.aligned(lines, 3)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals, PASS or FAIL from the run."""
    found = {(r["payload"], r["op"], r["method"]): r for r in rows}
    out = []
    for case, op, ref, bound in GOALS:
        ours, theirs = found.get((case, op, "taskpoint")), found.get((case, op, ref))
        if ours is None or theirs is None:
            continue
        ratio = statistics.median(a / b for a, b in zip(ours["runs"], theirs["runs"], strict=True))  # paired
        if bound > 0:
            shown, ok, want = ratio, ratio <= bound, f"<= {bound}x {ref}"
        else:
            shown, ok, want = 1 / ratio, 1 / ratio >= -bound, f">= {-bound}x faster than {ref}"
        out.append({"target": f"issue {ISSUE[case]}: {case} {op} {want}", "case": f"local/{case}/{op}",
                    "measured": f"{shown:.2f}x", "result": "PASS" if ok else "FAIL",
                    "note": f"{ours['seconds']:.2f} s vs {theirs['seconds']:.2f} s (medians)"})
    return out
