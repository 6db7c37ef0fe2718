"""The plot of docs/performance.md: seconds per operation of taskpoint, the Flyte-style baseline and the raw copy,
from the numbers of the benchmark's table (benchmarks/results/bench.json, written by make bench).

    python -m benchmarks.plot_docs [--results benchmarks/results/bench.json] [--out docs/performance.png]

make bench writes its own MB/s plot beside the table (bench.png); this one answers the reader's question,
"how long does my save take, against what I have now and against the copy that cannot be beaten".
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
METHODS = {"taskpoint": ("taskpoint", "#1f77b4"), "baseline": ("Flyte-style baseline", "#d62728"),
           "raw": ("raw copy (no archive, no checks)", "#9e9e9e")}
CASES = [(p, o) for p in ("directory", "file", "bytes") for o in ("save", "load")]
STORES = {"local": "local disk", "s3": "S3 (moto on 127.0.0.1)"}


def plot(cases: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = meta["dataset"]["sizes"]
    fig, axes = plt.subplots(1, len(STORES), figsize=(13, 5.2), sharex=True)
    height = 0.26
    for ax, (store, title) in zip(axes, STORES.items(), strict=True):
        for i, (payload, op) in enumerate(CASES):
            row = {c["method"]: c for c in cases if (c["store"], c["payload"], c["op"]) == (store, payload, op)}
            for j, (method, (label, color)) in enumerate(METHODS.items()):
                if method not in row or row[method]["seconds"] is None:
                    continue
                seconds = row[method]["seconds"]
                y = i + (j - 1) * height
                ax.barh(y, seconds, height, color=color, label=label if i == 0 else None)
                note = f"{seconds:.2f} s"
                speedup = row[method].get("speedup_vs_baseline") if method == "taskpoint" else None
                if speedup:
                    note += f"  ({speedup:.1f}x faster)" if speedup >= 1 else f"  ({1 / speedup:.1f}x slower)"
                ax.text(seconds * 1.08, y, note, va="center", fontsize=7.5)
        ax.set_yticks(range(len(CASES)))
        ax.set_yticklabels([f"{p} {o}\n({sizes[p] / 2**20:.0f} MiB)" for p, o in CASES], fontsize=8.5)
        ax.invert_yaxis()
        ax.set_xscale("log")
        ax.set_xlim(0.02, 200)
        ax.set_xlabel("seconds, median (log scale; shorter is better)")
        ax.set_title(title)
        ax.grid(axis="x", which="both", alpha=0.3)
    axes[0].legend(loc="lower right", fontsize=8)
    fig.suptitle(f"make bench, size {meta['size']:g}: median of {meta['runs']} runs "
                 f"(baseline {meta['baseline_runs']}), codec {meta['codec']}, {meta['cpus']} cores, "
                 f"{meta['date'][:10]}", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--results", type=Path, default=REPO / "benchmarks/results/bench.json")
    parser.add_argument("--out", type=Path, default=REPO / "docs/performance.png")
    args = parser.parse_args(argv)
    data = json.loads(args.results.read_text())
    plot(data["cases"], data["meta"], args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
