"""The dedup section of ``make bench`` (issue 15): deduplicated steps of ``CheckpointManager`` against today's.

The data: a directory of :data:`FILES` files of float32 "weights" (N(0, 0.02)), ``--size`` GiB in all (1 GiB at
size 1: 20 files of 51.2 MiB), written once per section into its work folder. Per store and per run, with a
fresh pair of managers (``keep=None``), in this order:

1. today's save: ``CheckpointManager(dedup=False).save(dir, 1)`` (the whole directory, one gzip archive), and
   its restore (``restore(1, into=...)``);
2. the first deduplicated save, ``CheckpointManager(dedup=True).save(dir, 1)`` (every chunk uploaded);
3. step 2, nothing changed;
4. step 3, after :data:`CHANGED` of the files (10%) were rewritten with new random weights right before the
   save, as a training step writes them;
5. the restore of step 3 from the deduplicated store.

Once per section, on the first store of ``--stores``: the bytes stored after :data:`HISTORY` steps, each saved
right after rewriting a different 10% of the files, in both formats (``keep=None``: all steps kept).

Honest about the cache a real run has: every data file is at least :data:`MIN_AGE` seconds old before the first
deduplicated save (a frozen base model was written long before; a file modified less than 2 s before the save
that read it is never trusted by an lstat cache, git's racily-clean rule). Before each measured operation the
runner's wait (``--settle``, then until the machine is quiet), then one read of the data files (``cat`` to
/dev/null) and, for a local restore, of the manager's stored files: both formats start from a warm page cache.
"""

from __future__ import annotations

import filecmp
import itertools
import resource
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._runner import BUSY_CORES, Options, OtherLoad, Store, _process_cpu_seconds, _settle, open_store

METHOD = "dedup"
FILES = 20
#: Files rewritten before a "10% changed" step: a tenth of :data:`FILES`.
CHANGED = FILES // 10
#: Steps of the stored-bytes comparison, each rewriting a different :data:`CHANGED` files.
HISTORY = 10
#: Seconds every data file must have aged before the first deduplicated save (git's racy window is 2 s).
MIN_AGE = 2.5
SEED = 1515
#: Rows of the timed table, in order: (key, what it is).
ROWS = (
    ("today-save", "today: save(dir), dedup=False, full"),
    ("today-restore", "today: restore"),
    ("first", "dedup: first save, full"),
    ("unchanged", "dedup: step, nothing changed"),
    ("changed", f"dedup: step, {CHANGED}/{FILES} files rewritten"),
    ("restore", "dedup: restore of that step"),
)
_seeds = itertools.count(SEED + 1000)


def _write_weights(path: Path, nbytes: int, seed: int) -> None:
    import numpy as np

    values = np.random.default_rng(seed).standard_normal(nbytes // 4, dtype=np.float32)
    values *= 0.02
    values.tofile(path)


def build(folder: Path, size: float) -> list[Path]:
    """The data set's files (all written now)."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    per_file = int(size * (1 << 30) / FILES) // 4 * 4
    files = [folder / f"layer{i:02d}.bin" for i in range(FILES)]
    for i, path in enumerate(files):
        _write_weights(path, per_file, SEED + i)
    return files


def _rewrite(files: list[Path], first: int) -> None:
    """Rewrite :data:`CHANGED` files from ``first`` (in place, new random weights, same size)."""
    for path in (files[(first + i) % len(files)] for i in range(CHANGED)):
        _write_weights(path, path.stat().st_size, next(_seeds))


def _age(files: list[Path], log: Any) -> float:
    """Sleep until every file is :data:`MIN_AGE` seconds old; return the seconds slept."""
    wait = max(0.0, MIN_AGE - (time.time() - max(p.stat().st_mtime for p in files)))
    if wait:
        log(f"  dedup: waiting {wait:.1f} s so every data file is {MIN_AGE:g} s old before the first dedup save")
        time.sleep(wait)
    return wait


def _warm(paths: list[Path]) -> None:
    if paths:
        subprocess.run(["cat", *map(str, paths)], stdout=subprocess.DEVNULL, check=True)


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _measure(store: Store, opts: Options, fn: Callable[[], Any], warm: list[Path],
             before: Callable[[], Any] | None = None) -> dict[str, Any]:
    """Settle, run ``before`` (unclocked), warm the page cache with ``warm``, then time ``fn``."""
    _settle(store, opts)
    if before is not None:
        before()
    _warm(warm)
    server0, cpu0 = _process_cpu_seconds(store.server_pid), _cpu()
    others = OtherLoad(store.server_pid)
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "cpu_s": _cpu() - cpu0, "other_cores": others.cores_since_mark(),
            "server_cpu_s": _process_cpu_seconds(store.server_pid) - server0}


def _stored_files(store: Store, uri: str) -> list[Path]:
    return [p for p in Path(uri).rglob("*") if p.is_file()] if store.kind == "local" else []


def _save(mgr: Any, data: Path, step: int) -> Callable[[], Any]:
    return lambda: mgr.save(data, step)


def _restore(mgr: Any, step: int, out: Path) -> Callable[[], Any]:
    return lambda: mgr.restore(step, into=out)


def _check_restored(data: Path, out: Path) -> None:
    """After the clock: the restored tree holds the data set's files, byte for byte."""
    names = sorted(p.name for p in data.iterdir())
    if sorted(p.name for p in out.iterdir()) != names or not all(
            filecmp.cmp(data / name, out / name, shallow=False) for name in names):
        raise RuntimeError(f"the restore into {out} is not the data set of {data}")


def _one_run(store: Store, opts: Options, files: list[Path], prefix: str, out: Path) -> dict[str, dict[str, Any]]:
    """Every row of :data:`ROWS` once, with fresh managers under ``prefix``."""
    from taskpoint import CheckpointManager

    data, options = files[0].parent, store.storage_options
    res: dict[str, dict[str, Any]] = {}
    with CheckpointManager(f"{prefix}/today", storage_options=options, keep=None, preemption=False) as today:
        res["today-save"] = _measure(store, opts, _save(today, data, 1), files)
        res["today-save"]["uploaded_bytes"] = today.last_save.bytes if today.last_save else 0
        shutil.rmtree(out, ignore_errors=True)
        res["today-restore"] = _measure(store, opts, _restore(today, 1, out),
                                        files + _stored_files(store, f"{prefix}/today"))
        _check_restored(data, out)
    shutil.rmtree(out, ignore_errors=True)
    with CheckpointManager(f"{prefix}/dedup", storage_options=options, keep=None, preemption=False,
                           dedup=True) as dedup:
        _age(files, opts.log)
        rewrite: Callable[[], Any] = lambda: _rewrite(files, 0)  # noqa: E731
        for key, step, before in (("first", 1, None), ("unchanged", 2, None), ("changed", 3, rewrite)):
            res[key] = _measure(store, opts, _save(dedup, data, step), files, before)
            res[key]["uploaded_bytes"] = dedup.last_save.bytes if dedup.last_save else 0
        res["restore"] = _measure(store, opts, _restore(dedup, 3, out),
                                  files + _stored_files(store, f"{prefix}/dedup"))
        _check_restored(data, out)
    shutil.rmtree(out, ignore_errors=True)
    return res


def history(store: Store, files: list[Path], prefix: str, log: Any) -> dict[str, Any]:
    """Stored bytes after :data:`HISTORY` steps, each right after rewriting a different tenth of the files."""
    from taskpoint import CheckpointManager

    data, options = files[0].parent, store.storage_options
    start = time.perf_counter()
    with CheckpointManager(f"{prefix}/today", storage_options=options, keep=None, preemption=False) as today, \
            CheckpointManager(f"{prefix}/dedup", storage_options=options, keep=None, preemption=False,
                              dedup=True) as dedup:
        for step in range(1, HISTORY + 1):
            _rewrite(files, (step - 1) * CHANGED)
            dedup.save(data, step)
            today.save(data, step)
        if len(today.steps()) != HISTORY or len(dedup.steps()) != HISTORY:
            raise RuntimeError("a manager did not keep all its steps")
    out: dict[str, Any] = {"store": store.kind, "steps": HISTORY, "data_bytes": sum(p.stat().st_size for p in files),
           "dedup_bytes": store.stored_bytes(f"{prefix}/dedup"), "today_bytes": store.stored_bytes(f"{prefix}/today")}
    out["ratio"] = out["dedup_bytes"] / out["today_bytes"]
    log(f"  dedup {store.kind}: {HISTORY} steps stored: dedup {out['dedup_bytes'] / 2**20:.1f} MiB, today "
        f"{out['today_bytes'] / 2**20:.1f} MiB ({out['ratio']:.3f}x), in {time.perf_counter() - start:.0f} s")
    return out


def _summary(kind: str, key: str, runs: list[dict[str, dict[str, Any]]], data_bytes: int,
             error: str | None) -> dict[str, Any]:
    row: dict[str, Any] = {"store": kind, "payload": "directory", "method": METHOD, "op": key, "error": error,
                           "data_bytes": data_bytes, "runs": [r[key] for r in runs]}
    if not runs:
        return row
    reference = "today-restore" if key in ("today-restore", "restore") else "today-save"
    row.update(seconds=statistics.median(r[key]["seconds"] for r in runs),
               cpu_s=statistics.median(r[key]["cpu_s"] for r in runs),
               server_cpu_s=statistics.median(r[key]["server_cpu_s"] for r in runs),
               other_cores=max(r[key]["other_cores"] for r in runs),
               x_today=statistics.median(r[key]["seconds"] / r[reference]["seconds"] for r in runs))
    if key not in ("today-restore", "restore"):
        row["x_full"] = statistics.median(r[key]["seconds"] / r["first"]["seconds"] for r in runs)
        row["uploaded_bytes"] = statistics.median(r[key]["uploaded_bytes"] for r in runs)
    return row


def run(size: float, opts: Options, work: Path) -> tuple[list[dict[str, Any]], dict[str, Any] | None]:
    """The rows of :data:`ROWS` per store (medians of ``opts.runs``; ratios per run, then their median), and the
    stored bytes of :data:`HISTORY` steps on the first store."""
    log = opts.log
    shutil.rmtree(work, ignore_errors=True)
    files = build(work / "data", size)
    data_bytes = sum(p.stat().st_size for p in files)
    log(f"dedup: {len(files)} files of {files[0].stat().st_size / 2**20:.1f} MiB of float32 in {work / 'data'}")
    rows: list[dict[str, Any]] = []
    stored = None
    for kind in opts.stores:
        with open_store(kind, work, log, opts.moto_fast_ranges) as store:
            runs: list[dict[str, dict[str, Any]]] = []
            error = None
            for i in range(opts.runs):
                prefix = f"{store.root}/dedup/run{i}"
                store.clear(prefix)
                try:
                    result = _one_run(store, opts, files, prefix, work / "restored")
                except Exception as exc:  # a failed store is reported in its rows, the others still run
                    error = f"{type(exc).__name__}: {exc}"
                    log(f"  dedup {kind} run {i + 1}/{opts.runs}: FAILED: {error}")
                    break
                finally:
                    store.clear(prefix)
                runs.append(result)
                log(f"  dedup {kind} run {i + 1}/{opts.runs}: " + ", ".join(
                    f"{key} {result[key]['seconds']:.2f} s" for key, _ in ROWS))
            rows += [_summary(kind, key, runs, data_bytes, error) for key, _ in ROWS]
            if stored is None and error is None:
                prefix = f"{store.root}/dedup/history"
                try:
                    stored = history(store, files, prefix, log)
                except Exception as exc:  # reported under the table; the timed rows stand
                    stored = {"store": kind, "error": f"{type(exc).__name__}: {exc}"}
                    log(f"  dedup {kind}: stored bytes FAILED: {stored['error']}")
                finally:
                    store.clear(prefix)
    shutil.rmtree(work, ignore_errors=True)
    return rows, stored


def notes(size: float, opts: Options) -> str:
    """What the section measured and how, printed above its table."""
    per_file = int(size * (1 << 30) / FILES) // 4 * 4
    return (f"deduplicated steps (issue 15): CheckpointManager(keep=None) on a directory of {FILES} float32 files "
            f"of {per_file / 2**20:.1f} MiB ({FILES * per_file / 2**20:.0f} MiB), today's format (dedup=False: one "
            "gzip archive) against dedup=True (4 MiB chunks, zstd), fresh managers per run. Every data file is at "
            f"least {MIN_AGE:g} s old before the first dedup save (a frozen base model is old; a file modified "
            "under 2 s before a save is never trusted by an lstat cache, git's racily-clean rule); the rewritten "
            "files are written right before their save, as a training step writes them, and nothing else is "
            f"touched between rows. Before each measured operation: the runner's wait ({opts.settle:g} s, then "
            "until the machine is quiet), then one read of the data files (cat > /dev/null) and, for a local "
            "restore, of the manager's stored files, so both formats start from a warm page cache. x full = time / "
            "the dedup first save of the same run; x today = time / today's save (restores: today's restore); both "
            "are medians of per-run ratios. uploaded = mgr.last_save.bytes (what crossed the wire), % of the data. "
            "Every restore is compared byte for byte with the data after its clock.")


def table(rows: list[dict[str, Any]], stored: dict[str, Any] | None) -> str:
    """The section's table, then the stored bytes (MB = 10^6 bytes)."""
    labels = dict(ROWS)
    head = ["store", "row", "s", "MB/s", "x full", "x today", "uploaded MiB", "uploaded %", "cpu s", "srv cpu s",
            "others"]
    lines = [head]
    for r in rows:
        if r.get("seconds") is None:
            lines.append([r["store"], labels[r["op"]], "FAILED", *[""] * (len(head) - 3)])
            continue
        sent = r.get("uploaded_bytes")
        lines.append([r["store"], labels[r["op"]], f"{r['seconds']:.3f}", f"{r['data_bytes'] / r['seconds'] / 1e6:.0f}",
                      f"{r['x_full']:.3f}" if "x_full" in r else "", f"{r['x_today']:.3f}",
                      "" if sent is None else f"{sent / 2**20:.1f}",
                      "" if sent is None else f"{100 * sent / r['data_bytes']:.2f}", f"{r['cpu_s']:.2f}",
                      f"{r['server_cpu_s']:.2f}" if r["store"] == "s3" else "-",
                      f"{r['other_cores']:.2f}{'!' if r['other_cores'] > BUSY_CORES else ''}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    text = "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths,
                                                                                               strict=True)))
                     for line in lines)
    if stored and "error" in stored:
        text += f"\n\nstored bytes after {HISTORY} steps ({stored['store']}): FAILED: {stored['error']}"
    elif stored:
        text += (f"\n\nstored bytes after {stored['steps']} steps, each saved right after rewriting a different "
                 f"{CHANGED}/{FILES} of the files ({stored['store']}, keep=None): dedup "
                 f"{stored['dedup_bytes'] / 2**20:.1f} MiB, today's format {stored['today_bytes'] / 2**20:.1f} MiB "
                 f"({stored['steps']} full steps): {stored['ratio']:.3f}x; the data is "
                 f"{stored['data_bytes'] / 2**20:.1f} MiB")
    return text


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 15's targets, per store, from the ratios of the same run."""
    out = []
    for store in dict.fromkeys(r["store"] for r in rows):
        get = {r["op"]: r for r in rows if r["store"] == store and r.get("seconds") is not None}
        if len(get) < len(ROWS):
            continue
        data = get["first"]["data_bytes"]

        def check(target: str, key: str, ok: bool, shown: str, note: str, store: str = store) -> None:
            out.append({"target": f"issue 15: {target}", "case": f"{store}/dedup/{key}", "measured": shown,
                        "result": "PASS" if ok else "FAIL", "note": note})

        first, today = get["first"], get["today-save"]
        check("dedup first save <= 1.1x today's save", "first", first["x_today"] <= 1.1,
              f"{first['x_today']:.2f}x", f"{first['seconds']:.2f} s vs {today['seconds']:.2f} s")
        for key, upload, time_limit in (("unchanged", 0.01, 0.10), ("changed", 0.12, 0.20)):
            r = get[key]
            share = r["uploaded_bytes"] / data
            what = "nothing changed" if key == "unchanged" else f"{CHANGED}/{FILES} files rewritten"
            strict = share < upload if key == "unchanged" else share <= upload
            check(f"step, {what}: uploads {'<' if key == 'unchanged' else '<='} {upload:.0%} of the bytes", key,
                  strict, f"{share:.2%}", f"{r['uploaded_bytes'] / 2**20:.1f} MiB of {data / 2**20:.0f} MiB")
            check(f"step, {what}: <= {time_limit:.2f}x a full save", key, r["x_full"] <= time_limit,
                  f"{r['x_full']:.3f}x", f"{r['seconds']:.2f} s; x today's save {r['x_today']:.3f}")
        restore = get["restore"]
        check("dedup restore <= today's restore", "restore", restore["x_today"] <= 1.0,
              f"{restore['x_today']:.2f}x", f"{restore['seconds']:.2f} s vs {get['today-restore']['seconds']:.2f} s")
    return out
