"""Turns the measurements into the table, the issue's targets with PASS/FAIL, the JSON and the PNG plot."""

from __future__ import annotations

import json
import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

MIB = 1 << 20
#: Methods in table order; "taskpoint" is the one the targets are about.
METHOD_ORDER = ("taskpoint", "taskpoint-progress", "taskpoint-async", "baseline", "raw", "raw-fsync")
TASKPOINT_METHODS = ("taskpoint", "taskpoint-async")
#: Above this many cores used by other processes during a case, its row is marked "!" (a busy machine).
BUSY_CORES = 0.25

Key = tuple[str, str, str, str]


def add_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row gains speedup over the baseline, time over raw, and stored size over the baseline's."""
    index = {(r["store"], r["payload"], r["op"], r["method"]): r for r in rows}
    for r in rows:
        if "seconds" not in r:
            continue
        base = index.get((r["store"], r["payload"], r["op"], "baseline"), {})
        raw = index.get((r["store"], r["payload"], r["op"], "raw"), {})
        if "seconds" in base and r["method"] != "baseline":
            r["speedup_vs_baseline"] = base["seconds"] / r["seconds"]
        if "seconds" in raw and r["method"] not in ("raw", "raw-fsync"):
            r["time_vs_raw"] = r["seconds"] / raw["seconds"]
        durable = index.get((r["store"], r["payload"], r["op"], "raw-fsync"), {})
        if "seconds" in durable and r["method"] in TASKPOINT_METHODS:
            r["time_vs_raw_fsync"] = r["seconds"] / durable["seconds"]
        if r["op"] == "save" and base.get("stored_bytes") and r["method"] != "baseline":
            r["stored_vs_baseline"] = r["stored_bytes"] / base["stored_bytes"]
    order = {m: i for i, m in enumerate(METHOD_ORDER)}
    return sorted(rows, key=lambda r: (r["store"], ("directory", "file", "bytes", "small").index(r["payload"]),
                                       ("save", "load").index(r["op"]), order.get(r["method"], 99)))


def _fmt(value: Any, spec: str, suffix: str = "") -> str:
    return "-" if value is None else f"{value:{spec}}{suffix}"


def table(rows: list[dict[str, Any]]) -> str:
    """The aligned plain-text table of every case."""
    header = ["store", "payload", "op", "method", "median s", "MB/s", "x vs base", "t/raw", "t/raw+fsync",
              "stored MiB",
              "size/base", "RSS+ MiB", "tmp+ MiB", "cpu s", "srv cpu s", "others", "runs"]
    lines = [header]
    for r in rows:
        if "seconds" not in r:
            lines.append([r["store"], r["payload"], r["op"], r["method"], "FAILED", *[""] * 12, "0"])
            continue
        stored = r.get("stored_bytes")
        lines.append([
            r["store"], r["payload"], r["op"], r["method"],
            _fmt(r["seconds"], ".3f"), _fmt(r["mb_per_s"], ".1f"),
            _fmt(r.get("speedup_vs_baseline"), ".2f", "x"), _fmt(r.get("time_vs_raw"), ".2f", "x"),
            _fmt(r.get("time_vs_raw_fsync"), ".2f", "x"),
            _fmt(stored / MIB if stored is not None else None, ".1f"), _fmt(r.get("stored_vs_baseline"), ".3f", "x"),
            _fmt(r["rss_extra_bytes"] / MIB, ".1f"), _fmt(r["temp_extra_bytes"] / MIB, ".1f"),
            _fmt(r["cpu_s"], ".2f"), _fmt(r["server_cpu_s"], ".2f"),
            _fmt(r.get("other_cores"), ".2f") + ("!" if r.get("other_cores", 0) > BUSY_CORES else " "),
            str(r["runs"]),
        ])
    return _align(lines, numeric_from=4)


def _align(lines: list[list[str]], numeric_from: int, left_from: int | None = None) -> str:
    """Columns padded to their widest cell: text left-aligned, numbers (from ``numeric_from``) right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    out = []
    for n, line in enumerate(lines):
        cells = [c.rjust(w) if numeric_from <= i < (left_from or len(line)) else c.ljust(w)
                 for i, (c, w) in enumerate(zip(line, widths, strict=True))]
        out.append("  ".join(cells).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


# -- targets -------------------------------------------------------------------------------------------


def targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The issue's targets, one row per measured instance, with PASS, FAIL or n/a (case not run)."""
    index: dict[Key, dict[str, Any]] = {(r["store"], r["payload"], r["op"], r["method"]): r for r in rows}
    out: list[dict[str, Any]] = []

    def get(store: str, payload: str, op: str, method: str = "taskpoint") -> dict[str, Any]:
        return index.get((store, payload, op, method), {})

    def check(target: str, case: str, value: float | None, ok: Callable[[float], bool], fmt: str,
              note: str = "") -> None:
        out.append({"target": target, "case": case, "value": value,
                    "measured": "-" if value is None else fmt.format(value),
                    "result": "n/a" if value is None else ("PASS" if ok(value) else "FAIL"), "note": note})

    def vs_durable(r: dict[str, Any]) -> str:
        v = r.get("time_vs_raw_fsync")
        return "" if v is None else f"{v:.2f}x the copy+fsync"

    store_name = {"local": "local disk", "s3": "S3 server"}
    for store, speed, vs_raw in (("local", 15.0, 1.5), ("s3", 5.0, 1.3)):
        r = get(store, "directory", "save")
        check(f"directory save, {store_name[store]}: >= {speed:g}x faster than baseline",
              f"{store}/directory/save", r.get("speedup_vs_baseline"), lambda v, s=speed: v >= s, "{:.2f}x")
        check(f"directory save, {store_name[store]}: <= {vs_raw:g}x the raw {'copy' if store == 'local' else 'put'}"
              " time", f"{store}/directory/save", r.get("time_vs_raw"), lambda v, s=vs_raw: v <= s, "{:.2f}x",
              vs_durable(r))
    for store in ("local", "s3"):
        check("directory load, local and S3: >= 2x faster than baseline", f"{store}/directory/load",
              get(store, "directory", "load").get("speedup_vs_baseline"), lambda v: v >= 2.0, "{:.2f}x")
    for payload in ("file", "bytes"):
        for op in ("save", "load"):
            for store in ("local", "s3"):
                r = get(store, payload, op)
                check("file and bytes save/load: within 1.2x of raw put/get", f"{store}/{payload}/{op}",
                      r.get("time_vs_raw"), lambda v: v <= 1.2, "{:.2f}x", vs_durable(r))
    for op in ("save", "load"):
        r = get("s3", "small", op)
        limit, requests = (3.0, 3) if op == "save" else (2.0, 2)
        check(f"issue 11: small (4 KiB) {op} on S3 vs Flyte's one object: <= {limit:g}x its time ({requests} "
              "requests vs 1)", f"s3/small/{op}", None if "speedup_vs_baseline" not in r
              else 1 / r["speedup_vs_baseline"], lambda v, limit=limit: v <= limit, "{:.2f}x")
    for store in ("local", "s3"):
        check("archive size at the default level: <= 1.02x the baseline's", f"{store}/directory/save",
              get(store, "directory", "save").get("stored_vs_baseline"), lambda v: v <= 1.02, "{:.4f}x")
    for store in ("local", "s3"):
        for op in ("save", "load"):
            values = [index[k]["rss_extra_bytes"] for k in index
                      if k[:3] == (store, "directory", op) and k[3] in TASKPOINT_METHODS and "seconds" in index[k]]
            check("peak RSS during 1 GiB save or load: < 300 MiB", f"{store}/directory/{op} (sync+async)",
                  max(values) / MIB if values else None, lambda v: v < 300, "{:.1f} MiB")
    for store in ("local", "s3"):
        for op in ("save", "load"):
            values = [index[k]["temp_extra_bytes"] for k in index
                      if k[0] == store and k[2] == op and k[3] in TASKPOINT_METHODS and "seconds" in index[k]]
            check("extra temp disk during save or load: 0 bytes", f"{store}/*/{op} (all payloads)",
                  max(values) if values else None, lambda v: v == 0, "{:.0f} B")
    for store in ("local", "s3"):
        for op in ("save", "load"):
            sync, asyn = get(store, "directory", op), get(store, "directory", op, "taskpoint-async")
            value = asyn["seconds"] / sync["seconds"] if "seconds" in sync and "seconds" in asyn else None
            check("async save/load: within 1.1x of the sync calls", f"{store}/directory/{op}", value,
                  lambda v: v <= 1.1, "{:.2f}x")
    return out


def targets_table(rows: list[dict[str, Any]]) -> str:
    lines = [["target (issue 3, or as marked)", "case", "measured", "result", "note"]]
    lines += [[t["target"], t["case"], t["measured"], t["result"], t["note"]] for t in rows]
    return _align(lines, numeric_from=2, left_from=4)


# -- background saves (issue 5) ------------------------------------------------------------------------

#: The manager's operations (benchmarks/_background.py), in table order, with what each row is.
BACKGROUND_CASES = {
    "save": "save(dir, step), blocking",
    "save-bg": "save(dir, step, blocking=False): the call",
    "train": "loop: K x work, no saves",
    "train-bg": "loop: K x (work, then save(blocking=False))",
    "train-paced": "paced loop: K x work', no saves",
    "train-bg-paced": "paced loop: K x (work', then save(blocking=False))",
}
#: Each loop with saves, and the loop without saves it is compared with.
_LOOPS = {"train-bg": "train", "train-bg-paced": "train-paced"}


def add_background_ratios(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The manager's rows gain the ratios of issue 5's targets; returned in table order."""
    index = {(r["store"], r["op"]): r for r in rows}
    for r in rows:
        if "seconds" not in r:
            continue
        blocking = index.get((r["store"], "save"), {})
        plain = index.get((r["store"], _LOOPS.get(r["op"], "train")), {})
        if r["op"] == "save-bg" and "seconds" in blocking:
            r["ratio"], r["ratio_is"] = r["seconds"] / blocking["seconds"], "call / blocking save"
            if "total_seconds" in r:
                r["total_vs_blocking"] = r["total_seconds"] / blocking["seconds"]
        if r["op"] in _LOOPS and "seconds" in plain:
            r["ratio"], r["ratio_is"] = r["seconds"] / plain["seconds"], "loop / loop without saves"
            if "total_seconds" in r:
                r["total_vs_no_saves"] = r["total_seconds"] / plain["seconds"]
            if plain.get("compute_seconds") and r.get("compute_seconds"):
                r["compute_vs_no_saves"] = r["compute_seconds"] / plain["compute_seconds"]
    order = list(BACKGROUND_CASES)
    return sorted(rows, key=lambda r: (r["store"], order.index(r["op"]) if r["op"] in order else 99))


def background_table(rows: list[dict[str, Any]]) -> str:
    """The manager's rows: one table, and a line per store on the loop's calibration and where time went."""
    header = ["store", "case", "median s", "ratio", "ratio is", "committed s", "stored MiB", "RSS+ MiB",
              "tmp+ MiB", "cpu s", "srv cpu s", "others", "runs"]
    lines = [header]
    for r in rows:
        name = BACKGROUND_CASES.get(r["op"], r["op"])
        if "seconds" not in r:
            lines.append([r["store"], name, "FAILED", *[""] * 9, "0"])
            continue
        committed = r.get("total_seconds", r["seconds"]) if r["op"] not in _LOOPS.values() else None
        stored = r.get("stored_bytes")
        lines.append([
            r["store"], name, _fmt(r["seconds"], ".3f"), _fmt(r.get("ratio"), ".3f", "x"), r.get("ratio_is", ""),
            _fmt(committed, ".3f"), _fmt(stored / MIB if stored is not None else None, ".1f"),
            _fmt(r["rss_extra_bytes"] / MIB, ".1f"), _fmt(r["temp_extra_bytes"] / MIB, ".1f"),
            _fmt(r["cpu_s"], ".2f"), _fmt(r["server_cpu_s"], ".2f"),
            _fmt(r.get("other_cores"), ".2f") + ("!" if r.get("other_cores", 0) > BUSY_CORES else " "),
            str(r["runs"]),
        ])
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    out = []
    for n, line in enumerate(lines):
        out.append("  ".join(c.ljust(w) if i in (0, 1, 4) else c.rjust(w)
                             for i, (c, w) in enumerate(zip(line, widths, strict=True))).rstrip())
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    text = "\n".join(out)
    notes = []
    index = {(r["store"], r["op"]): r for r in rows}
    for store in sorted({r["store"] for r in rows}):
        for loop, plain_op in _LOOPS.items():
            plain, saving = index.get((store, plain_op), {}), index.get((store, loop), {})
            if "seconds" not in plain:
                continue
            k = plain.get("iterations") or 1
            if loop == "train-bg":
                pace = f"calibrated to the blocking save ({plain.get('iteration_target_seconds', 0):.2f} s)"
            else:
                pace = (f"work' calibrated to one background save beside the work "
                        f"({saving.get('upload_beside_work_seconds', 0):.2f} s)")
            note = (f"{store}, {'paced loop' if loop != 'train-bg' else 'loop'}: K = {k:g} iterations of "
                    f"{plain.get('work_units', 0):.0f} units of {plain.get('work')} work, {pace}; without saves "
                    f"one iteration took {plain['seconds'] / k:.2f} s")
            if "seconds" in saving:
                note += (f"; with saves the work took {saving.get('compute_seconds', 0):.2f} s "
                         f"({saving.get('compute_vs_no_saves', 0):.2f}x), the save calls "
                         f"{saving.get('save_call_seconds', 0):.2f} s "
                         f"(snapshots, and waits for the previous save); the work's thread waited "
                         f"{saving.get('work_thread_wait_seconds', 0):.2f} s for a core (without saves "
                         f"{plain.get('work_thread_wait_seconds', 0):.2f} s) while the saves used "
                         f"{saving.get('other_threads_cpu_seconds', 0):.2f} s of CPU in the worker's other threads "
                         f"and {saving.get('helper_loop_cpu_seconds', 0):.2f} s in the save process; the last save "
                         f"committed {saving.get('drain_seconds', 0):.2f} s after the loop "
                         f"({saving.get('total_vs_no_saves', 0):.2f}x the loop without saves, that wait included)")
            notes.append(textwrap.fill(note, 120, subsequent_indent="  "))
    return text + ("\n\n" + "\n".join(notes) if notes else "")


def background_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 5's two targets per store, with PASS, FAIL or n/a (case not run)."""
    index = {(r["store"], r["op"]): r for r in rows}
    out: list[dict[str, Any]] = []
    store_name = {"local": "local disk", "s3": "S3 server"}
    specs = [  # (op, target text, bound, key of the "until committed" ratio, note for it)
        ("save-bg", "background save call <= 0.15x a blocking save", 0.15, "total_vs_blocking",
         "committed after {:.2f}x the blocking save"),
        ("train-bg", "loop with background saves <= 1.2x without, saving every blocking-save time", 1.2,
         "total_vs_no_saves", "{:.2f}x until the last save committed"),
        ("train-bg-paced", "loop with background saves <= 1.2x without, saving every background-save time", 1.2,
         "total_vs_no_saves", "{:.2f}x until the last save committed"),
    ]
    for op, text, bound, total_key, note_text in specs:
        for store in ("local", "s3"):
            r = index.get((store, op), {})
            value = r.get("ratio")
            note = "" if r.get(total_key) is None else note_text.format(r[total_key])
            out.append({"target": f"issue 5: {text} ({store_name[store]})",
                        "case": f"{store}/directory/{op}", "value": value,
                        "measured": "-" if value is None else f"{value:.3f}x",
                        "result": "n/a" if value is None else ("PASS" if value <= bound else "FAIL"), "note": note})
    return out


# -- files ---------------------------------------------------------------------------------------------


def aligned(lines: list[list[str]], left: int) -> str:
    """Rows of cells as text columns: the first ``left`` columns aligned left, the others right."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join("  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths,
                                                                                                strict=True)))
                     for line in lines)


def write_json(path: Path, meta: dict[str, Any], rows: list[dict[str, Any]], goals: list[dict[str, Any]],
               text: str) -> None:
    path.write_text(json.dumps({"meta": meta, "cases": rows, "targets": goals, "table": text}, indent=1))


def plot(path: Path, rows: list[dict[str, Any]], title: str) -> None:
    """MB/s of every case, one panel per store, bars grouped by payload and operation (log scale)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    stores = sorted({r["store"] for r in rows}, key=lambda s: ("local", "s3").index(s) if s in ("local", "s3") else 9)
    groups = [(p, o) for p in ("directory", "file", "bytes", "small") for o in ("save", "load")
              if any(r["payload"] == p and r["op"] == o for r in rows)]
    methods = [m for m in METHOD_ORDER if any(r["method"] == m for r in rows)]
    colors = {"taskpoint": "#1f77b4", "taskpoint-progress": "#2ca02c",
              "taskpoint-async": "#7fb2dc", "baseline": "#d62728", "raw": "#7f7f7f",
              "raw-fsync": "#bfbfbf"}
    fig, axes = plt.subplots(1, len(stores), figsize=(6.5 * len(stores), 4.8), squeeze=False, sharey=True)
    width = 0.8 / max(1, len(methods))
    for ax, store in zip(axes[0], stores, strict=True):
        for i, method in enumerate(methods):
            xs, ys = [], []
            for g, (payload, op) in enumerate(groups):
                r = next((r for r in rows if (r["store"], r["payload"], r["op"], r["method"]) ==
                          (store, payload, op, method) and "mb_per_s" in r), None)
                if r is not None:
                    xs.append(g + (i - (len(methods) - 1) / 2) * width)
                    ys.append(r["mb_per_s"])
            if xs:
                bars = ax.bar(xs, ys, width, color=colors.get(method))
                ax.bar_label(bars, fmt="%.0f", fontsize=6, padding=1)
        ax.set_xticks(range(len(groups)), [f"{p}\n{o}" for p, o in groups], fontsize=8)
        ax.set_yscale("log")
        ax.set_title({"local": "local disk", "s3": "S3 (moto on 127.0.0.1)"}.get(store, store))
        ax.grid(axis="y", alpha=0.3, which="both")
    axes[0][0].set_ylabel("MB/s of the payload's logical size (median)")
    from matplotlib.patches import Patch

    axes[0][-1].legend(handles=[Patch(color=colors.get(m), label=m) for m in methods], fontsize=8,
                       loc="upper right")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
