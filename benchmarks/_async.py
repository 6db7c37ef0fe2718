"""The ``async`` section of ``make bench`` (issue 43): what a background save costs the training loop.

Every method runs in a process of its own (``benchmarks/_async_worker.py``), in alternating order (each round starts
at another method), on local disk; medians of ``--runs`` rounds (the issue asks for at least 5). Two states of
``--size`` x 256 MiB (and, with ``--async-sizes``, any list of MiB): float32 tensors of 64 MiB (torch) and a PyTree
of such arrays (JAX). Each process waits 5 s after making its saver (the manager starts its save process then), so
the first save is made as a training loop's would be, then saves :data:`SAVES` times.

Methods, torch: ``copy`` (``{k: v.clone()}``, the floor of any save that lets the loop change its tensors),
``torch-fsync`` (``torch.save`` into a file + fsync, blocking), ``dcp`` (``torch.distributed.checkpoint.async_save``,
one process), ``taskpoint`` (``save(StateDict(sd), step)`` on an ``async_save=True`` manager, which starts its save
process when it is made), ``taskpoint-on-demand`` (``save(..., blocking=False)`` on a manager that starts it at its
first background save) and ``taskpoint-blocking``. JAX: ``copy``
(``x.copy()`` of each array), ``orbax`` (Orbax's ``CheckpointManager`` with async checkpointing), ``taskpoint``
(``save(PyTree(tree), blocking=False)``) and ``taskpoint-blocking``.

Columns: ``blocked`` (until the save call returned) of the first save and the median of the later ones,
``durable`` (until committed) likewise, and ``peak extra`` (the highest PSS of the process and its children during a
save, less before it, median of the saves). Targets (issue 43): blocked <= 1.2x ``copy``, first and later; durable <=
1.1x the blocking save of the same kind; peak extra <= 1.3x the state.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import _report
from ._runner import REPO_ROOT, Options, _environment

METHOD = "async"
METHODS = {"torch": ("copy", "torch-fsync", "dcp", "taskpoint", "taskpoint-on-demand", "taskpoint-blocking"),
           "jax": ("copy", "orbax", "taskpoint", "taskpoint-blocking")}
#: Saves per process: the first, then the later ones.
SAVES = 4
#: Seconds between the saver's creation and the first save.
FIRST_DELAY = 5.0
WORKER_TIMEOUT_SECONDS = 1800


def run(size: float, opts: Options, data_dir: Path, sizes_mib: list[int] | None = None) -> list[dict[str, Any]]:
    """Every method of each kind and size in its own process, ``opts.runs`` alternating rounds; one row each."""
    work = data_dir / "work-async"
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    rows = []
    for mib in sizes_mib or [int(size * 256)]:
        for kind, methods in METHODS.items():
            found: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
            for round_ in range(opts.runs):
                order = methods[round_ % len(methods):] + methods[:round_ % len(methods)]
                for method in order:
                    found[method].append(_one(kind, method, mib << 20, work, tmp))
                    opts.log(f"async {kind} {mib} MiB round {round_ + 1} {method}: {found[method][-1]['saves']}")
            rows += [_row(kind, mib, method, results) for method, results in found.items()]
    return rows


def _one(kind: str, method: str, nbytes: int, work: Path, tmp: Path) -> dict[str, Any]:
    spec = {"kind": kind, "method": method, "bytes": nbytes, "first_delay": FIRST_DELAY, "saves": SAVES,
            "work": str(work / "case")}
    spec_path, result_path = work / "spec.json", work / "result.json"
    spec_path.write_text(json.dumps(spec))
    result_path.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-m", "benchmarks._async_worker", str(spec_path), str(result_path)],
                   cwd=REPO_ROOT, env=_environment(tmp), check=True, timeout=WORKER_TIMEOUT_SECONDS)
    result: dict[str, Any] = json.loads(result_path.read_text())
    return result


def _row(kind: str, mib: int, method: str, results: list[dict[str, Any]]) -> dict[str, Any]:
    def median(pick: Any) -> float:
        return statistics.median(pick(result) for result in results)

    return {"kind": kind, "mib": mib, "method": method, "rounds": len(results),
            "blocked_first": median(lambda r: r["saves"][0]["blocked"]),
            "blocked_later": median(lambda r: statistics.median(s["blocked"] for s in r["saves"][1:])),
            "durable_first": median(lambda r: r["saves"][0]["durable"]),
            "durable_later": median(lambda r: statistics.median(s["durable"] for s in r["saves"][1:])),
            "peak_extra": median(lambda r: statistics.median(s["peak_extra"] for s in r["saves"])),
            "pss_start": median(lambda r: r["start"]), "pss_end": median(lambda r: r["end"])}


def table(rows: list[dict[str, Any]]) -> str:
    head = ["kind", "MiB", "method", "blocked 1st", "blocked later", "durable 1st", "durable later",
            "peak extra MiB", "x state", "PSS start-end MiB"]
    lines = [head] + [[r["kind"], str(r["mib"]), r["method"], f"{r['blocked_first']:.3f}",
                       f"{r['blocked_later']:.3f}", f"{r['durable_first']:.3f}", f"{r['durable_later']:.3f}",
                       f"{r['peak_extra'] / 2**20:.0f}", f"{r['peak_extra'] / (r['mib'] << 20):.2f}",
                       f"{r['pss_start'] / 2**20:.0f}-{r['pss_end'] / 2**20:.0f}"] for r in rows]
    return _report.aligned(lines, 3)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals, PASS or FAIL from the run."""
    found = {(r["kind"], r["mib"], r["method"]): r for r in rows}
    out = []
    for (kind, mib, method), ours in found.items():
        if method != "taskpoint":
            continue
        copy, blocking = found[(kind, mib, "copy")], found[(kind, mib, "taskpoint-blocking")]
        checks = [("blocked (first save) <= 1.2x copy", ours["blocked_first"] / copy["blocked_later"], 1.2),
                  ("blocked (later saves) <= 1.2x copy", ours["blocked_later"] / copy["blocked_later"], 1.2),
                  ("durable <= 1.1x blocking save", ours["durable_later"] / blocking["durable_later"], 1.1),
                  ("peak extra memory <= 1.3x the state", ours["peak_extra"] / (mib << 20), 1.3)]
        out += [{"target": f"issue 43: {kind} {what}", "case": f"local/{kind}/{mib} MiB", "measured": f"{ratio:.2f}x",
                 "result": "PASS" if ratio <= bound else "FAIL", "note": f"median of {ours['rounds']} rounds"}
                for what, ratio, bound in checks]
    return out
