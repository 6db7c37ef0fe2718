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
first background save), ``taskpoint-resumed`` (``taskpoint`` in a process that resumes: the steps' folder holds a step
of the same state, saved blocking before the manager is made, so that the manager makes its first staging segment
ahead) and ``taskpoint-blocking``. JAX: ``copy``
(``x.copy()`` of each array), ``orbax`` (Orbax's ``CheckpointManager`` with async checkpointing), ``taskpoint``
(``save(PyTree(tree), blocking=False)``), ``taskpoint-resumed`` and ``taskpoint-blocking``.

Columns: ``blocked`` (until the save call returned) of the first save and the median of the later ones,
``durable`` (until committed) likewise; ``peak extra/save`` (the highest PSS of the process and its children during a
save, less before it, median of the saves) and ``peak extra/run`` (the highest PSS from just before the first save
to the end, less the PSS then: what is held between saves, such as taskpoint's ready segment, counts here); both also
as ``x state``. Targets (issue 43): blocked <= 1.2x ``copy``, first and later; durable <= 1.1x the blocking save of
the same kind; peak extra <= 1.3x the state, read against the PSS before the first save (the per-save figure is
reported beside it). A size the machine cannot hold (:func:`shortfall`) is skipped with a line saying why.

Two more rows, each a method of ``make bench`` of its own, run alone:

* ``async-big`` (``--async-big-mib``, 4096 by default): one JAX array of that size, the case of Orbax's report (a 4 GB
  array needing 14 GB of RAM), saved by Orbax's async manager and by taskpoint's background PyTree save, the peak
  memory of both side by side. It needs about 16 GiB of memory available (the state, its staging, the writers):
  skipped, saying so, when less is. Never run it beside a test suite.
* ``async-many`` (``--async-many-mib``, 64 by default): :data:`MANY_SAVES` consecutive background saves, torch
  (taskpoint and DCP) and JAX (taskpoint and Orbax), the last :data:`MANY_KEEP` kept; the PSS of the trainer and of
  its save process before the first save, after the first and the tenth, and at the end. Target: flat, the growth
  from the tenth save to the last (the trend of the readings after every tenth save, in the JSON) at most
  :data:`FLAT_SHARE` of the state, plus :data:`FLAT_NOISE_BYTES`, for the two processes together.
"""

from __future__ import annotations

import dataclasses
import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from . import _report
from ._runner import REPO_ROOT, Options, _environment

METHOD = "async"
METHODS = {"torch": ("copy", "torch-fsync", "dcp", "taskpoint", "taskpoint-on-demand", "taskpoint-resumed",
                     "taskpoint-blocking"),
           "jax": ("copy", "orbax", "taskpoint", "taskpoint-resumed", "taskpoint-blocking")}
#: Saves per process: the first, then the later ones.
SAVES = 4
#: Seconds between the saver's creation and the first save.
FIRST_DELAY = 5.0
WORKER_TIMEOUT_SECONDS = 1800
#: The 4 GiB JAX array (``--methods async-big``): its methods, and saves per process (the first and a later one).
BIG_METHOD = "async-big"
BIG_METHODS = {"jax": ("orbax", "taskpoint")}
BIG_SAVES = 2
#: Consecutive background saves (``--methods async-many``): their methods, how many, and how many steps stay on disk.
MANY_METHOD = "async-many"
MANY_METHODS = {"torch": ("taskpoint", "dcp"), "jax": ("taskpoint", "orbax")}
MANY_SAVES = 100
MANY_KEEP = 2
#: The bound of "flat": PSS growth of the trainer and its save process from the tenth save to the last, as a share
#: of the state (a leak of a tenth of a percent of the state per save would pass 9% in 90 saves), plus
#: :data:`FLAT_NOISE_BYTES`, the spread of one reading between saves of a flat process (a JAX trainer's PSS read
#: after every tenth of 100 saves of 64 MiB: 213-228 MiB, with no trend).
FLAT_SHARE = 0.1
FLAT_NOISE_BYTES = 16 << 20
#: What a size needs free to run: this many times the state (the state, a method's copy of it, Orbax's own buffers:
#: its report measured 3.5x), plus :data:`SPARE_BYTES` for the processes themselves (torch, jax, the save process).
NEED_TIMES_STATE = 3.5
SPARE_BYTES = 2 << 30


def kinds(names: list[str]) -> dict[str, tuple[str, ...]]:
    """The methods of the kinds ``names`` (``--async-kinds``: ``jax`` runs only the JAX rows); ValueError naming
    an unknown kind."""
    unknown = sorted(set(names) - set(METHODS))
    if unknown:
        raise ValueError(f"--async-kinds: unknown {unknown}, the kinds are {sorted(METHODS)}")
    return {kind: methods for kind, methods in METHODS.items() if kind in names}


def shortfall(nbytes: int) -> str | None:
    """Why a state of ``nbytes`` cannot run on this machine now (the memory available, ``MemAvailable``, below
    :data:`NEED_TIMES_STATE` times it plus :data:`SPARE_BYTES`); None when it can."""
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
    available = int(fields["MemAvailable"].split()[0]) << 10
    need = NEED_TIMES_STATE * nbytes + SPARE_BYTES
    if available >= need:
        return None
    return f"needs about {need / 2**30:.1f} GiB of memory available, {available / 2**30:.1f} GiB is"


def run(size: float, opts: Options, data_dir: Path, sizes_mib: list[int] | None = None,
        cases: dict[str, tuple[str, ...]] = METHODS, saves: int = SAVES, leaf: bool = False,
        keep: int | None = None) -> list[dict[str, Any]]:
    """Every method of each kind and size in its own process, ``opts.runs`` alternating rounds, ``saves`` saves
    each; one row each, or one saying why a size is skipped. ``leaf``: the state is one array of the whole size.
    ``keep``: only the last saves stay on disk."""
    work = data_dir / "work-async"
    work.mkdir(parents=True, exist_ok=True)
    tmp = work / "tmp"
    tmp.mkdir(exist_ok=True)
    rows: list[dict[str, Any]] = []
    for mib in sizes_mib or [int(size * 256)]:
        why = shortfall(mib << 20)
        if why is not None:
            opts.log(f"async {mib} MiB skipped: it {why}")
            rows.append({"mib": mib, "skipped": why})
            continue
        spec = {"bytes": mib << 20, "saves": saves, "keep": keep, **({"leaf_bytes": mib << 20} if leaf else {})}
        for kind, methods in cases.items():
            found: dict[str, list[dict[str, Any]]] = {method: [] for method in methods}
            for round_ in range(opts.runs):
                order = methods[round_ % len(methods):] + methods[:round_ % len(methods)]
                for method in order:
                    found[method].append(_one({**spec, "kind": kind, "method": method}, work, tmp))
                    first = found[method][-1]["saves"][:SAVES]
                    opts.log(f"async {kind} {mib} MiB round {round_ + 1} {method}: {first}")
            rows += [_row(kind, mib, method, results) for method, results in found.items()]
    return rows


def run_big(opts: Options, data_dir: Path, mib: int) -> list[dict[str, Any]]:
    """The ``async-big`` rows: one JAX array of ``mib`` MiB, Orbax against taskpoint."""
    return run(0, opts, data_dir, [mib], BIG_METHODS, BIG_SAVES, leaf=True)


def run_many(opts: Options, data_dir: Path, mib: int, saves: int = MANY_SAVES) -> list[dict[str, Any]]:
    """The ``async-many`` rows: ``saves`` consecutive saves of ``mib`` MiB, one round."""
    once = dataclasses.replace(opts, runs=1)
    return run(0, once, data_dir, [mib], MANY_METHODS, saves, keep=MANY_KEEP)


def _one(spec: dict[str, Any], work: Path, tmp: Path) -> dict[str, Any]:
    spec = {**spec, "first_delay": FIRST_DELAY, "work": str(work / "case")}
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

    processes = {when: {who: median(lambda r, w=when, p=who: r["processes"][w][p]) for who in ("trainer", "saver")}
                 for when in results[0]["processes"]}
    return {"kind": kind, "mib": mib, "method": method, "rounds": len(results), "saves": len(results[0]["saves"]),
            "blocked_first": median(lambda r: r["saves"][0]["blocked"]),
            "blocked_later": median(lambda r: statistics.median(s["blocked"] for s in r["saves"][1:])),
            "durable_first": median(lambda r: r["saves"][0]["durable"]),
            "durable_later": median(lambda r: statistics.median(s["durable"] for s in r["saves"][1:])),
            "peak_extra": median(lambda r: statistics.median(s["peak_extra"] for s in r["saves"])),
            "peak_run": median(lambda r: r["peak"] - r["before"]),
            "pss_start": median(lambda r: r["start"]), "pss_end": median(lambda r: r["end"]), "processes": processes}


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.0f}"


def table(rows: list[dict[str, Any]]) -> str:
    """The rows' times and peak memory (the ``async`` and ``async-big`` sections)."""
    head = ["kind", "MiB", "method", "blocked 1st", "blocked later", "durable 1st", "durable later",
            "peak extra/save MiB", "x state", "peak extra/run MiB", "x state", "PSS start-end MiB"]
    lines = [head] + [[r["kind"], str(r["mib"]), r["method"], f"{r['blocked_first']:.3f}",
                       f"{r['blocked_later']:.3f}", f"{r['durable_first']:.3f}", f"{r['durable_later']:.3f}",
                       _mib(r["peak_extra"]), f"{r['peak_extra'] / (r['mib'] << 20):.2f}",
                       _mib(r["peak_run"]), f"{r['peak_run'] / (r['mib'] << 20):.2f}",
                       f"{_mib(r['pss_start'])}-{_mib(r['pss_end'])}"] for r in rows if "skipped" not in r]
    return "\n".join([_report.aligned(lines, 3), *_skipped(rows)])


def many_table(rows: list[dict[str, Any]]) -> str:
    """The ``async-many`` section: the PSS of the trainer and of its save process along the saves."""
    whens = ("before", "after 1", "after 10", "end")
    head = ["kind", "MiB", "method", "saves", *(f"trainer {w}" for w in whens), *(f"save process {w}" for w in whens),
            "trend 10-end MiB"]
    lines = [head] + [[r["kind"], str(r["mib"]), r["method"], str(r["saves"]),
                       *(_mib(r["processes"].get(w, {}).get("trainer", 0)) for w in whens),
                       *(_mib(r["processes"].get(w, {}).get("saver", 0)) for w in whens), _mib(_growth(r))]
                      for r in rows if "skipped" not in r]
    return "\n".join([_report.aligned(lines, 3), *_skipped(rows)])


def _skipped(rows: list[dict[str, Any]]) -> list[str]:
    return [f"{r['mib']} MiB skipped: it {r['skipped']}" for r in rows if "skipped" in r]


def _growth(row: dict[str, Any]) -> float:
    """The PSS growth of the trainer and its save process together from the tenth save to the last: the
    least-squares trend of the readings after every tenth save times the saves they span, as one reading spreads
    by 10-20 MiB either way and a leak makes a trend (with fewer readings, the last less the first)."""
    readings = {int(when.split()[1]): sum(pss.values()) for when, pss in row["processes"].items()
                if when.startswith("after ")}
    later = {n: total for n, total in readings.items() if n >= 10}
    if len(later) < 2:
        return sum(row["processes"]["end"].values()) - readings[1]
    trend = statistics.linear_regression(list(later), list(later.values()))
    return trend.slope * (max(later) - min(later))


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's goals, PASS or FAIL from the run."""
    found = {(r["kind"], r["mib"], r["method"]): r for r in rows if "skipped" not in r}
    out: list[dict[str, Any]] = []
    for (kind, mib, method), ours in found.items():
        copy = found.get((kind, mib, "copy"))
        if method == "taskpoint-resumed" and copy is not None:
            out += _goals(ours, [("blocked (first save of a process that resumes) <= 1.2x copy",
                                  ours["blocked_first"] / copy["blocked_later"], 1.2)])
        if method != "taskpoint":
            continue
        checks = [("peak extra memory (from before the first save) <= 1.3x the state",
                   ours["peak_run"] / (mib << 20), 1.3)]
        blocking = found.get((kind, mib, "taskpoint-blocking"))
        if copy is not None and blocking is not None:  # the async section's rows, not async-big's
            checks += [("blocked (first save) <= 1.2x copy", ours["blocked_first"] / copy["blocked_later"], 1.2),
                       ("blocked (later saves) <= 1.2x copy", ours["blocked_later"] / copy["blocked_later"], 1.2),
                       ("durable <= 1.1x blocking save", ours["durable_later"] / blocking["durable_later"], 1.1)]
        out += _goals(ours, checks)
    return out


def many_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The ``async-many`` goal of each of taskpoint's rows: PASS or FAIL from the run."""
    return [goal for r in rows if "skipped" not in r and r["method"] == "taskpoint"
            for goal in _goals(r, [(f"{r['saves']} saves, PSS flat (growth from the tenth <= {FLAT_SHARE}x the state "
                                    f"+ {FLAT_NOISE_BYTES >> 20} MiB)", _growth(r) / (r["mib"] << 20),
                                    FLAT_SHARE + FLAT_NOISE_BYTES / (r["mib"] << 20))])]


def _goals(row: dict[str, Any], checks: list[tuple[str, float, float]]) -> list[dict[str, Any]]:
    return [{"target": f"issue 43: {row['kind']} {what}", "case": f"local/{row['kind']}/{row['mib']} MiB",
             "measured": f"{ratio:.2f}x", "result": "PASS" if ratio <= bound else "FAIL",
             "note": f"median of {row['rounds']} rounds"} for what, ratio, bound in checks]
