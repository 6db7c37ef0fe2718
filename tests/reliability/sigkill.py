"""SIGKILL during save: a saver in a separate process is killed at a random moment over a good checkpoint.

One trial, for each way of saving (``Checkpoint.save_sync``; ``CheckpointManager.save`` blocking; in the
background with the trainer killed; in the background with the manager's save process killed):

1. a fresh trainer process (``python -c``) saves version *n* completely (the good checkpoint; its duration
   tells how long a save takes here);
2. it writes version *n+1*, then is asked to save it; after a random delay (seeded; uniform over 0 to 1.3
   times that duration, counted from the request) the trainer, or its helper save process, gets SIGKILL;
3. a fresh process loads: it must get version *n* or *n+1* (only *n+1* when that save had finished, or when
   only the helper was killed, since the trainer then finishes the save itself), complete, every file's
   sha256 as saved; any exception is a failure, with its text;
4. leftovers: for ``Checkpoint``, that process backdates the killed save's temp files past the documented
   grace period and saves again (the following successful save must remove them and abort S3 uploads); for
   the manager, ``CheckpointManager(directory, grace_seconds=0).gc()`` runs (what ``taskpoint gc DIR
   --grace 0`` runs); then the runner lists the store: no temp object, no payload that no manifest names,
   no unfinished S3 multipart upload may remain.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
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
    key_prefix,
    last_json_line,
    list_objects,
    location_or_skip,
    remove_location,
    run_child,
    tail,
    timed,
    unfinished_uploads,
)

MODES = ("checkpoint", "manager", "background-trainer", "background-helper")
MODE_TITLES = {
    "checkpoint": "SIGKILL during save: Checkpoint.save_sync",
    "manager": "SIGKILL during save: CheckpointManager.save (blocking)",
    "background-trainer": "SIGKILL during save: manager background save, trainer killed",
    "background-helper": "SIGKILL during save: manager background save, save process killed",
}
#: Size of the random (incompressible) data file of each state, per store: on S3 above the 8 MiB part size,
#: so that killed saves leave multipart uploads behind.
STATE_SIZE = {"local": 3 << 20, "s3": 10 << 20, "gcs": 3 << 20, "azure": 3 << 20}
KEEP = 3
PROCESS_TIMEOUT = 180.0

_TRAINER = textwrap.dedent("""
    import json, shutil, sys, time, warnings
    from pathlib import Path
    import taskpoint
    from reliability._common import describe_exception, write_state

    mode, target, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    work, size, keep = Path(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
    if mode == "checkpoint":
        saver = taskpoint.Checkpoint(target, storage_options=options)
        save = saver.save_sync
    else:
        manager = taskpoint.CheckpointManager(target, storage_options=options, keep=keep)
        background = mode.startswith("background")
        def save(state, step):
            manager.save(state, step, blocking=not background)
            manager.wait_until_finished()
    print("ready", flush=True)
    for line in sys.stdin:
        words = line.split()
        if words[0] == "quit":
            if mode != "checkpoint":
                manager.close()
            print("bye", flush=True)
            break
        if words[0] == "prepare":  # the state is written before the save is asked for: kills land in the save
            version, seed = int(words[1]), int(words[2])
            state = write_state(work / f"v{version}", writer="trainer", version=version, size=size, seed=seed)
            print("prepared", flush=True)
            continue
        started = time.monotonic()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                save(state) if mode == "checkpoint" else save(state, version)
                outcome = f"done {version} {time.monotonic() - started:.3f}"
            except BaseException as exc:
                outcome = "error " + describe_exception(exc)
        for w in caught:
            print("warning " + " ".join(str(w.message).split())[:300], flush=True)
        print(outcome, flush=True)
        shutil.rmtree(state, ignore_errors=True)
""")

_CHECKER = textwrap.dedent("""
    import json, os, sys, time, warnings
    from pathlib import Path
    import taskpoint
    from reliability._common import check_state, describe_exception, write_state

    mode, target, options, work = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), Path(sys.argv[4])
    next_version, seed, size, grace = int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]), float(sys.argv[8])
    out = {"warnings": [], "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            if mode == "checkpoint":
                with taskpoint.Checkpoint(target, target, storage_options=options, workspace=work / "ws") as cp:
                    path = cp.load_sync()
                    if path is None:
                        raise AssertionError("load returned None: the good checkpoint is gone")
                    out["writer"], out["version"] = check_state(path)
            else:
                with taskpoint.CheckpointManager(target, storage_options=options) as m:
                    out["steps"] = m.steps()
                    path = m.restore()
                    out["writer"], out["version"] = check_state(path)
                    out["restored_step"] = m.restored_step
        except BaseException as exc:
            out["error"] = describe_exception(exc)
    out["warnings"] = [" ".join(str(w.message).split())[:300] for w in caught]
    # Leftovers: what the next successful save (Checkpoint) or gc (manager) must remove.
    try:
        if mode == "checkpoint":
            if "://" not in target:  # local temp files of the killed save: make them older than the grace period
                folder, name = os.path.split(target)
                old = time.time() - grace - 60
                for entry in os.scandir(folder):
                    if entry.name.startswith(f".{name}.") and entry.name.endswith(".tmp"):
                        os.utime(entry.path, (old, old), follow_symlinks=False)
                        out.setdefault("backdated", []).append(entry.name)
            state = write_state(work / "next", writer="trainer", version=next_version, size=size, seed=seed)
            taskpoint.Checkpoint(target, storage_options=options).save_sync(state)
        else:
            with taskpoint.CheckpointManager(target, storage_options=options, grace_seconds=0) as m:
                out["gc_removed"] = m.gc()
    except BaseException as exc:
        out["cleanup_error"] = describe_exception(exc)
    print(json.dumps(out), flush=True)
""")


def _children(pid: int) -> list[int]:
    """Processes whose parent is ``pid``, by a scan of /proc (the per-thread ``children`` lists miss a child
    while the thread that started it exits and it moves to another thread of the process)."""
    found: list[int] = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(name))
    return found


def _helper_pid(trainer: int, within: float = 5.0) -> int | None:
    deadline = time.monotonic() + within
    while True:
        for child in _children(trainer):
            with contextlib.suppress(OSError), open(f"/proc/{child}/cmdline", "rb") as f:
                if b"taskpoint.manager.saver" in f.read():
                    return child
        if time.monotonic() > deadline:
            return None
        time.sleep(0.1)


class _Trainer:
    """One trainer process, driven line by line over its stdin and stdout (unbuffered reads with select)."""

    def __init__(self, mode: str, target: str, options: dict, work: Path, size: int, env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", CHILD_PRELUDE + _TRAINER, mode, target, json.dumps(options), str(work),
             str(size), str(KEEP)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, bufsize=0)
        self.lines: list[str] = []
        self._buf = b""

    def _read(self, timeout: float) -> bool:
        """Read what is there within ``timeout``; False at end of file."""
        import select

        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        readable, _, _ = select.select([fd], [], [], timeout)
        if not readable:
            return True
        data = os.read(fd, 65536)
        self._buf += data
        return bool(data)

    def expect(self, prefixes: tuple[str, ...], timeout: float) -> str:
        """The next line starting with one of ``prefixes`` (warnings are kept); RuntimeError on EOF or timeout."""
        deadline = time.monotonic() + timeout
        while True:
            while b"\n" in self._buf:
                raw, self._buf = self._buf.split(b"\n", 1)
                line = raw.decode(errors="replace").strip()
                self.lines.append(line)
                if line.startswith(prefixes):
                    return line
            left = deadline - time.monotonic()
            if left <= 0:
                raise RuntimeError(f"the trainer said nothing for {timeout:.0f} s")
            if not self._read(min(left, 1.0)):
                self.proc.wait(timeout=30)
                raise RuntimeError("the trainer exited: " + tail(self.stderr()))

    def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((text + "\n").encode())
        self.proc.stdin.flush()

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return ""
        assert self.proc.stderr is not None
        with contextlib.suppress(ValueError, OSError):
            return self.proc.stderr.read().decode(errors="replace")
        return ""

    def rest(self) -> list[str]:
        """Every line, including those still in the pipe of a process that has exited."""
        deadline = time.monotonic() + 10
        with contextlib.suppress(ValueError, OSError):
            while self.proc.poll() is not None and time.monotonic() < deadline and self._read(1.0):
                pass
        self.lines += [line.decode(errors="replace").strip() for line in self._buf.split(b"\n") if line]
        self._buf = b""
        return self.lines

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.kill()
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(Exception):
                stream.close()  # type: ignore[union-attr]


def _leftovers(location, mode: str, server) -> list[str]:  # type: ignore[no-untyped-def]
    """What a killed save left that the following save or gc should have removed (empty when clean)."""
    import fsspec

    found: list[str] = []
    names = list_objects(location)
    if mode == "checkpoint":
        found += [n for n in names if n not in ("ckpt", "ckpt.taskpoint.json")]
    else:
        folders: dict[str, list[str]] = {}
        for name in names:
            parts = name.split("/")
            if parts[0] != "ckpts" or len(parts) != 3:
                found.append(name)
                continue
            folders.setdefault(parts[1], []).append(parts[2])
        for folder, objects in folders.items():
            named = None
            if "taskpoint.json" in objects:
                if location.kind == "local":
                    raw = Path(location.base, "ckpts", folder, "taskpoint.json").read_bytes()
                else:
                    fs = fsspec.filesystem(location.protocol, skip_instance_cache=True, **location.storage_options)
                    raw = fs.cat_file(f"{location.base}/ckpts/{folder}/taskpoint.json")
                doc = json.loads(raw)
                named = doc.get("content", doc).get("payload")  # version 6 keeps the kind's fields in content
            found += [f"ckpts/{folder}/{o}" for o in objects if o not in ("taskpoint.json", named)]
    if location.kind == "s3":
        found += [f"multipart upload of {key}" for key in unfinished_uploads(server, key_prefix(location))]
    return found


def run_mode(servers: Servers, kind: str, mode: str, trials: int, rng: random.Random, scratch: Path) -> Result:
    result = Result(MODE_TITLES[mode], kind)
    with timed(result):
        location = location_or_skip(servers, kind, scratch, result)
        if location is None:
            return result
        server = servers.get(kind) if kind in ("s3", "gcs", "azure") else None
        target = location.url("ckpt" if mode == "checkpoint" else "ckpts")
        options = location.storage_options
        size = STATE_SIZE[kind]
        tmpdir = scratch / f"tmp-{kind}-{mode}"
        tmpdir.mkdir(parents=True, exist_ok=True)
        env = child_env(TMPDIR=str(tmpdir))
        version = 1
        outcomes = {"old": 0, "new": 0}
        unverified = killed_before_done = 0
        for trial in range(trials):
            work = scratch / f"work-{kind}-{mode}-{trial}"
            error = None
            good, killed = version, version + 1
            trainer = _Trainer(mode, target, options, work, size, env)
            try:
                trainer.expect(("ready",), PROCESS_TIMEOUT)
                trainer.send(f"prepare {good} {rng.randrange(2**32)}")
                trainer.expect(("prepared",), PROCESS_TIMEOUT)
                trainer.send("save")
                line = trainer.expect(("done", "error"), PROCESS_TIMEOUT)
                if line.startswith("error"):
                    raise RuntimeError(f"the uninterrupted save of version {good} failed: {line[6:]}")
                duration = float(line.split()[2])
                helper = _helper_pid(trainer.proc.pid) if mode.startswith("background") else None
                if mode == "background-helper" and helper is None:
                    said = [line for line in trainer.lines if line.startswith("warning")]
                    raise RuntimeError("the manager's save process was not found among the trainer's children "
                                       f"(the trainer's warnings: {said or 'none'})")
                delay = rng.uniform(0, 1.3 * duration)
                trainer.send(f"prepare {killed} {rng.randrange(2**32)}")
                trainer.expect(("prepared",), PROCESS_TIMEOUT)
                trainer.send("save")
                time.sleep(delay)
                if mode == "background-helper":
                    assert helper is not None
                    os.kill(helper, signal.SIGKILL)
                    line = trainer.expect(("done", "error"), PROCESS_TIMEOUT)
                    if line.startswith("error"):
                        raise RuntimeError(f"the save whose helper process was killed failed: {line[6:]}")
                    trainer.send("quit")
                    trainer.expect(("bye",), PROCESS_TIMEOUT)
                    code = trainer.proc.wait(timeout=PROCESS_TIMEOUT)
                    if code != 0:
                        raise RuntimeError(f"the trainer exited with {code}: {tail(trainer.stderr())}")
                    expected = {killed}
                else:
                    trainer.kill()
                    finished = any(line.startswith(f"done {killed} ") for line in trainer.rest())
                    killed_before_done += not finished
                    expected = {killed} if finished else {good, killed}
                    if helper is not None and not process_gone(helper, 10):
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(helper, signal.SIGKILL)
                        raise RuntimeError(f"the save process (pid {helper}) outlived its killed trainer by 10 s")
                unverified += sum("warning" in line and "checks only" in line for line in trainer.lines)
                code, out, err = run_child(_CHECKER, [mode, target, json.dumps(options), str(work), str(killed + 1),
                                                      str(rng.randrange(2**32)), str(size), str(15 * 60 + 60)],
                                           timeout=PROCESS_TIMEOUT, env=env)
                report = last_json_line(out)
                if report is None:
                    raise RuntimeError(f"the loading process exited with {code} and no report: {tail(err)}")
                unverified += sum("checks only" in w for w in report["warnings"])
                if report["error"]:
                    error = f"load after kill (expected version {sorted(expected)}): {report['error']}"
                elif report["version"] not in expected:
                    error = f"loaded version {report['version']}, expected one of {sorted(expected)}"
                elif mode != "checkpoint" and (good not in report["steps"] or report["restored_step"] !=
                                               report["version"]):
                    error = (f"steps after the kill {report['steps']} (restored step {report['restored_step']}, "
                             f"version {report['version']}): the completed step {good} must stay")
                else:
                    outcomes["new" if report["version"] == killed else "old"] += 1
                if error is None and report.get("cleanup_error"):
                    error = f"the following save or gc failed: {report['cleanup_error']}"
                if error is None:
                    left = _leftovers(location, mode, server)
                    if left:
                        after = "the following save" if mode == "checkpoint" else "gc"
                        error = f"{len(left)} leftover(s) after {after}: {left[:4]}"
            except Exception as exc:
                text = first_line(str(exc)) if isinstance(exc, RuntimeError) else describe_exception(exc)
                error = error or text
            finally:
                trainer.close()
                import shutil

                shutil.rmtree(work, ignore_errors=True)
            result.trial(error)
            version = killed + 2  # the checker saved killed + 1 (Checkpoint); the next trial starts above it
        leftover_tmp = [n for n in os.listdir(tmpdir)]
        result.note(f"loads got old {outcomes['old']}, new {outcomes['new']}")
        if mode != "background-helper":
            result.note(f"{killed_before_done} killed before the save returned")
        if unverified:
            result.note(f"{unverified} loaded unverified (pending record, warning)")
        if leftover_tmp:
            result.note(f"{len(leftover_tmp)} entries left in the killed processes' TMPDIR")
        remove_location(location)
    return result


def run(servers: Servers, counts: dict[str, int], rng: random.Random, scratch: Path,
        modes: tuple[str, ...] = MODES) -> list[Result]:
    """Every mode on every store with a count > 0 (``counts``: store kind -> trials per mode)."""
    results = []
    for kind, trials in counts.items():
        if trials <= 0:
            continue
        for mode in modes:
            results.append(run_mode(servers, kind, mode, trials, random.Random(rng.randrange(2**32)), scratch))
            print(f"  {results[-1].scenario} [{kind}]: {results[-1].trials} trials, "
                  f"{results[-1].failures} failures ({results[-1].seconds:.0f} s)", flush=True)
    return results
