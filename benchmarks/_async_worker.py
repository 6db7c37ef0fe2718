"""One method of the ``async`` section (issue 43) in a process of its own: ``python -m benchmarks._async_worker
SPEC RESULT``.

The process builds its state (float32 tensors of ``leaf_bytes``, 64 MiB by default, or a JAX PyTree of such arrays),
makes the method's saver, waits ``first_delay`` seconds (the training loop running a few seconds before the first
save), then saves ``saves`` times: ``blocked`` is the time until the save call returns, ``durable`` until the step is
committed (fsynced where the method does). Between saves the state is changed in place (torch) as a loop would. With
``keep``, only the last ``keep`` saves stay on disk (for the runs of 100 saves).

A sampler thread reads the proportional set size (``/proc/<pid>/smaps_rollup``) of this process and of its children
(the save process) every 10 ms, or less often when the reads cost more than :data:`SAMPLE_SHARE` of a core: shared
memory counts once, split between the processes that map it. Per save,
``peak_extra`` is the highest sum during the save less the sum just before it. For the run, ``before`` is the sum just
before the first save (the save process started ahead is in it) and ``peak`` the highest sum from then to the end:
``peak - before`` shows what a method holds *between* saves too (taskpoint's ready segment, held until
``close()``), which the per-save figure does not. ``start`` and ``end`` are the sum before the saver was made and
after the last save; ``processes`` the PSS of this process (``trainer``) and of its children (``saver``) before the
first save, after the first and every tenth, and at the end.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: Bytes per tensor or array of the state.
LEAF_BYTES = 64 << 20
#: How often the memory sampler reads the processes' PSS, at most.
SAMPLE_SECONDS = 0.01
#: The share of a core the sampler's reads may take. Reading a process's PSS walks its page tables: 5-6 ms of CPU for
#: a process that maps 256 MiB here, so reading a JAX trainer and its save process every 10 ms took about half a core
#: (0.6 CPU-s in the trainer per background save of 256 MiB, against 0.09 without the sampler) from the saves it
#: measured, on a machine of 2 cores.
SAMPLE_SHARE = 0.1


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
            for line in rollup:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as children:
                found += [int(child) for child in children.read().split()]
    except OSError:
        pass
    return found


def processes_pss() -> dict[str, int]:
    """The PSS of this process (``trainer``) and of its children (``saver``: the save process, if any)."""
    me = os.getpid()
    return {"trainer": _pss(me), "saver": sum(_pss(child) for child in _children(me))}


def family_pss() -> int:
    """The PSS of this process and of its children."""
    return sum(processes_pss().values())


class Sampler:
    """The highest :func:`family_pss` since :meth:`reset` (``peak``) and since the sampler started (``top``), read
    on a thread every :data:`SAMPLE_SECONDS`, or as often as the reads' CPU time allows (:data:`SAMPLE_SHARE`)."""

    def __init__(self) -> None:
        self.peak = self.top = family_pss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        pause = SAMPLE_SECONDS
        while not self._stop.wait(pause):
            began = time.thread_time()
            now = family_pss()
            self.peak, self.top = max(self.peak, now), max(self.top, now)
            pause = max(SAMPLE_SECONDS, (time.thread_time() - began) / SAMPLE_SHARE)

    def reset(self) -> int:
        now = family_pss()
        self.peak = now
        return now

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)


def _fsync_tree(path: Path) -> None:
    for folder, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(folder, name), os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


#: A method's saver: ``saver(step)`` gives the step's ``(save, durable)``: the call timed as blocked, then the wait
#: until it is committed.
Saver = Callable[[int], tuple[Callable[[], Any], Callable[[], Any]]]


def torch_methods(total: int, leaf: int, work: Path, keep: int | None) -> tuple[Any, dict[str, Callable[[], Saver]]]:
    import torch

    state = {f"layer{i}": torch.randn(leaf // 4) for i in range(max(1, total // leaf))}

    def copy() -> Saver:
        held: dict[str, Any] = {}
        return lambda step: (lambda: held.update(copy={k: v.clone() for k, v in state.items()}), held.clear)

    def torch_fsync(step: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
        def save() -> None:
            path = work / f"torch-{step}.pt"
            with open(path, "wb") as sink:
                torch.save(state, sink)
                sink.flush()
                os.fsync(sink.fileno())
        return save, lambda: None

    def dcp() -> Saver:
        import torch.distributed.checkpoint as dcp_module

        def one(step: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
            future: dict[str, Any] = {}

            def durable() -> None:
                future["f"].result()
                _fsync_tree(work / f"dcp-{step}")  # DCP's writer syncs its files; this is a no-op then
            return (lambda: future.update(f=dcp_module.async_save(state, checkpoint_id=str(work / f"dcp-{step}"))),
                    durable)
        return one

    def taskpoint(blocking: bool, ahead: bool = True, resumed: bool = False) -> Saver:
        from taskpoint import CheckpointManager
        from taskpoint.torch import StateDict

        if resumed:
            _saved_before(lambda manager: manager.save(StateDict(state), 0), work)
        # ahead: async_save=True, whose manager starts its save process when it is made; else save(blocking=False)
        # on a manager that starts it at its first background save
        manager = CheckpointManager(work / "steps", async_save=not blocking and ahead, preemption=False, keep=keep)

        def one(step: int) -> tuple[Callable[[], Any], Callable[[], Any]]:
            return lambda: manager.save(StateDict(state), step, blocking=blocking), manager.wait_until_finished
        return one

    return state, {"copy": copy, "torch-fsync": lambda: torch_fsync, "dcp": dcp,
                   "taskpoint": lambda: taskpoint(False), "taskpoint-blocking": lambda: taskpoint(True),
                   "taskpoint-on-demand": lambda: taskpoint(False, ahead=False),
                   "taskpoint-resumed": lambda: taskpoint(False, resumed=True)}


def _saved_before(save: Callable[[Any], Any], work: Path) -> None:
    """The step a process before this one saved, for the ``taskpoint-resumed`` methods (a retried task's process
    resumes where a step holds its state): ``save(manager)`` through a manager of the steps' folder, blocking."""
    from taskpoint import CheckpointManager

    with CheckpointManager(work / "steps", preemption=False) as manager:
        save(manager)


def jax_methods(total: int, leaf: int, work: Path, keep: int | None) -> tuple[Any, dict[str, Callable[[], Saver]]]:
    import jax
    import numpy as np

    rng = np.random.default_rng(0)
    state = jax.block_until_ready({f"layer{i}": jax.numpy.asarray(rng.standard_normal(leaf // 4, dtype=np.float32))
                                   for i in range(max(1, total // leaf))})

    def copy() -> Saver:
        held: dict[str, Any] = {}

        def save() -> None:
            held["copy"] = jax.block_until_ready(jax.tree_util.tree_map(lambda x: x.copy(), state))
        return lambda step: (save, held.clear)

    def orbax() -> Saver:
        import orbax.checkpoint as ocp

        manager = ocp.CheckpointManager(work / "orbax", options=ocp.CheckpointManagerOptions(
            enable_async_checkpointing=True, max_to_keep=keep))
        return lambda step: (lambda: manager.save(step, args=ocp.args.StandardSave(state)),
                             manager.wait_until_finished)

    def taskpoint(blocking: bool, resumed: bool = False) -> Saver:
        from taskpoint import CheckpointManager
        from taskpoint.jax import PyTree

        if resumed:
            _saved_before(lambda manager: manager.save(PyTree(state), 0), work)
        manager = CheckpointManager(work / "steps", async_save=not blocking, preemption=False, keep=keep)
        return lambda step: (lambda: manager.save(PyTree(state), step), manager.wait_until_finished)

    return state, {"copy": copy, "orbax": orbax, "taskpoint": lambda: taskpoint(False),
                   "taskpoint-blocking": lambda: taskpoint(True), "taskpoint-resumed": lambda: taskpoint(False, True)}


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    work = Path(spec["work"])
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    build = torch_methods if spec["kind"] == "torch" else jax_methods
    keep = spec.get("keep")
    state, methods = build(int(spec["bytes"]), int(spec.get("leaf_bytes", LEAF_BYTES)), work, keep)
    # Building a JAX state leaves the host array of its last leaf in a reference cycle: held until a collection,
    # which the first save's allocations set off, so that its PSS fell by a leaf (64 MiB of 256) during that save
    # and every JAX row's peak read a leaf low. Collected here, before anything is read.
    gc.collect()
    start = family_pss()
    saver = methods[spec["method"]]()  # made now: the manager starts its save process here
    time.sleep(float(spec["first_delay"]))
    sampler = Sampler()
    before, processes = sampler.top, {"before": processes_pss()}
    rows = []
    for step in range(1, int(spec["saves"]) + 1):
        save, durable = saver(step)
        ahead = sampler.reset()
        t0 = time.perf_counter()
        save()
        blocked = time.perf_counter() - t0
        durable()
        rows.append({"blocked": blocked, "durable": time.perf_counter() - t0, "peak_extra": sampler.peak - ahead})
        if step == 1 or step % 10 == 0:
            processes[f"after {step}"] = processes_pss()
        if keep is not None:  # the methods that keep no steps of their own (DCP, torch.save)
            shutil.rmtree(work / f"dcp-{step - keep}", ignore_errors=True)
            (work / f"torch-{step - keep}.pt").unlink(missing_ok=True)
        if spec["kind"] == "torch":
            for tensor in state.values():
                tensor.mul_(1.0001)  # the loop changes the state between saves
    sampler.stop()
    processes["end"] = processes_pss()
    Path(result_path).write_text(json.dumps({"saves": rows, "start": start, "end": family_pss(), "before": before,
                                             "peak": sampler.top, "processes": processes}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
