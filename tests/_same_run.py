"""The equivalence check of issue 45, shared by the framework tests: a run interrupted and resumed is the same run.

A worker script (``_lightning_same_run.py``, ``_hf_same_run.py``) trains in a real process and appends JSON lines
to a log: ``step`` (the step number, its loss as ``float.hex``, the sha256 of its batch and of torch's
generator state as the step began), ``saved`` (a checkpoint of that step is committed) and ``done`` (the
sha256 of the final parameters). :func:`interrupted` runs the worker and signals it at a chosen moment;
:func:`assert_same_run` compares every step record any attempt wrote with the uninterrupted run's.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from _zygote import LIGHTNING, TRANSFORMERS, Forked, spawn
from helpers import wait_until

#: The bound of one attempt: the worker imports torch and a framework and trains a few dozen tiny steps, which
#: took 30 s alone on the 2-core machine and 2-3 minutes beside four others at a load of 19; far above that, a
#: hang is a failure, not a slow machine.
ATTEMPT_TIMEOUT = 600.0
#: What the fork server of each worker imports ahead: its framework (5.4 CPU-s for Lightning).
PRELOAD = {"_lightning_same_run.py": LIGHTNING, "_hf_same_run.py": TRANSFORMERS}
#: The bound of a whole scenario (:func:`check_kill_twice_and_resume`), for ``pytest.mark.timeout``.
SCENARIO_TIMEOUT = 1800


def records(log: Path) -> list[dict[str, Any]]:
    """The events in ``log`` (none when it does not exist yet)."""
    if not log.exists():
        return []
    return [json.loads(line) for line in log.read_text().splitlines() if line.endswith("}")]


def steps(log: Path) -> dict[int, dict[str, Any]]:
    """The step records of ``log`` by step (the last one written for each step)."""
    return {r["step"]: r for r in records(log) if r["event"] == "step"}


def start(worker: Path, options: dict[str, Any], env: dict[str, str] | None = None) -> Forked:
    """The worker in a real process of its own, forked from a server that imported its framework once
    (tests/_zygote.py); its stdout and stderr in one pipe."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    environment.update(env or {})
    return spawn(PRELOAD[worker.name], [str(worker), json.dumps(options)], environment)


def finish(process: Forked) -> tuple[int, str]:
    """Its exit status and output, once it has ended (at most :data:`ATTEMPT_TIMEOUT`)."""
    try:
        output, _ = process.communicate(timeout=ATTEMPT_TIMEOUT)
    except subprocess.TimeoutExpired:
        process.kill()
        output, _ = process.communicate(timeout=30)
        raise AssertionError(f"the worker did not end within {ATTEMPT_TIMEOUT} s: {output[-3000:]}") from None
    return process.returncode, output


def run_to_end(worker: Path, options: dict[str, Any], env: dict[str, str] | None = None) -> None:
    status, output = finish(start(worker, options, env))
    assert status == 0, output[-3000:]
    assert records(Path(options["log"]))[-1]["event"] == "done", output[-3000:]


def interrupted(worker: Path, options: dict[str, Any], sig: signal.Signals, event: str, at_least: int,
                env: dict[str, str] | None = None) -> int:
    """Run the worker until its log has an ``event`` record (``step`` or ``saved``) of step ``at_least`` or later
    that this attempt wrote, send it ``sig``, and return its exit status."""
    log = Path(options["log"])
    before = len(records(log))
    process = start(worker, options, env)
    size = [log.stat().st_size if log.exists() else 0]

    def reached() -> bool:
        if process.poll() is not None:
            return True
        now = log.stat().st_size if log.exists() else 0
        if now == size[0]:  # parse the log only when it grew: the poll runs beside the training it waits for
            return False
        size[0] = now
        return any(r["event"] == event and r["step"] >= at_least for r in records(log)[before:])

    try:
        assert wait_until(reached, ATTEMPT_TIMEOUT), f"no {event} record of step {at_least} or later"
        assert process.poll() is None, f"the worker ended before step {at_least}: {finish(process)[1][-3000:]}"
        os.kill(process.pid, sig)
    except BaseException:
        process.kill()
        raise
    return finish(process)[0]


def assert_same_run(reference: Path, resumed: Path) -> None:
    """Every step record of ``resumed`` (each attempt's, a step replayed after a kill included) equals the
    reference's record of that step: the loss bit for bit, the batch, the generator state; every step was
    trained; the final parameters are the same bits."""
    expected = steps(reference)
    seen = [r for r in records(resumed) if r["event"] == "step"]
    for record in seen:
        assert record == expected[record["step"]], (record, expected[record["step"]])
    assert {r["step"] for r in seen} == set(expected)
    assert records(resumed)[-1] == records(reference)[-1]


def assert_not_same_run(reference: Path, resumed: Path) -> None:
    """The control: some step after the resume differs from the reference, and so do the final parameters."""
    expected = steps(reference)
    differing = [r["step"] for r in records(resumed) if r["event"] == "step" and r != expected.get(r["step"])]
    assert differing, "the control resumed to the same run: the comparison cannot tell a wrong resume"
    assert records(resumed)[-1]["params"] != records(reference)[-1]["params"]


def check_kill_twice_and_resume(worker: Path, tmp_path: Path, store: str, seed: int, kill_after: tuple[int, int],
                                terminate_at: tuple[int, int]) -> None:
    """The scenario of issue 45: an uninterrupted reference; an attempt SIGKILLed after a save of a step drawn
    from ``kill_after`` (or later), one SIGTERMed at a step drawn from ``terminate_at`` (or later; the preemption
    save, exit 143), one run to the end: the same run as the reference. ``seed`` draws the steps. Two controls
    resume the SIGKILLed attempt's checkpoint with ``leave_out`` set to ``"generators"`` and ``"position"``: each
    must differ from it. ``store`` is the worker's option naming where it saves. The reference and the controls
    run beside the attempts (one thread each)."""
    rng = random.Random(seed)
    killed_after, terminated_at = rng.randint(*kill_after), rng.randint(*terminate_at)
    tmp_path.mkdir(parents=True, exist_ok=True)
    reference = start(worker, {store: str(tmp_path / "reference"), "log": str(tmp_path / "reference.log")})
    run = {store: str(tmp_path / "run"), "log": str(tmp_path / "run.log")}
    assert interrupted(worker, run, signal.SIGKILL, "saved", killed_after) == -signal.SIGKILL
    controls = {}
    for part in ("generators", "position"):
        shutil.copytree(run[store], tmp_path / part)
        shutil.copy(run["log"], tmp_path / f"{part}.log")
        controls[part] = start(worker, {store: str(tmp_path / part), "log": str(tmp_path / f"{part}.log"),
                                        "leave_out": part})
    assert interrupted(worker, run, signal.SIGTERM, "step", terminated_at) == 143
    run_to_end(worker, run)

    status, output = finish(reference)
    assert status == 0, output[-3000:]
    assert_same_run(tmp_path / "reference.log", tmp_path / "run.log")
    for part, control in controls.items():
        status, output = finish(control)
        assert status == 0, (part, output[-3000:])
        assert_not_same_run(tmp_path / "reference.log", tmp_path / f"{part}.log")
