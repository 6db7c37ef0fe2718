"""The subset section of ``make bench`` (issue 26): one file out of a step, against the full restore.

The data: a directory of ``--size`` GiB (1 GiB at size 1) of float32 "weights" (N(0, 0.02), which barely
compress): ``model.bin`` of :data:`MODEL_SHARE` of it (100 MiB at size 1) and :data:`OPTIMIZER_FILES` files of
optimizer state holding the rest, saved once per store as one plain step of ``CheckpointManager`` (gzip, its
archive indexed). Per run, in this order, each after the runner's wait and a warm page cache (as the dedup
section): the full restore (``restore(1, into=...)``), the subset (``restore(1, into=..., paths=["model.bin"])``)
and ``open(1, "model.bin").read()``. Every result is compared byte for byte with the data after its clock.
"""

from __future__ import annotations

import filecmp
import shutil
import statistics
from pathlib import Path
from typing import Any

from ._dedup import _measure, _stored_files, _write_weights
from ._runner import BUSY_CORES, Options, Store, open_store

METHOD = "subset"
#: The model file's share of the step: 100 MiB of 1 GiB.
MODEL_SHARE = 100 / 1024
OPTIMIZER_FILES = 9
SEED = 2626
ROWS = (
    ("full", "restore(step): the whole step"),
    ("subset", 'restore(step, paths=["model.bin"])'),
    ("open", 'open(step, "model.bin").read()'),
)
#: Issue 26: one file out of the step takes at most this share of the full restore's time.
TARGET = 0.15


def build(folder: Path, size: float) -> list[Path]:
    """The data set's files (all written now): the model, then the optimizer state."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    total = int(size * (1 << 30)) // 4 * 4
    model = int(total * MODEL_SHARE) // 4 * 4
    per_file = (total - model) // OPTIMIZER_FILES // 4 * 4
    files = [folder / "model.bin", *(folder / f"optimizer{i}.bin" for i in range(OPTIMIZER_FILES))]
    for i, path in enumerate(files):
        _write_weights(path, model if i == 0 else per_file, SEED + i)
    return files


def _check(data: Path, out: Path, names: list[str]) -> None:
    if sorted(p.name for p in out.iterdir()) != sorted(names) or not all(
            filecmp.cmp(data / name, out / name, shallow=False) for name in names):
        raise RuntimeError(f"the restore into {out} does not hold {names} of {data}")


def _one_run(store: Store, opts: Options, mgr: Any, files: list[Path], out: Path) -> dict[str, dict[str, Any]]:
    data = files[0].parent
    warm = files + _stored_files(store, mgr.directory)
    res: dict[str, dict[str, Any]] = {}
    shutil.rmtree(out, ignore_errors=True)
    res["full"] = _measure(store, opts, lambda: mgr.restore(1, into=out / "full"), warm)
    _check(data, out / "full", [p.name for p in files])
    res["subset"] = _measure(store, opts, lambda: mgr.restore(1, into=out / "subset", paths=["model.bin"]), warm)
    _check(data, out / "subset", ["model.bin"])
    read: list[bytes] = []

    def whole_file() -> None:
        with mgr.open(1, "model.bin") as f:
            read.append(f.read())

    res["open"] = _measure(store, opts, whole_file, warm)
    if read[0] != files[0].read_bytes():
        raise RuntimeError("open(1, 'model.bin') did not read the model's bytes")
    shutil.rmtree(out, ignore_errors=True)
    return res


def run(size: float, opts: Options, work: Path) -> list[dict[str, Any]]:
    """The rows of :data:`ROWS` per store: medians of ``opts.runs``, ratios to the full restore per run."""
    from taskpoint import CheckpointManager

    log = opts.log
    shutil.rmtree(work, ignore_errors=True)
    files = build(work / "data", size)
    data_bytes, model_bytes = sum(p.stat().st_size for p in files), files[0].stat().st_size
    log(f"subset: model.bin {model_bytes / 2**20:.1f} MiB in a step of {data_bytes / 2**20:.1f} MiB")
    rows: list[dict[str, Any]] = []
    for kind in opts.stores:
        with open_store(kind, work, log, opts.moto_fast_ranges) as store:
            runs: list[dict[str, dict[str, Any]]] = []
            error = None
            prefix = f"{store.root}/subset"
            store.clear(prefix)
            try:
                with CheckpointManager(prefix, storage_options=store.storage_options, keep=None,
                                       preemption=False) as mgr:
                    mgr.save(files[0].parent, 1, blocking=True)
                    for i in range(opts.runs):
                        runs.append(_one_run(store, opts, mgr, files, work / "restored"))
                        log(f"  subset {kind} run {i + 1}/{opts.runs}: " + ", ".join(
                            f"{key} {runs[-1][key]['seconds']:.2f} s" for key, _ in ROWS))
            except Exception as exc:  # a failed store is reported in its rows, the others still run
                error = f"{type(exc).__name__}: {exc}"
                log(f"  subset {kind}: FAILED: {error}")
            finally:
                store.clear(prefix)
            for key, _ in ROWS:
                row: dict[str, Any] = {"store": kind, "payload": "directory", "method": METHOD, "op": key,
                                       "error": error, "data_bytes": data_bytes, "model_bytes": model_bytes,
                                       "runs": [r[key] for r in runs]}
                if runs:
                    row.update(seconds=statistics.median(r[key]["seconds"] for r in runs),
                               cpu_s=statistics.median(r[key]["cpu_s"] for r in runs),
                               server_cpu_s=statistics.median(r[key]["server_cpu_s"] for r in runs),
                               other_cores=max(r[key]["other_cores"] for r in runs),
                               x_full=statistics.median(r[key]["seconds"] / r["full"]["seconds"] for r in runs))
                rows.append(row)
    shutil.rmtree(work, ignore_errors=True)
    return rows


def notes(size: float) -> str:
    return (f"one file out of a step (issue 26): CheckpointManager, one plain step (gzip, indexed) of {size:g} GiB "
            f"of float32, model.bin {MODEL_SHARE * size * 1024:.1f} MiB of it; x full = time / the full restore of "
            "the same run (median of per-run ratios); cpu s = this process's CPU; MB/s of the bytes restored")


def table(rows: list[dict[str, Any]]) -> str:
    labels = dict(ROWS)
    head = ["store", "row", "s", "MB/s", "x full", "cpu s", "srv cpu s", "others"]
    lines = [head]
    for r in rows:
        if r.get("seconds") is None:
            lines.append([r["store"], labels[r["op"]], "FAILED", *[""] * (len(head) - 3)])
            continue
        moved = r["data_bytes"] if r["op"] == "full" else r["model_bytes"]
        lines.append([r["store"], labels[r["op"]], f"{r['seconds']:.3f}", f"{moved / r['seconds'] / 1e6:.0f}",
                      f"{r['x_full']:.3f}", f"{r['cpu_s']:.2f}",
                      f"{r['server_cpu_s']:.2f}" if r["store"] == "s3" else "-",
                      f"{r['other_cores']:.2f}{'!' if r['other_cores'] > BUSY_CORES else ''}"])
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths,
                                                                                                strict=True)))
                     for line in lines)


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 26's target per store: one 100 MiB file out of a 1 GiB step at most 0.15x the full restore."""
    out = []
    for r in rows:
        if r["op"] == "subset" and r.get("seconds") is not None:
            full = next(f for f in rows if f["store"] == r["store"] and f["op"] == "full")
            out.append({"target": f"issue 26: one file out of a step <= {TARGET}x the full restore",
                        "case": f"{r['store']}/subset", "measured": f"{r['x_full']:.3f}x",
                        "result": "PASS" if r["x_full"] <= TARGET else "FAIL",
                        "note": f"{r['seconds']:.2f} s vs {full['seconds']:.2f} s"})
    return out
