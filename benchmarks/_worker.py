"""One measured operation in a fresh interpreter: ``python -m benchmarks._worker SPEC.json RESULT.json``.

The libraries are imported and the operation prepared first; then the peak-RSS mark is reset
(``/proc/self/clear_refs``), the operation runs, and the result records its seconds, CPU time and the
peak RSS above the idle interpreter (``VmHWM`` after minus ``VmRSS`` before).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ._background import METHOD as MANAGER_METHOD
from ._background import ManagerOperation, children
from ._operations import Case, Operation


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


class _PeakRss:
    """Peak RSS during a block: the kernel's high-water mark, reset at the start; else a 5 ms sampler."""

    def __init__(self) -> None:
        self.peak_kib = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> _PeakRss:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak_kib = max(self.peak_kib, _status_kib("VmRSS"))

    def __exit__(self, *exc: object) -> None:
        if self._thread is None:
            self.peak_kib = _status_kib("VmHWM")
        else:
            self._stop.set()
            self._thread.join()
        self.peak_kib = max(self.peak_kib, _status_kib("VmRSS"))


def measure(case: Case) -> dict[str, Any]:
    op: Operation | ManagerOperation = ManagerOperation(case) if case.method == MANAGER_METHOD else Operation(case)
    gc.collect()
    idle_kib = _status_kib("VmRSS")
    cpu0, children0 = os.times(), children()
    with _PeakRss() as rss:
        seconds = op.run()
    cpu1, children1 = os.times(), children()  # before report(): the manager's save process is still alive
    # A background save's work happens in the manager's save process: its CPU during the operation, and its
    # peak RSS since it started (whole: an upper bound, as the two peaks need not coincide), count too.
    helper_cpu = sum(cpu - children0.get(pid, (0.0, 0))[0] for pid, (cpu, _) in children1.items())
    helper_kib = sum(hwm for _, hwm in children1.values())
    result: dict[str, Any] = {
        "seconds": seconds,
        "cpu_user_s": cpu1.user - cpu0.user,
        "cpu_system_s": cpu1.system - cpu0.system,
        "helper_cpu_s": helper_cpu,
        "helper_rss_peak_bytes": helper_kib * 1024,
        "rss_idle_bytes": idle_kib * 1024,
        "rss_peak_bytes": rss.peak_kib * 1024,
        "rss_extra_bytes": (max(0, rss.peak_kib - idle_kib) + helper_kib) * 1024,
    }
    result.update(op.report())
    return result


def main(argv: list[str]) -> int:
    spec_path, result_path = argv[1], argv[2]
    case = Case(**json.loads(Path(spec_path).read_text()))
    started = time.time()
    result = measure(case)
    result["started"] = started
    Path(result_path).write_text(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
