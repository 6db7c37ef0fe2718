"""Faults on the wire: save/load cycles through the fault-injecting proxy (tests/_fault_proxy.py).

At 10% of requests failing (connection reset mid-body, stall past the client's timeout, 500, 503, response
cut short) every save/load cycle must succeed with the right content, thanks to the retries. At 100%, a
save and a load must raise ``StorageUnavailable`` in bounded time, and the previous checkpoint must load
intact once the faults stop.
"""

from __future__ import annotations

import dataclasses
import hashlib
import random
import shutil
import time
from pathlib import Path
from typing import Any

import taskpoint

from ._common import Result, Servers, check_state, describe_exception, remove_location, timed, write_state

#: The client's own timeouts: a stall is longer than these, so the client gives up on it.
S3_CLIENT = {"connect_timeout": 2, "read_timeout": 3, "retries": {"max_attempts": 2, "mode": "standard"}}
GCS_REQUEST_TIMEOUT = 3
STALL_SECONDS = 10.0
#: The brief's policy for the 10% runs.
CYCLE_RETRY = dict(attempts=8, initial_delay=0.05, max_delay=0.5)
#: Under a total outage: fewer attempts, so that the test ends; a deadline too where RetryPolicy has one.
OUTAGE_RETRY = dict(attempts=3, initial_delay=0.05, max_delay=0.5)
OUTAGE_DEADLINE = 30.0
#: Without a deadline option, the bound that issue 11 proposes as the documented default (item 17).
DEFAULT_BOUND = 120.0


def _policy(settings: dict[str, Any], deadline: float | None = None) -> tuple[taskpoint.RetryPolicy, float]:
    """A RetryPolicy, and the time a failing operation may take with it."""
    names = {f.name for f in dataclasses.fields(taskpoint.RetryPolicy)}
    for name in ("deadline", "total_deadline", "timeout", "max_elapsed"):
        if deadline is not None and name in names:
            return taskpoint.RetryPolicy(**settings, **{name: deadline}), deadline + 15.0
    return taskpoint.RetryPolicy(**settings), DEFAULT_BOUND


def proxied_options(kind: str, options: dict[str, Any], url: str) -> dict[str, Any]:
    options = {**options, "endpoint_url": url}
    if kind == "s3":
        options["config_kwargs"] = dict(S3_CLIENT)
    elif kind == "gcs":
        options["requests_timeout"] = GCS_REQUEST_TIMEOUT
    return options


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _cycle(i: int, base: str, options: dict[str, Any], retry: taskpoint.RetryPolicy, rng: random.Random,
           scratch: Path) -> str | None:
    """One save and load; None when both worked and the content is right, else what went wrong."""
    shape = ("bytes", "directory", "manager")[i % 3]
    work = scratch / f"cycle-{i}"
    try:
        if shape == "bytes":
            data = rng.randbytes(rng.choice([0, 1, rng.randrange(1, 300_000)]))
            dest = f"{base}/ckpt-{i % 4}"
            taskpoint.Checkpoint(dest, storage_options=options, retry=retry).save_sync(data)
            with taskpoint.Checkpoint(dest, dest, storage_options=options, retry=retry, workspace=work) as cp:
                path = cp.load_sync()
                got = None if path is None else path.read_bytes()
            if got != data:
                return f"cycle {i} (bytes): loaded {None if got is None else len(got)} bytes, saved {len(data)}"
        elif shape == "directory":
            state = write_state(work / "src", writer="faults", version=i, size=rng.randrange(1, 400_000),
                                seed=rng.randrange(2**32))
            dest = f"{base}/tree-{i % 4}"
            taskpoint.Checkpoint(dest, storage_options=options, retry=retry).save_sync(state)
            with taskpoint.Checkpoint(dest, dest, storage_options=options, retry=retry,
                                      workspace=work / "ws") as cp:
                path = cp.load_sync()
                if path is None:
                    return f"cycle {i} (directory): load returned None"
                if check_state(path) != ("faults", i):
                    return f"cycle {i} (directory): loaded {check_state(path)}, saved ('faults', {i})"
        else:
            state = write_state(work / "src", writer="faults", version=i, size=rng.randrange(1, 400_000),
                                seed=rng.randrange(2**32))
            with taskpoint.CheckpointManager(f"{base}/manager", storage_options=options, retry=retry, keep=2) as m:
                m.save(state, i)
                path = m.restore(i)
                if check_state(path) != ("faults", i):
                    return f"cycle {i} (manager): restored {check_state(path)}, saved ('faults', {i})"
    except Exception as exc:
        return f"cycle {i} ({shape}): {describe_exception(exc)}"
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return None


def run_store(servers: Servers, kind: str, cycles: int, outage: bool | str, rng: random.Random,
              scratch: Path) -> list[Result]:
    """``outage``: False, True (every fault kind) or "no-stall" (resets, 500/503 and cut responses only: a
    stall costs the client's timeout on each of its retries, which the bounded campaign cannot afford)."""
    from _fault_proxy import FaultProxy

    cycles_result = Result("Faults on the wire: 10% of requests fail", kind)
    outage_result = Result("Faults on the wire: 100% fail, then heal", kind)
    started_at = time.monotonic()  # the cycles' time ends where the outage's begins
    try:
        server = servers.get(kind)
    except Exception as exc:
        for r in (cycles_result, outage_result):
            r.skipped = True
            r.note(f"not run: {describe_exception(exc)}")
        return [cycles_result, outage_result]
    location = server.new_location()
    with FaultProxy(server.endpoint, seed=rng.randrange(2**32), rate=0.0, stall_seconds=STALL_SECONDS) as proxy:
        options = proxied_options(kind, location.storage_options, proxy.url)
        retry, _ = _policy(CYCLE_RETRY)
        proxy.rate = 0.10
        slowest = 0.0
        for i in range(cycles):
            started = time.monotonic()
            proxy.log.clear()
            error = _cycle(i, location.base, options, retry, rng, scratch)
            if error is not None:  # what the wire saw: faults injected and answers other than 2xx
                seen = [f"{m} {p.rsplit('/', 1)[-1] or p} {f or ''}{s or ''}" for m, p, f, s, *_ in list(proxy.log)
                        if f or (s is not None and not 200 <= s < 300)]
                error += f" [wire: {'; '.join(seen[-6:])}]"
            cycles_result.trial(error)
            slowest = max(slowest, time.monotonic() - started)
        stats = proxy.stats()
        faults = {k: v for k, v in stats.items() if k not in ("requests", "passed") and v}
        cycles_result.seconds = round(time.monotonic() - started_at, 1)
        cycles_result.note(f"{stats['requests']} requests, {sum(faults.values())} faults "
                           f"({', '.join(f'{k} {v}' for k, v in faults.items())}); slowest cycle {slowest:.1f} s")
        if outage:
            if outage == "no-stall":
                proxy.kinds = tuple(k for k in proxy.kinds if k != "stall")
                outage_result.note("stalls left out (bounded run)")
            with timed(outage_result):
                _outage(location.base, options, proxy, outage_result, rng, scratch)
        else:
            outage_result.skipped = True
            outage_result.note("not run in this mode")
    remove_location(location)
    return [cycles_result, outage_result]


def _outage(base: str, options: dict[str, Any], proxy: Any, result: Result, rng: random.Random,
            scratch: Path) -> None:
    good = b"the previous good checkpoint " + rng.randbytes(1000)
    dest, directory = f"{base}/outage", f"{base}/outage-manager"
    ok_retry, _ = _policy(CYCLE_RETRY)
    proxy.rate = 0.0
    taskpoint.Checkpoint(dest, storage_options=options, retry=ok_retry).save_sync(good)
    with taskpoint.CheckpointManager(directory, storage_options=options, retry=ok_retry) as m:
        m.save(good, 1)
    retry, bound = _policy(OUTAGE_RETRY, OUTAGE_DEADLINE)
    result.note(f"bound per operation {bound:.0f} s" + ("" if bound != DEFAULT_BOUND else
                                                       " (RetryPolicy has no deadline: issue 11 item 17's default)"))
    proxy.rate = 1.0
    slowest = 0.0

    def expect_unavailable(what: str, call: Any) -> None:
        nonlocal slowest
        started = time.monotonic()
        error = None
        try:
            call()
            error = f"{what} succeeded although every request failed"
        except taskpoint.StorageUnavailable:
            pass
        except Exception as exc:
            error = f"{what}: expected StorageUnavailable, got {describe_exception(exc)}"
        elapsed = time.monotonic() - started
        slowest = max(slowest, elapsed)
        if error is None and elapsed > bound:
            error = f"{what}: StorageUnavailable only after {elapsed:.0f} s (bound {bound:.0f} s)"
        result.trial(error)

    work = scratch / "outage"
    expect_unavailable("Checkpoint.save_sync", lambda: taskpoint.Checkpoint(
        dest, storage_options=options, retry=retry).save_sync(b"new state that must not land"))

    def load() -> None:
        with taskpoint.Checkpoint(dest, dest, storage_options=options, retry=retry, workspace=work / "a") as cp:
            cp.load_sync()

    expect_unavailable("Checkpoint.load_sync", load)

    def manager_save() -> None:
        m = taskpoint.CheckpointManager(directory, storage_options=options, retry=retry)
        try:
            m.save(b"new", 2)
        finally:
            m.close()

    def manager_restore() -> None:
        with taskpoint.CheckpointManager(directory, storage_options=options, retry=retry) as m:
            m.restore(1)

    expect_unavailable("CheckpointManager.save", manager_save)
    expect_unavailable("CheckpointManager.restore", manager_restore)
    proxy.rate = 0.0
    try:
        with taskpoint.Checkpoint(dest, dest, storage_options=options, retry=ok_retry, workspace=work / "b") as cp:
            path = cp.load_sync()
            got = None if path is None else path.read_bytes()
        with taskpoint.CheckpointManager(directory, storage_options=options, retry=ok_retry) as m:
            steps = m.steps()
            restored = m.restore(1).read_bytes()
        if got != good:
            result.trial(f"after the outage the checkpoint loaded {None if got is None else len(got)} bytes, not "
                         "the previous good one")
        elif steps != [1] or restored != good:
            result.trial(f"after the outage the manager has steps {steps} (expected [1]) or step 1 differs")
        else:
            result.trial()
    except Exception as exc:
        result.trial(f"loading the previous checkpoint after the outage: {describe_exception(exc)}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result.note(f"slowest failing operation {slowest:.0f} s")


def run(servers: Servers, kinds: dict[str, tuple[int, bool | str]], rng: random.Random,
        scratch: Path) -> list[Result]:
    """``kinds``: store kind -> (cycles at 10%, whether to run the 100% outage too: see :func:`run_store`)."""
    results: list[Result] = []
    for kind, (cycles, outage) in kinds.items():
        if cycles <= 0 and not outage:
            continue
        rows = run_store(servers, kind, cycles, outage, random.Random(rng.randrange(2**32)), scratch)
        for r in rows:
            print(f"  {r.scenario} [{kind}]: {r.trials} trials, {r.failures} failures ({r.seconds:.0f} s)", flush=True)
        results += rows
    return results
