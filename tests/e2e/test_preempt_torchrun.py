"""Preemption of a 4-rank job launched by the real ``torchrun`` binary: every rank saves its shard of one
agreed step, the step commits whole, every rank exits 143, and the relaunch (or the agent's own restart with
``--max-restarts 1``) resumes from it.

What tests/e2e/test_preempt_ranks.py cannot show, since it starts the ranks itself: torchrun's elastic agent
watches its workers, and when one exits it sends SIGTERM to the others and SIGKILL 30 s later (and, with
restarts left, starts them all again). Before the fix a rank > 0 exited right after storing its shard, and
the agent's SIGTERM then ended the ranks still on their way to the step: no emergency step, in every trial.

The workers are tests/_preempt_ranks_worker.py (``train`` mode, one rank 4x slower than the fastest, the
schedule and the moment of the signal drawn from a fixed seed); the SIGTERMs go to the workers' pids, as a
preemption signals every process of the node. Every wait is bounded; nothing asserts how long anything took.
"""

from __future__ import annotations

import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import taskpoint

WORKER = Path(__file__).parents[1] / "_preempt_ranks_worker.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
WORLD = 4
#: Bounds of the waits below (seconds): generous, since 4 workers import torch on 2 busy cores.
READY_WITHIN, EXIT_WITHIN = 240.0, 300.0
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun beside python")]


class Job:
    """One ``torchrun --standalone --nproc-per-node 4`` of the worker; its workers' JSON lines are collected
    on a thread (the agent's lines, on stderr, on another)."""

    def __init__(self, args: dict[str, Any], *options: str) -> None:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "TASKPOINT_GRACE_SECONDS": "60",
               "PYTHONPATH": os.pathsep.join(sys.path)}
        self.proc = subprocess.Popen([str(TORCHRUN), "--standalone", f"--nproc-per-node={WORLD}", *options,
                                      str(WORKER), json.dumps(args)], env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue[dict[str, Any]] = queue.Queue()
        self.events: list[dict[str, Any]] = []
        self.err: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr or ()), daemon=True).start()

    def _read(self) -> None:
        decoder = json.JSONDecoder()
        for line in self.proc.stdout or ():
            at = line.find("{")
            while at >= 0:  # four processes share the pipe: a line may hold more than one event
                event, end = decoder.raw_decode(line, at)
                self.lines.put(event)
                at = line.find("{", end)

    def until(self, event: str, count: int, within: float) -> list[dict[str, Any]]:
        """The first ``count`` events named ``event`` (waiting at most ``within`` seconds for them)."""
        end = time.monotonic() + within
        while len(found := [e for e in self.events if e["event"] == event]) < count:
            if not self._reader.is_alive() and self.lines.empty():
                raise AssertionError(f"torchrun's output ended before {count} {event!r}:\n"
                                     f"{self.stderr()}")
            try:
                self.events.append(self.lines.get(timeout=max(0.0, min(1.0, end - time.monotonic()))))
            except queue.Empty:
                if time.monotonic() >= end:
                    raise AssertionError(f"no {count} {event!r} within {within} s:\n{self.stderr()}") from None
        return found[:count]

    def finish(self) -> int:
        """torchrun's exit status, once it ended (killed, and failing the test, after :data:`EXIT_WITHIN`)."""
        try:
            self.proc.wait(EXIT_WITHIN)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(30)
            raise AssertionError(f"torchrun did not end within {EXIT_WITHIN} s:\n{self.stderr()}") from None
        self._reader.join(30)  # its end of file follows the last worker's exit
        while not self.lines.empty():
            self.events.append(self.lines.get_nowait())
        return self.proc.returncode

    def stderr(self) -> str:
        return "".join(self.err)[-4000:]

    def exit_codes(self) -> dict[int, int]:
        """Each rank's exit status, from the failure summary torchrun prints when its workers failed."""
        summary = "".join(self.err)
        return {int(rank): int(code) for rank, code in
                re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)", summary)}


def schedule(rng: random.Random) -> list[float]:
    """Each rank's step-time factor: one rank 4x slower than the fastest, the others between 1x and 2x."""
    factors = [round(rng.uniform(1.0, 2.0), 2) for _ in range(WORLD)]
    factors[rng.randrange(WORLD)] = 4.0
    return factors


def trial(store: Any, rng: random.Random, *, group: bool, one_rank: bool, restarts: int) -> str:
    """One preemption of a job launched by torchrun in ``store``, checked; one line saying what happened."""
    directory = f"{store.base}/job"
    with taskpoint.CheckpointManager(directory, storage_options=store.storage_options, preemption=False) as mgr:
        before = mgr.latest_step()
    factor = schedule(rng)
    args = {"mode": "train", "directory": directory, "options": store.storage_options, "group": group,
            "every": 7, "base": 0.01, "factor": factor, "ready_at": (before or 0) + 3, "restarted_ends": True}
    job = Job(args, f"--max-restarts={restarts}")
    pids = [e["pid"] for e in sorted(job.until("ready", WORLD, READY_WITHIN), key=lambda e: e["rank"])]
    time.sleep(rng.uniform(0.0, 0.6))  # a random moment of the run, drawn from the seed
    targets = [rng.randrange(WORLD)] if one_rank else list(range(WORLD))
    for rank in targets:
        os.kill(pids[rank], signal.SIGTERM)
    stops = sorted(job.until("preempted", WORLD, EXIT_WITHIN), key=lambda e: e["rank"])
    status = job.finish()
    steps = {e["step"] for e in stops}
    assert len(steps) == 1 and None not in steps, f"no one emergency step: {stops}\n{job.stderr()}"
    (emergency,) = steps
    assert all(e["status"] == 143 for e in stops), stops
    with taskpoint.CheckpointManager(directory, storage_options=store.storage_options, preemption=False) as mgr:
        assert mgr.latest_step() == emergency
        manifest = json.loads(mgr._steps.object(emergency, "taskpoint.json").read_small() or b"{}")
        assert [s["rank"] for s in manifest["content"]["shards"]] == list(range(WORLD))
    if restarts:  # the agent started the workers again: they resumed from the emergency step, and ended
        assert status == 0, job.stderr()
        resumed = [e for e in job.events if e["event"] == "resumed" and e["restart"] == 1]
    else:  # every rank ended with 143 (the agent's summary), and a relaunch resumes from the step
        assert status != 0 and job.exit_codes() == dict.fromkeys(range(WORLD), 143), job.stderr()
        again = Job({"mode": "resume", "directory": directory, "options": store.storage_options})
        resumed = again.until("resumed", WORLD, READY_WITHIN)
        assert again.finish() == 0, again.stderr()
    assert {e["rank"]: (e["step"], e["sha"]) for e in resumed} == {e["rank"]: (emergency, e["sha"]) for e in stops}
    return f"factors {factor}, signalled {targets}, emergency step {emergency}, torchrun {status}"


def _cases() -> Any:
    """(store, group, one_rank, restarts, trials): each agreement, each kind of signal and both ways of coming
    back once in make test; 5 trials of each in make reliability's campaign."""
    bounded = [("local", False, False, 0), ("s3", False, True, 1), ("local", True, False, 1), ("s3", True, True, 0)]
    cases = []
    for store, group, one, restarts in bounded:
        name = f"{'process-group' if group else 'storage'}-{'one-rank' if one else 'all-ranks'}-restarts{restarts}"
        cases.append(pytest.param(store, group, one, restarts, 1, id=f"1-{name}-{store}",
                                  marks=pytest.mark.timeout(2 * READY_WITHIN + 2 * EXIT_WITHIN)))
        cases.append(pytest.param(store, group, one, restarts, 5, id=f"5-{name}-{store}",
                                  marks=[pytest.mark.timeout(3000),
                                         pytest.mark.campaign("5 preemptions under the real torchrun per case")]))
    return pytest.mark.parametrize(("store", "group", "one_rank", "restarts", "trials"), cases, indirect=["store"])


@_cases()
def test_sigterm_under_torchrun_commits_one_emergency_step_and_every_rank_exits_143(
        store: Any, group: bool, one_rank: bool, restarts: int, trials: int) -> None:
    if group:
        pytest.importorskip("torch")
    rng = random.Random(40 + trials)
    lines = [f"trial {n}: {trial(store, rng, group=group, one_rank=one_rank, restarts=restarts)}"
             for n in range(trials)]
    print("\n" + "\n".join(lines))
