"""Kill after return: a trainer SIGKILLed 0 to 1 s after ``save(..., blocking=False)`` returned (issue 21, item 4).

One trial: a fresh trainer process (``python -c``) resumes from the newest step of a manager on local disk
or S3 and saves one or two steps with ``blocking=False`` (the first waited for before the second, so the
save process is warm and a directory's snapshot is kept for the next one), writing a marker to its stdout
the instant each ``save()`` returns; after the last marker it deletes its data (allowed once ``save``
returned) and goes on "training". The runner SIGKILLs it a set delay after that marker, waits for the
trainer's save process to exit, then checks in its own process: every step whose ``save()`` returned is
committed, restores byte for byte as it was saved, and is the newest step (``latest_step()``); the save
process is gone; the snapshot folder is empty. Payloads alternate between bytes and a folder of three files
(one the same in every step), cold and warm save processes; delays are spread evenly over 0 to 1 s. With
``loaded``, one busy-loop process per core runs throughout (the save process runs at ``nice`` +10).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from helpers import process_gone

from ._common import (
    CHILD_PRELUDE,
    Result,
    Servers,
    child_env,
    describe_exception,
    first_line,
    location_or_skip,
    remove_location,
    tail,
    timed,
)

TITLE = "Kill after return: trainer SIGKILLed 0-1 s after save(blocking=False) returned"
#: The payload of the full campaign's trials (the issue's) and of the bounded ones (``make test``).
FULL_SIZE = 48 << 20
QUICK_SIZE = 8 << 20
#: The delays of a run's trials are spread evenly over 0 to this many seconds after the return.
MAX_DELAY = 1.0
#: The save process's grace period after its trainer died (TASKPOINT_GRACE_SECONDS): long enough for a 48 MiB
#: upload to S3 on a machine whose cores are busy, where the nice +10 helper gets a small share of a core.
GRACE_SECONDS = 120.0
PROCESS_TIMEOUT = 180.0
SAVE_PROCESS = "taskpoint.manager.saver"

_TRAINER = textwrap.dedent("""
    import json, os, shutil, sys, time
    from pathlib import Path
    import taskpoint
    from reliability.handover import write_data

    opts = json.loads(sys.argv[1])
    mgr = taskpoint.CheckpointManager(opts["dir"], storage_options=opts["storage_options"],
                                      snapshot_dir=opts["snapshots"], preemption=False)
    start = (mgr.latest_step() or 0) + 1
    print(json.dumps({"latest": mgr.latest_step()}), flush=True)
    work = Path(opts["work"])
    for step in range(start, start + opts["saves"]):
        if step > start:
            mgr.wait_until_finished()
        data = write_data(opts["kind"], step, opts["size"], work / f"state-{step}")
        began = time.monotonic()
        mgr.save(data, step, blocking=False)
        os.write(1, f"returned {step} {time.monotonic() - began:.4f}\\n".encode())  # the instant save() returns
    shutil.rmtree(work, ignore_errors=True)  # the caller may delete its data once save() returned
    while True:
        time.sleep(1)  # training; SIGKILLed meanwhile
""")


def write_data(kind: str, step: int, size: int, folder: Path) -> bytes | Path:
    """What the trainer saves as ``step``: ``size`` bytes, or a folder of three files (``base.bin`` the same in
    every step, so that a kept snapshot lends it to the next one). The runner calls it again to compare."""
    if kind == "bytes":
        return step.to_bytes(8, "big") + random.Random(step).randbytes(size)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "base.bin").write_bytes(random.Random(0).randbytes(size // 2))
    (folder / "state.bin").write_bytes(random.Random(step).randbytes(size // 2))
    (folder / "step.txt").write_text(f"{step}\n")
    return folder


def _digest(kind: str, restored: Path) -> str:
    """sha256 over what a restored step holds (the bytes, or each file's name and bytes in order)."""
    h = hashlib.sha256()
    if kind == "bytes":
        h.update(restored.read_bytes())
        return h.hexdigest()
    for path in sorted(p for p in restored.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(restored)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


def _save_processes(trainer: int) -> list[int]:
    """The save processes a trainer started (their command line ends with its pid; they outlive it)."""
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError), open(f"/proc/{name}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
                if any(SAVE_PROCESS.encode() in a for a in args) and str(trainer).encode() in args[-3:]:
                    found.append(int(name))
    return found


@contextlib.contextmanager
def busy_cores(on: bool):  # type: ignore[no-untyped-def]
    """One busy-loop process per core while the block runs (when ``on``), each ended by its pid after it."""
    procs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 2)] if on \
        else []
    try:
        yield
    finally:
        for proc in procs:
            proc.kill()
            proc.wait(30)


def _read_markers(proc: subprocess.Popen[bytes], count: int) -> tuple[int | None, list[tuple[int, float]]]:
    """The trainer's first line (the step it resumed from) and its ``count`` markers (step, seconds)."""
    assert proc.stdout is not None
    first = proc.stdout.readline()
    if not first:
        raise RuntimeError("the trainer exited before it started: " + tail(proc.communicate()[1].decode()))
    latest = json.loads(first)["latest"]
    markers = []
    for _ in range(count):
        line = proc.stdout.readline().decode().split()
        if not line or line[0] != "returned":
            proc.kill()
            raise RuntimeError(f"the trainer said {line!r} instead of a marker: "
                               + tail(proc.communicate()[1].decode()))
        markers.append((int(line[1]), float(line[2])))
    return latest, markers


def run_store(servers: Servers, kind: str, trials: int, scratch: Path, *, size: int, loaded: bool) -> Result:
    result = Result(TITLE, f"{kind}{', cores busy' if loaded else ''}")
    with timed(result):
        location = location_or_skip(servers, kind, scratch, result)
        if location is None:
            return result
        directory, options = location.url("ckpts"), location.storage_options
        snapshots = scratch / f"snapshots-{kind}-{int(loaded)}"
        snapshots.mkdir(parents=True, exist_ok=True)
        env = child_env(TASKPOINT_GRACE_SECONDS=str(GRACE_SECONDS))
        newest: int | None = None
        committed = returned = 0
        cold: list[float] = []
        warm: list[float] = []
        import taskpoint

        with busy_cores(loaded), taskpoint.CheckpointManager(directory, storage_options=options,
                                                             preemption=False) as checker:
            for trial in range(trials):
                payload = "bytes" if trial % 2 == 0 else "directory"
                saves = 1 if trial // 2 % 2 == 0 else 2
                delay = MAX_DELAY * trial / max(trials - 1, 1)
                opts = {"dir": directory, "storage_options": options, "snapshots": str(snapshots),
                        "kind": payload, "size": size, "saves": saves, "work": str(scratch / f"work-{trial}")}
                proc = subprocess.Popen([sys.executable, "-c", CHILD_PRELUDE + _TRAINER, json.dumps(opts)], env=env,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                error = None
                try:
                    latest, markers = _read_markers(proc, saves)
                    time.sleep(delay)
                    proc.kill()
                    proc.wait(PROCESS_TIMEOUT)
                    helpers = _save_processes(proc.pid)
                    cold.append(markers[0][1])
                    warm += [seconds for _, seconds in markers[1:]]
                    steps = [step for step, _ in markers]
                    returned += len(steps)
                    if latest != newest:
                        error = f"the trainer resumed from step {latest}, not from the newest step {newest}"
                    for pid in helpers:
                        if not process_gone(pid, GRACE_SECONDS + 10):
                            os.kill(pid, signal.SIGKILL)
                            error = error or f"the save process (pid {pid}) outlived the grace period"
                    have = checker.steps()
                    missing = [s for s in steps if s not in have]
                    committed += len(steps) - len(missing)
                    for step in steps:
                        if step in missing:
                            continue
                        want = _digest(payload, _expected(payload, step, size, scratch / "expected"))
                        if _digest(payload, checker.restore(step)) != want:
                            error = error or f"step {step} restores other bytes than were saved"
                    if missing:
                        error = error or (f"step(s) {missing} not committed although save() returned "
                                          f"(killed {delay:.2f} s after the return; steps there: {have[-4:]})")
                    elif checker.latest_step() != steps[-1]:
                        error = error or f"latest_step() is {checker.latest_step()}, not step {steps[-1]}"
                    left = sorted(os.listdir(snapshots))
                    if left:
                        error = error or f"{len(left)} snapshot folder(s) left behind: {left[:3]}"
                        for name in left:
                            shutil.rmtree(snapshots / name, ignore_errors=True)
                    newest = checker.latest_step()
                except Exception as exc:
                    error = first_line(str(exc)) if isinstance(exc, RuntimeError) else describe_exception(exc)
                    newest = checker.latest_step()
                finally:
                    if proc.poll() is None:
                        proc.kill()
                    proc.wait(PROCESS_TIMEOUT)
                    for stream in (proc.stdout, proc.stderr):
                        if stream is not None:
                            stream.close()
                result.trial(error)
        result.note(f"committed {committed} of {returned} steps whose save() returned")
        result.note(f"{size >> 20} MiB, bytes and folders, delays 0-{MAX_DELAY:g} s")
        if cold and warm:
            result.note(f"save() returned in median {statistics.median(cold) * 1000:.0f} ms with the save process "
                        f"to start, {statistics.median(warm) * 1000:.0f} ms with it running")
        remove_location(location)
    return result


def _expected(payload: str, step: int, size: int, folder: Path) -> Path:
    """The data of ``step`` as the trainer wrote it, as a restore returns it (a file of bytes, or a folder)."""
    folder.mkdir(parents=True, exist_ok=True)
    data = write_data(payload, step, size, folder / f"tree-{step}")
    if isinstance(data, bytes):
        path = folder / f"bytes-{step}"
        path.write_bytes(data)
        return path
    return data


def run(servers: Servers, counts: dict[str, int], scratch: Path, *, size: int,
        loaded: tuple[bool, ...]) -> list[Result]:
    """Every store with a count > 0 (``counts``: store kind -> trials), idle and with busy cores as asked."""
    results = []
    for kind, trials in counts.items():
        if trials <= 0:
            continue
        for busy in loaded:
            results.append(run_store(servers, kind, trials, scratch, size=size, loaded=busy))
            print(f"  {results[-1].scenario} [{results[-1].store}]: {results[-1].trials} trials, "
                  f"{results[-1].failures} failures ({results[-1].seconds:.0f} s)", flush=True)
    return results
