"""Concurrency: two processes save the same destination while a third loads it over and over.

Writers ``A`` and ``B`` save self-identifying states of different sizes (see ``_common.write_state``) to one
``Checkpoint`` destination (or, for the manager rows, the same steps of one ``CheckpointManager`` directory
with ``overwrite=True``) as fast as they can until the reader is done. A reader process loads in a loop, each
load with a fresh ``Checkpoint`` (or manager): every load must return one writer's complete state; an exception
(``CheckpointCorruptError`` included: it is a false "damaged") or a partial or mixed state is a failure.
Loads that only passed with the "loaded with the archive's own checks only" warning are counted in the notes.

The race is bounded by work done, not by the clock alone: the reader starts once both writers have saved once
and are saving again (so that it never finds nothing, and every load races both), and it stops after at least
the given number of loads *and* seconds; the writers stop when it does. On a loaded machine the race takes
longer instead of ending with fewer (or no) loads.

The docs say a ``Checkpoint`` destination has one writer at a time; issue 11 asks for this case all the
same (a zombie attempt and its replacement). Writers' own errors are reported in the notes.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import _zygote as zygote

from ._common import (
    Result,
    Servers,
    child_env,
    describe_exception,
    last_json_line,
    location_or_skip,
    remove_location,
    run_child,
    start_child,
    tail,
    timed,
)

_WRITER = textwrap.dedent("""
    import json, random, shutil, sys
    from pathlib import Path
    import taskpoint
    from reliability._common import describe_exception, write_state

    who, mode, target, options, size = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
    ready, stop, work = Path(sys.argv[6]), Path(sys.argv[7]), Path(sys.argv[8])
    rng = random.Random(who)
    saves, errors, version = 0, [], 0
    manager = None if mode == "checkpoint" else taskpoint.CheckpointManager(target, storage_options=options)
    cp = taskpoint.Checkpoint(target, storage_options=options) if mode == "checkpoint" else None
    first = True
    while first or not stop.exists():
        version += 1
        state = write_state(work / f"v{version}", writer=who, version=version,
                            size=size + rng.randrange(size // 2), seed=rng.randrange(2**32))
        try:
            if cp is not None:
                cp.save_sync(state)
            else:
                manager.save(state, version % 3, overwrite=True)
            saves += 1
        except BaseException as exc:
            errors.append(describe_exception(exc))
        shutil.rmtree(state, ignore_errors=True)
        if first:
            ready.touch()  # the reader starts once both writers are here
            first = False
    if manager is not None:
        manager.close()
    print(json.dumps({"saves": saves, "errors": errors[:5], "error_count": len(errors)}), flush=True)
""")

_READER = textwrap.dedent("""
    import json, shutil, sys, time, warnings
    from pathlib import Path
    import taskpoint
    from reliability._common import check_state, describe_exception

    mode, target, options = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    min_loads, min_seconds, ready_timeout = int(sys.argv[4]), float(sys.argv[5]), float(sys.argv[6])
    stop, work, ready = Path(sys.argv[7]), Path(sys.argv[8]), [Path(p) for p in sys.argv[9:]]
    loads, failures, unverified, seen = 0, [], 0, {}
    waited_until = time.monotonic() + ready_timeout
    while not all(p.exists() for p in ready):
        if time.monotonic() > waited_until:
            stop.touch()
            sys.exit(f"the writers had not both saved once after {ready_timeout:.0f} s")
        time.sleep(0.05)
    n = 0
    started = time.monotonic()
    while loads < min_loads or time.monotonic() - started < min_seconds:
        n += 1
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                if mode == "checkpoint":
                    with taskpoint.Checkpoint(target, target, storage_options=options, workspace=work / f"l{n}") as cp:
                        path = cp.load_sync()
                        if path is None:
                            raise AssertionError("load returned None although both writers had saved")
                        writer, version = check_state(path)
                else:
                    with taskpoint.CheckpointManager(target, storage_options=options) as m:
                        writer, version = check_state(m.restore())
                if writer not in ("A", "B"):
                    raise AssertionError(f"loaded a state of writer {writer!r}")
                seen[writer] = seen.get(writer, 0) + 1
            except BaseException as exc:
                failures.append(describe_exception(exc))
        unverified += any("checks only" in str(w.message) for w in caught)
        loads += 1
        shutil.rmtree(work / f"l{n}", ignore_errors=True)
    stop.touch()
    print(json.dumps({"loads": loads, "failures": failures[:8], "failure_count": len(failures),
                      "unverified": unverified, "seen": seen, "seconds": time.monotonic() - started}), flush=True)
""")

SIZES = {"local": 2 << 20, "s3": 1 << 20, "gcs": 1 << 20, "azure": 1 << 20}
#: Seconds the reader waits for both writers' first saves, and the parent for any process of a case to end (a
#: bound for a hang, far above what a loaded machine needs).
TIMEOUT = 600


def run_case(servers: Servers, kind: str, mode: str, seconds: float, loads: int, scratch: Path) -> Result:
    title = ("Concurrency: 2 writers + 1 reader, Checkpoint" if mode == "checkpoint"
             else "Concurrency: 2 writers + 1 reader, CheckpointManager")
    result = Result(title, kind)
    with timed(result):
        location = location_or_skip(servers, kind, scratch, result)
        if location is None:
            return result
        target = location.url("ckpt" if mode == "checkpoint" else "ckpts")
        options = json.dumps(location.storage_options)
        env = child_env()
        writers: list[zygote.Forked] = []
        raced = seconds
        work = scratch / f"concurrency-{kind}-{mode}"
        work.mkdir(parents=True, exist_ok=True)
        stop, ready = work / "stop", [work / "ready-A", work / "ready-B"]
        try:
            writers = [start_child(_WRITER, [who, mode, target, options, str(SIZES[kind]), str(marker), str(stop),
                                             str(work / who)], env)
                       for who, marker in zip(("A", "B"), ready, strict=True)]
            try:
                status, read, said = run_child(_READER, [mode, target, options, str(loads), str(seconds), str(TIMEOUT),
                                                         str(stop), str(work / "reader"), *map(str, ready)],
                                               timeout=seconds + 2 * TIMEOUT, env=env)
            finally:
                stop.touch()  # the writers end also when the reader did not
            reports = []
            for w in writers:
                out, err = w.communicate(timeout=TIMEOUT)
                reports.append(last_json_line(out) or {"saves": 0, "errors": [f"writer died: {tail(err)}"],
                                                       "error_count": 1})
            report = last_json_line(read)
            if report is None:
                result.trial(f"the reader exited with {status} and no report: {tail(said)}")
            else:
                result.trials = report["loads"]
                for failure in report["failures"]:
                    result.fail(failure)
                result.failures = report["failure_count"]
                result.note(f"loads saw A {report['seen'].get('A', 0)}, B {report['seen'].get('B', 0)}")
                raced = report["seconds"]
                if report["unverified"]:
                    result.note(f"{report['unverified']} loaded unverified (warning)")
            result.note(f"writers saved {reports[0]['saves']}+{reports[1]['saves']} times in {raced:.0f} s")
            writer_errors = reports[0]["error_count"] + reports[1]["error_count"]
            if writer_errors:
                first = (reports[0]["errors"] or reports[1]["errors"])[0]
                result.note(f"{writer_errors} writer save(s) raised, e.g. {first[:200]}")
        except Exception as exc:
            result.trial(f"the scenario broke: {describe_exception(exc)}")
        finally:
            for w in writers:
                if w.poll() is None:
                    w.kill()
                    w.wait()
        remove_location(location)
    return result


def run(servers: Servers, kinds: tuple[str, ...], seconds: float, loads: int, scratch: Path) -> list[Result]:
    """Each case races for at least ``seconds`` and ``loads`` loads (the reader stops when both are reached)."""
    results = []
    for mode in ("checkpoint", "manager"):
        for kind in kinds:
            results.append(run_case(servers, kind, mode, seconds, loads, scratch))
            r = results[-1]
            print(f"  {r.scenario} [{kind}]: {r.trials} loads, {r.failures} failures ({r.seconds:.0f} s)", flush=True)
    return results
