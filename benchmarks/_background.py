"""Issue 5's background-save benchmark: what one worker does for the ``manager`` method (directory only).

Four operations (``Case.op``), each in its own worker process like every other case:

* ``save``: ``CheckpointManager.save(dir, step)``, blocking, timed: the reference for both targets;
* ``save-bg``: ``save(dir, step, blocking=False)``; the time is the call's (the snapshot), and the run also
  records the time until ``wait_until_finished()`` returns (``total_seconds``);
* ``train``: the "training" loop without saves, ``iterations`` x one iteration of CPU-busy work; the work
  per iteration is calibrated (before the clock) to last as long as one blocking save, so saves are no more
  frequent than the upload time;
* ``train-bg``: the same loop, same work, with ``save(dir, step, blocking=False)`` after every iteration.
  Its time is the loop's, up to the return of the last save call (the job goes on training); the wait for
  that last save (``drain_seconds``, nothing left to overlap it with) is recorded apart and in
  ``total_seconds``.
* ``train-bg-paced`` and ``train-paced``: the same two loops with the work per iteration calibrated (before
  the clock) to last as long as one *background* save takes while the work runs beside it: the issue's
  "saves no more frequent than the upload time", read as the upload time of the save being measured. A
  blocking save has both cores; a background one shares them with the work, so it takes longer, and at the
  blocking save's pace (``train-bg``) each save call waits for the previous upload.

The work is single-threaded, so one core of the two stays free for the background save:

* ``numpy``: float32 matrix products (BLAS releases the GIL while it computes; the runner pins the BLAS
  pools to one thread), like a step whose heavy lifting is in native kernels;
* ``python``: a pure-Python integer loop that holds the GIL, like Python-heavy step logic; it shows what
  the background thread's own Python code costs a GIL-bound trainer.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ._operations import Case

#: The method name on the command line, and the operations it runs, in the order the runner runs them.
METHOD = "manager"
OPS = ("save", "save-bg", "train", "train-bg", "train-bg-paced", "train-paced")
#: Step of the calibration save of the paced loop (deleted before the loop starts).
CALIBRATION_STEP = 10**9
WORKS = ("numpy", "python")
#: Where the manager's steps live under the case's prefix.
MANAGER_DIRECTORY = "steps"
#: Retention of the training loop: the newest two steps, so disk and moto's memory stay bounded at size 1.
TRAIN_KEEP = 2
#: How long calibration measures the work, at most (it stops earlier for short iterations).
CALIBRATION_SECONDS = 1.0
#: Environment of a manager worker: BLAS pools of one thread, so the numpy work uses one core.
ENVIRONMENT = {name: "1" for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}


def work_unit(kind: str) -> Callable[[], None]:
    """A few milliseconds of single-threaded CPU work, repeated to make one "training" iteration."""
    if kind == "numpy":
        import numpy as np

        rng = np.random.default_rng(0)
        a = rng.standard_normal((384, 384), dtype=np.float32)
        b = rng.standard_normal((384, 384), dtype=np.float32)
        out = np.empty_like(a)

        def matmul() -> None:
            np.matmul(a, b, out=out)

        return matmul
    if kind == "python":
        def loop() -> None:
            total = 0
            for i in range(20_000):
                total += i * i % 7

        return loop
    raise ValueError(f"unknown work {kind!r}; choose from {', '.join(WORKS)}")


def calibrate(unit: Callable[[], None], target_seconds: float) -> int:
    """How many units last ``target_seconds`` on this machine now (measured for up to a second)."""
    for _ in range(10):
        unit()
    n, t0 = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - t0) < min(CALIBRATION_SECONDS, target_seconds) or n < 10:
        unit()
        n += 1
    return max(1, round(target_seconds / (elapsed / n)))


class ManagerOperation:
    """One of :data:`OPS`, prepared before the clock starts; ``run`` returns the timed seconds."""

    def __init__(self, case: Case) -> None:
        import fsspec

        import taskpoint

        if case.op not in OPS:
            raise ValueError(f"the manager method has no operation {case.op!r}")
        self.case = case
        self.fs, _ = fsspec.core.url_to_fs(case.prefix, **case.storage_options)
        if case.remote:  # connect before timing, as the other methods do
            self.fs.ls(case.prefix.split("://", 1)[1].split("/", 1)[0])
        self.source = Path(case.source)
        self.directory = case.url(MANAGER_DIRECTORY)
        keep = TRAIN_KEEP if case.op.startswith("train") else None
        # The snapshot goes to the system temp folder (the default): the worker's private TMPDIR, on the
        # data set's filesystem, so the runner counts it as temp disk.
        self.manager = taskpoint.CheckpointManager(self.directory, storage_options=case.storage_options or None,
                                                   codec=case.codec, level=case.level, keep=keep)
        self.manager.steps()  # lists the (empty) directory once: the bucket check is not part of the timing
        self.extras: dict[str, Any] = {}
        self.units = 0
        self.unit: Callable[[], None] = lambda: None
        if case.op.startswith("train"):
            self.unit = work_unit(case.work)
            if case.work_units:
                self.units = case.work_units
            elif case.op == "train-bg-paced":
                self.units, upload = self._calibrate_to_upload()
                self.extras.update(upload_beside_work_seconds=upload)
            else:
                self.units = calibrate(self.unit, case.iteration_seconds)
            self.extras.update(work=case.work, work_units=self.units, iterations=case.iterations,
                               iteration_target_seconds=case.iteration_seconds,
                               calibrated=not case.work_units)

    def _calibrate_to_upload(self) -> tuple[int, float]:
        """Units of work done while one background save runs beside them, and that save's seconds."""
        import threading

        for _ in range(10):
            self.unit()
        done = threading.Event()
        t0 = time.perf_counter()
        self.manager.save(self.source, CALIBRATION_STEP, blocking=False)
        waiter = threading.Thread(target=lambda: (self.manager.wait_until_finished(), done.set()))
        waiter.start()
        units = 0
        while not done.is_set():
            self.unit()
            units += 1
        seconds = time.perf_counter() - t0
        waiter.join()
        # The calibration step is the only committed one, which retention protects as the step to resume from;
        # it is the bench's own throwaway step, so it goes anyway.
        self.manager.delete(CALIBRATION_STEP, force=True)
        return max(1, units), seconds

    def run(self) -> float:
        op = self.case.op
        if op == "save":
            t0 = time.perf_counter()
            self.manager.save(self.source, 0, blocking=True)
            return time.perf_counter() - t0
        if op == "save-bg":
            t0 = time.perf_counter()
            self.manager.save(self.source, 0, blocking=False)
            call = time.perf_counter() - t0
            self.manager.wait_until_finished()
            self.extras.update(total_seconds=time.perf_counter() - t0)
            return call
        return self._loop(save=op.startswith("train-bg"))

    def _loop(self, save: bool) -> float:
        compute: list[float] = []
        calls: list[float] = []
        unit, units = self.unit, self.units
        sched0, cpu0, helper0 = _thread_schedstat(), time.process_time(), children_cpu_seconds()
        t0 = time.perf_counter()
        for step in range(self.case.iterations):
            a = time.perf_counter()
            for _ in range(units):
                unit()
            b = time.perf_counter()
            compute.append(b - a)
            if save:
                self.manager.save(self.source, step, blocking=False)
                calls.append(time.perf_counter() - b)
        loop = time.perf_counter() - t0
        sched1 = _thread_schedstat()
        self.manager.wait_until_finished()
        total = time.perf_counter() - t0
        sched2, cpu2, helper2 = _thread_schedstat(), time.process_time(), children_cpu_seconds()
        self.extras.update(compute_seconds=sum(compute), iteration_seconds=compute, total_seconds=total,
                           helper_loop_cpu_seconds=helper2 - helper0)
        if sched0 is not None and sched1 is not None and sched2 is not None:
            # The loop's thread: CPU it got, and time it was runnable but waited for a core (the run queue),
            # up to the last save call; every other thread's CPU (the saves) until the last save committed.
            self.extras.update(work_thread_cpu_seconds=sched1[0] - sched0[0],
                               work_thread_wait_seconds=sched1[1] - sched0[1],
                               other_threads_cpu_seconds=(cpu2 - cpu0) - (sched2[0] - sched0[0]))
        if save:
            self.extras.update(save_call_seconds=sum(calls), save_calls=calls, drain_seconds=total - loop,
                               steps_kept=self.manager.steps())
        return loop

    def report(self) -> dict[str, Any]:
        """After the clock: the extra measurements, and the stored bytes of a single save."""
        self.manager.close()
        out = dict(self.extras)
        if self.case.op in ("save", "save-bg"):
            out["stored_bytes"] = self._stored_bytes()
        return out

    def _stored_bytes(self) -> int:
        if not self.case.remote:
            return sum(p.stat().st_size for p in Path(self.directory).rglob("*")
                       if p.is_file() and p.name != "taskpoint.json")
        self.fs.invalidate_cache()
        sizes = self.fs.du(self.directory, total=False)
        return sum(n for path, n in sizes.items() if not path.endswith("/taskpoint.json"))


_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def process_stat(pid: int | str) -> tuple[int, float] | None:
    """A process's parent pid and CPU seconds so far (Linux ``/proc/PID/stat``), or None when it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[1]), (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS
    except (OSError, IndexError, ValueError):
        return None


def children() -> dict[int, tuple[float, int]]:
    """This process's live children (the manager's save process): pid -> (CPU seconds, peak RSS in KiB)."""
    me, out = os.getpid(), {}
    for entry in os.listdir("/proc"):
        stat = process_stat(entry) if entry.isdigit() else None
        if stat is None or stat[0] != me:
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        hwm = next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmHWM:")), 0)
        out[int(entry)] = (stat[1], hwm)
    return out


def children_cpu_seconds() -> float:
    return sum(cpu for cpu, _ in children().values())


def _thread_schedstat() -> tuple[float, float] | None:
    """This thread's seconds on a CPU and seconds runnable but waiting for one (Linux schedstat), or None."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            on_cpu, waiting = f.read().split()[:2]
    except (OSError, ValueError):
        return None
    return int(on_cpu) / 1e9, int(waiting) / 1e9
