"""What ``progress=`` costs: a folder saved and loaded on local disk with ``progress=False`` and with a callback.

    PYTHONPATH=src python benchmarks/progress_quick.py [--mib 256] [--runs 7]

The folder holds ``--mib`` MiB of float32 weights in four files. Each run saves (and loads) it once per
setting, the settings alternating within a run so that the load of the other processes on a shared machine
falls on both alike; the table gives the median and the fastest run of each, and their ratios, in wall time
and in this process's CPU time (all its threads: steadier than wall time on a busy machine). The callback
is a plain ``fsspec.callbacks.Callback`` (it counts, draws nothing): the cost of taskpoint's counting and
hand-over, not of a terminal.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
from fsspec.callbacks import Callback

from taskpoint import Checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="taskpoint-progress-bench-"))
    try:
        tree = root / "tree"
        tree.mkdir()
        rng = np.random.default_rng(0)
        for i in range(4):
            values = rng.standard_normal((args.mib << 20) // 16).astype(np.float32) * 0.02
            (tree / f"shard{i}.bin").write_bytes(values.tobytes())
        settings = {"progress=False": lambda: False, "callback": Callback}
        times: dict[tuple[str, str], list[float]] = {}
        cpu: dict[tuple[str, str], list[float]] = {}
        for run in range(args.runs):
            order = list(settings.items()) if run % 2 == 0 else list(reversed(settings.items()))
            for name, make in order:
                for op in ("save", "load"):
                    with Checkpoint(root / f"ckpt-{name}", root / "ckpt-saved",
                                    workspace=root / "out" if op == "load" else None) as cp:
                        if op == "load":
                            shutil.rmtree(root / "out", ignore_errors=True)
                        progress = make()
                        started, cpu_started = time.perf_counter(), time.process_time()
                        if op == "save":
                            cp.save_sync(tree, progress=progress)
                        else:
                            assert cp.load_sync(progress=progress) is not None
                        times.setdefault((op, name), []).append(time.perf_counter() - started)
                        cpu.setdefault((op, name), []).append(time.process_time() - cpu_started)
                        if isinstance(progress, Callback):
                            assert progress.value == progress.size
                    if op == "save":
                        shutil.copyfile(root / f"ckpt-{name}", root / "ckpt-saved")
                        shutil.copyfile(root / f"ckpt-{name}.taskpoint.json", root / "ckpt-saved.taskpoint.json")
        print(f"{args.mib} MiB folder (4 files), local disk, {args.runs} runs each, alternating\n")
        print("| operation | setting | median s | fastest s | median ratio | fastest ratio | median CPU s | "
              "CPU ratio |")
        print("|---|---|---|---|---|---|---|---|")
        for op in ("save", "load"):
            base, base_cpu = times[(op, "progress=False")], cpu[(op, "progress=False")]
            for name in settings:
                t, c = times[(op, name)], cpu[(op, name)]
                print(f"| {op} | {name} | {statistics.median(t):.3f} | {min(t):.3f} | "
                      f"{statistics.median(t) / statistics.median(base):.3f} | {min(t) / min(base):.3f} | "
                      f"{statistics.median(c):.3f} | {statistics.median(c) / statistics.median(base_cpu):.3f} |")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
