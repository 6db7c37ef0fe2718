"""Concurrency: two processes save the same destination while a third loads it over and over.

Writers ``A`` and ``B`` save self-identifying states of different sizes (see ``_common.write_state``) to one
``Checkpoint`` destination (or, for the manager rows, the same steps of one ``CheckpointManager`` directory
with ``overwrite=True``) as fast as they can for the given time. A reader process loads in a loop, each load
with a fresh ``Checkpoint`` (or manager): every load must return one writer's complete state; an exception
(``CheckpointCorruptError`` included: it is a false "damaged") or a partial or mixed state is a failure.
Loads that only passed with the "loaded with the archive's own checks only" warning are counted in the notes.

The docs say a ``Checkpoint`` destination has one writer at a time; issue 11 asks for this case all the
same (a zombie attempt and its replacement). Writers' own errors are reported in the notes.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from ._common import (
    CHILD_PRELUDE,
    Result,
    Servers,
    child_env,
    describe_exception,
    last_json_line,
    location_or_skip,
    remove_location,
    tail,
    timed,
)

_WRITER = textwrap.dedent("""
    import json, random, shutil, sys, time
    from pathlib import Path
    import taskpoint
    from reliability._common import describe_exception, write_state

    who, mode, target, options, size = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4]), int(sys.argv[5])
    until, work = float(sys.argv[6]), Path(sys.argv[7])
    rng = random.Random(who)
    saves, errors, version = 0, [], 0
    manager = None if mode == "checkpoint" else taskpoint.CheckpointManager(target, storage_options=options)
    cp = taskpoint.Checkpoint(target, storage_options=options) if mode == "checkpoint" else None
    first = True
    while first or time.time() < until:
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
            print("first", flush=True)
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
    until, work = float(sys.argv[4]), Path(sys.argv[5])
    loads, failures, unverified, seen = 0, [], 0, {}
    n = 0
    while time.time() < until:
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
    print(json.dumps({"loads": loads, "failures": failures[:8], "failure_count": len(failures),
                      "unverified": unverified, "seen": seen}), flush=True)
""")

SIZES = {"local": 2 << 20, "s3": 1 << 20, "gcs": 1 << 20, "azure": 1 << 20}


def run_case(servers: Servers, kind: str, mode: str, seconds: float, scratch: Path) -> Result:
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
        writers = []
        try:
            start_file = scratch / f"concurrency-{kind}-{mode}"
            for who in ("A", "B"):
                writers.append(subprocess.Popen(
                    [sys.executable, "-c", CHILD_PRELUDE + _WRITER, who, mode, target, options, str(SIZES[kind]),
                     "0", str(start_file / who)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env))
            # Each writer saves once before the clock starts, so the reader never finds nothing. The writers
            # were given a deadline of 0: they stop after that first save, and are started again below.
            for w in writers:
                out, err = w.communicate(timeout=300)
                if "first" not in out:
                    raise RuntimeError(f"a writer failed its first save: {tail(err)}")
            until = time.time() + seconds
            writers = [subprocess.Popen(
                [sys.executable, "-c", CHILD_PRELUDE + _WRITER, who, mode, target, options, str(SIZES[kind]),
                 str(until), str(start_file / who)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                env=env) for who in ("A", "B")]
            reader = subprocess.run(
                [sys.executable, "-c", CHILD_PRELUDE + _READER, mode, target, options, str(until + 2),
                 str(start_file / "reader")], capture_output=True, text=True, env=env, timeout=seconds + 600)
            reports = []
            for w in writers:
                out, err = w.communicate(timeout=600)
                reports.append(last_json_line(out) or {"saves": 0, "errors": [f"writer died: {tail(err)}"],
                                                       "error_count": 1})
            report = last_json_line(reader.stdout)
            if report is None:
                result.trial(f"the reader exited with {reader.returncode} and no report: {tail(reader.stderr)}")
            else:
                result.trials = report["loads"]
                for failure in report["failures"]:
                    result.fail(failure)
                result.failures = report["failure_count"]
                result.note(f"loads saw A {report['seen'].get('A', 0)}, B {report['seen'].get('B', 0)}")
                if report["unverified"]:
                    result.note(f"{report['unverified']} loaded unverified (warning)")
            result.note(f"writers saved {reports[0]['saves']}+{reports[1]['saves']} times in {seconds:.0f} s")
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


def run(servers: Servers, kinds: tuple[str, ...], seconds: float, scratch: Path) -> list[Result]:
    results = []
    for mode in ("checkpoint", "manager"):
        for kind in kinds:
            results.append(run_case(servers, kind, mode, seconds, scratch))
            r = results[-1]
            print(f"  {r.scenario} [{kind}]: {r.trials} loads, {r.failures} failures ({r.seconds:.0f} s)", flush=True)
    return results
