"""The local-tier section of ``make bench`` (issue 24): a manager with ``local_dir`` against a raw local copy and
against restores from the S3 server.

The data: the dedup section's directory of float32 files (``--size`` GiB in all). The remote tier is the S3
server (the local store when ``--stores`` has no s3), the local tier a folder of the work directory. Per run, with
fresh managers and ``codec="none"`` (a plain tar: the ratio is then the tier's own cost, not gzip's, which a raw
copy does not pay), in this order:

1. **raw copy**: every file copied into a fresh local folder and fsynced (and the folder), the floor of any local
   commit of the same bytes;
2. **tiered save**: ``save(dir, step)`` with ``local_dir`` and ``remote_every=1``: the clock stops when the call
   returns (the local commit); the promotion then runs in the background and is waited for, unclocked;
3. **local restore**: ``restore(step, into=...)`` from the intact local tier;
4. **remote restore**: the same step restored by a manager of the remote tier alone (a replaced node);
5. **loop**: a single-threaded numpy loop timed alone, then the same number of iterations started right after the
   next tiered save returned, while its promotion runs; the ratio is the slowdown promotions cost a training loop.
   On this machine the S3 server shares the loop's two cores, and moto spends more CPU receiving the upload than
   the promotion spends sending it; so the loop runs once more beside a promotion with every thread of the server
   at ``nice`` 19 (:data:`FAR_NICE`), standing in for a store on another machine: what is left is the cost of
   taskpoint's own promotion (its process runs at ``nice`` +10). Both rows are reported.

Every restore is compared byte for byte with the data after its clock.
"""

from __future__ import annotations

import os
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from ._background import calibrate, work_unit
from ._dedup import _check_restored, build
from ._operations import fsync_tree
from ._runner import Options, _settle, open_store

METHOD = "tiers"
ROWS = (("raw", "raw copy + fsync to local disk"), ("save", "tiered save, blocking part"),
        ("local-restore", "restore from the local tier"), ("remote-restore", "restore from the remote tier"),
        ("loop", "loop alone"), ("loop-promoting", "loop while a promotion runs"),
        ("loop-promoting-far", "loop while a promotion runs, server at nice 19"))
#: The niceness of the S3 server's threads for the ``loop-promoting-far`` row.
FAR_NICE = 19


def _server_nice(pid: int | None, value: int) -> None:
    """Set the niceness of every thread of process ``pid`` (Linux: nice is per thread; threads the server starts
    later inherit it from its main thread)."""
    if pid is None:
        return
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.setpriority(os.PRIO_PROCESS, int(task.name), value)
        except ProcessLookupError:  # a request's thread that ended meanwhile
            continue


def _raw_copy(files: list[Path], folder: Path) -> None:
    """Copy ``files`` into ``folder`` and fsync each file and the folder: what a local commit cannot beat."""
    folder.mkdir(parents=True)
    for path in files:
        shutil.copyfile(path, folder / path.name)
    fsync_tree(folder)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _one_run(store: Any, opts: Options, files: list[Path], prefix: str, work: Path) -> dict[str, float]:
    from taskpoint import CheckpointManager

    data, out, local_dir = files[0].parent, work / "restored", work / "local"
    shutil.rmtree(local_dir, ignore_errors=True)
    shutil.rmtree(work / "raw", ignore_errors=True)
    res: dict[str, float] = {}
    _settle(store, opts)
    res["raw"] = _timed(lambda: _raw_copy(files, work / "raw"))
    shutil.rmtree(work / "raw", ignore_errors=True)
    with CheckpointManager(prefix, storage_options=store.storage_options, local_dir=local_dir, codec="none",
                           keep=2, preemption=False) as mgr:
        _settle(store, opts)
        res["save"] = _timed(lambda: mgr.save(data, 1))
        started = time.perf_counter()
        mgr.wait_until_finished()
        promotion = time.perf_counter() - started
        shutil.rmtree(out, ignore_errors=True)
        _settle(store, opts)
        res["local-restore"] = _timed(lambda: mgr.restore(1, into=out))
        _check_restored(data, out)
        with CheckpointManager(prefix, storage_options=store.storage_options, preemption=False) as remote:
            shutil.rmtree(out, ignore_errors=True)
            _settle(store, opts)
            res["remote-restore"] = _timed(lambda: remote.restore(1, into=out))
            _check_restored(data, out)
        shutil.rmtree(out, ignore_errors=True)
        unit = work_unit(opts.train_work if opts.train_work in ("numpy", "python") else "numpy")
        iterations = calibrate(unit, max(promotion, 0.2))
        _settle(store, opts)
        res["loop"] = _timed(lambda: [unit() for _ in range(iterations)])
        _settle(store, opts)
        mgr.save(data, 2)
        res["loop-promoting"] = _timed(lambda: [unit() for _ in range(iterations)])
        mgr.wait_until_finished()
        _settle(store, opts)
        _server_nice(store.server_pid, FAR_NICE)
        try:
            mgr.save(data, 3)
            res["loop-promoting-far"] = _timed(lambda: [unit() for _ in range(iterations)])
            mgr.wait_until_finished()
        finally:
            _server_nice(store.server_pid, 0)
    return res


def run(size: float, opts: Options, work: Path) -> list[dict[str, Any]]:
    """The medians of :data:`ROWS` over ``opts.runs`` runs, with the ratios of each run's medians."""
    shutil.rmtree(work, ignore_errors=True)
    files = build(work / "data", size)
    data_bytes = sum(p.stat().st_size for p in files)
    kind = "s3" if "s3" in opts.stores else "local"
    runs: list[dict[str, float]] = []
    error = None
    with open_store(kind, work, opts.log, opts.moto_fast_ranges) as store:
        for i in range(opts.runs):
            prefix = f"{store.root}/tiers/run{i}"
            try:
                runs.append(_one_run(store, opts, files, prefix, work))
            except Exception as exc:  # reported in the rows; the other sections still run
                error = f"{type(exc).__name__}: {exc}"
                opts.log(f"  tiers run {i + 1}/{opts.runs}: FAILED: {error}")
                break
            finally:
                store.clear(prefix)
            opts.log(f"  tiers run {i + 1}/{opts.runs}: " + ", ".join(f"{k} {v:.2f} s" for k, v in runs[-1].items()))
    shutil.rmtree(work, ignore_errors=True)
    if not runs:
        return [{"store": kind, "op": key, "error": error} for key, _ in ROWS]
    rows = []
    for key, _ in ROWS:
        seconds = statistics.median(r[key] for r in runs)
        row: dict[str, Any] = {"store": kind, "op": key, "seconds": seconds, "data_bytes": data_bytes}
        base = {"save": "raw", "remote-restore": None, "local-restore": "remote-restore",
                "loop-promoting": "loop", "loop-promoting-far": "loop"}.get(key)
        if base is not None:
            row["ratio"] = statistics.median(r[key] / r[base] for r in runs)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    """The section's table: seconds, MB/s of the data (not for the loop) and the ratio to its reference."""
    labels, refs = dict(ROWS), {"save": "x raw copy", "local-restore": "x remote restore",
                                "loop-promoting": "x loop alone", "loop-promoting-far": "x loop alone"}
    lines = [["store", "row", "s", "MB/s", "ratio"]]
    for r in rows:
        if r.get("seconds") is None:
            lines.append([r["store"], labels[r["op"]], "FAILED", "", r.get("error") or ""])
            continue
        rate = "" if r["op"].startswith("loop") else f"{r['data_bytes'] / r['seconds'] / 1e6:.0f}"
        ratio = f"{r['ratio']:.3f} {refs[r['op']]}" if "ratio" in r else ""
        lines.append([r["store"], labels[r["op"]], f"{r['seconds']:.3f}", rate, ratio])
    widths = [max(len(line[i]) for line in lines) for i in range(5)]
    return "\n".join("  ".join(c.ljust(w) if i < 2 or i == 4 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(line, widths, strict=True))) for line in lines)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 24's targets, from the ratios of one run."""
    get = {r["op"]: r for r in rows if r.get("ratio") is not None}
    out = []
    for op, text, bound in (("save", "tiered save's blocking part <= 1.2x a raw copy + fsync", 1.2),
                            ("local-restore", "restore from the local tier <= 0.2x from the remote tier", 0.2),
                            ("loop-promoting", "loop while promotions run <= 1.2x alone", 1.2),
                            ("loop-promoting-far", "the same, the S3 server at nice 19 <= 1.2x alone", 1.2)):
        r = get.get(op)
        out.append({"target": f"issue 24: {text}", "case": f"{r['store'] if r else '-'}/tiers/{op}",
                    "measured": "-" if r is None else f"{r['ratio']:.3f}x",
                    "result": "n/a" if r is None else ("PASS" if r["ratio"] <= bound else "FAIL"),
                    "note": "" if r is None else f"{r['seconds']:.2f} s"})
    return out
