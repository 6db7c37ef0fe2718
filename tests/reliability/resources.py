"""Resources: many save/load cycles of small checkpoints in one process leak nothing.

A child process (so that no server shares its counts) runs a warm-up round of every kind of cycle, settles,
counts its open file descriptors (``/proc/self/fd``), threads (but the shared pools', which stay), entries in its
private ``TMPDIR`` and child processes (a ``/proc`` scan for its pid as parent), then runs the cycles,
settles again (garbage collection, a short sleep) and counts again. Any count above the first is a leak
(the row names what leaked). Cycles go round these kinds, each with its own fresh objects:

* ``Checkpoint`` of a small directory on local disk, and of bytes on ``memory://``;
* ``CheckpointManager`` on local disk, a background save (its save process starts and ends with the
  manager), then a restore;
* ``Checkpoint`` of bytes and ``CheckpointManager`` blocking save and restore on the S3 server.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

from ._common import Result, Servers, child_env, describe_exception, first_line, last_json_line, run_child, tail, timed

_CHILD = textwrap.dedent("""
    import gc, json, os, sys, tempfile, threading, time
    from pathlib import Path
    import taskpoint
    from reliability._common import check_state, describe_exception, write_state

    cycles, scratch, s3 = int(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3])
    SETTLE_SECONDS = 60  # the bound of a measure's settling: ample on a loaded machine, ended as soon as settled
    tmp = Path(os.environ["TMPDIR"])
    tempfile.tempdir = str(tmp)
    me = os.getpid()
    kinds = ["local-dir", "memory-bytes", "local-manager-background"] + (["s3-bytes", "s3-manager"] if s3 else [])
    errors = []

    def cycle(i):
        kind = kinds[i % len(kinds)]
        work = scratch / "work"
        try:
            if kind == "local-dir":
                state = write_state(work / "src", writer="res", version=i, size=2000 + i % 97, seed=i)
                dest = str(scratch / "store" / f"dir-{i % 3}")
                taskpoint.Checkpoint(dest).save_sync(state)
                with taskpoint.Checkpoint(dest, dest) as cp:
                    assert check_state(cp.load_sync()) == ("res", i)
            elif kind == "memory-bytes":
                data = os.urandom(100 + i % 500)
                dest = f"memory://resources/m-{i % 3}"
                taskpoint.Checkpoint(dest).save_sync(data)
                with taskpoint.Checkpoint(dest, dest) as cp:
                    assert cp.load_sync().read_bytes() == data
            elif kind == "local-manager-background":
                state = write_state(work / "src", writer="res", version=i, size=3000, seed=i)
                with taskpoint.CheckpointManager(scratch / "store" / "manager", keep=2) as m:
                    m.save(state, i, blocking=False)
                    m.wait_until_finished()
                    assert check_state(m.restore(i)) == ("res", i)
            elif kind == "s3-bytes":
                data = os.urandom(100 + i % 500)
                dest = f"{s3['base']}/b-{i % 3}"
                taskpoint.Checkpoint(dest, storage_options=s3["options"]).save_sync(data)
                with taskpoint.Checkpoint(dest, dest, storage_options=s3["options"]) as cp:
                    assert cp.load_sync().read_bytes() == data
            else:
                data = os.urandom(100 + i % 500)
                with taskpoint.CheckpointManager(f"{s3['base']}/manager", storage_options=s3["options"], keep=2) as m:
                    m.save(data, i)
                    assert m.restore(i).read_bytes() == data
        except BaseException as exc:
            errors.append(f"cycle {i} ({kind}): " + describe_exception(exc))
        finally:
            import shutil
            shutil.rmtree(work, ignore_errors=True)

    def children():
        found = []
        for name in os.listdir("/proc"):
            if name.isdigit():
                try:
                    with open(f"/proc/{name}/stat") as f:
                        fields = f.read().rsplit(")", 1)[1].split()
                    if int(fields[1]) == me and fields[0] != "Z":
                        with open(f"/proc/{name}/cmdline", "rb") as f:
                            found.append(name + " " + f.read().replace(b"\\0", b" ").decode(errors="replace")[:120])
                except (OSError, IndexError, ValueError):
                    pass
        return sorted(found)

    def fds():
        out = {}
        for fd in os.listdir("/proc/self/fd"):
            try:
                out[fd] = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        return out

    def measure():
        deadline = time.monotonic() + SETTLE_SECONDS
        while True:  # settle: give finishing threads and exiting children a moment (returns once they are gone)
            gc.collect()
            time.sleep(0.3)
            # The shared pools' threads (taskpoint.executors) stay for the next operation, bounded by the pools'
            # sizes: not a leak, so not counted.
            shared = ("taskpoint-io_", "taskpoint-cpu_")
            names = [t.name for t in threading.enumerate() if not t.name.startswith(shared)]
            snap = {"fds": fds(), "threads": sorted(names),
                    "thread_count": len(names), "tmp": sorted(os.listdir(tmp)), "children": children()}
            if time.monotonic() > deadline or (not snap["children"] and len(snap["threads"]) <= base_threads):
                return snap

    base_threads = 10**6
    warm = 2 * len(kinds)
    for i in range(warm):
        cycle(i)
    before = measure()
    base_threads = len(before["threads"])
    started = time.monotonic()
    for i in range(warm, warm + cycles):
        cycle(i)
    elapsed = time.monotonic() - started
    after = measure()
    print(json.dumps({"before": before, "after": after, "errors": errors[:10], "error_count": len(errors),
                      "cycles": cycles, "kinds": kinds, "seconds": elapsed}))
""")


def run(servers: Servers, cycles: int, scratch: Path, *, use_s3: bool = True) -> list[Result]:
    result = Result("Resources: save/load cycles in one process", "local+memory" + ("+s3" if use_s3 else ""))
    with timed(result):
        s3: dict | None = None
        if use_s3:
            try:
                location = servers.get("s3").new_location()
                s3 = {"base": location.base, "options": location.storage_options}
            except Exception as exc:
                result.note(f"S3 not used: {describe_exception(exc)}")
                result.store = "local+memory"
        work = scratch / "resources"
        tmp = work / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        code, out, err = run_child(_CHILD, [str(cycles), str(work), json.dumps(s3)], timeout=3600,
                                   env=child_env(TMPDIR=str(tmp)))
        report = last_json_line(out)
        if report is None:
            result.trial(f"the cycling process exited with {code} and no report: {tail(err)}")
            return [result]
        result.trials = report["cycles"]
        for error in report["errors"]:
            result.fail(error)
        result.failures = report["error_count"] + (result.failures - len(report["errors"]))
        before, after = report["before"], report["after"]
        new_fds = {fd: target for fd, target in after["fds"].items() if before["fds"].get(fd) != target}
        if len(after["fds"]) > len(before["fds"]):
            result.fail(f"file descriptors {len(before['fds'])} -> {len(after['fds'])}: "
                        f"{first_line(str(sorted(new_fds.values())[:8]))}")
        if after["thread_count"] > before["thread_count"]:
            extra = sorted(set(after["threads"]) - set(before["threads"])) or after["threads"]
            result.fail(f"threads {before['thread_count']} -> {after['thread_count']}: {extra[:8]}")
        if len(after["tmp"]) > len(before["tmp"]):
            result.fail(f"TMPDIR entries {len(before['tmp'])} -> {len(after['tmp'])}: "
                        f"{sorted(set(after['tmp']) - set(before['tmp']))[:8]}")
        if len(after["children"]) > len(before["children"]):
            result.fail(f"child processes {len(before['children'])} -> {len(after['children'])}: "
                        f"{after['children'][:4]}")
        result.note(f"fds {len(before['fds'])}->{len(after['fds'])}, threads {before['thread_count']}->"
                    f"{after['thread_count']}, TMPDIR entries {len(before['tmp'])}->{len(after['tmp'])}, "
                    f"children {len(before['children'])}->{len(after['children'])}; "
                    f"{report['seconds']:.0f} s for {report['cycles']} cycles of {', '.join(report['kinds'])}")
    return [result]
