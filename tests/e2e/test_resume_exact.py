"""A resumed run is the same run: a plain PyTorch loop with ``taskpoint.torch.TrainState``, interrupted twice
by real signals and resumed, gives the per-step losses and final parameters of the run never interrupted, bit
for bit; the same loop saving without the generators, or without the data position, does not.

Each attempt is tests/_resume_worker.py in a process of its own (forked from one that imported torch:
tests/_zygote.py; CPU, deterministic algorithms, dropout, a shuffled DataLoader, 3 epochs of 8 steps), on local
disk: what is tested is what is saved, not the store.
"""

from __future__ import annotations

import os
import random
import signal
from pathlib import Path
from typing import Any

import pytest

from _once import shared_once
from _zygote import TORCH
from helpers import WorkerProcess, requires

pytestmark = [pytest.mark.slow, requires("torch", "numpy")]

WORKER = Path(__file__).parents[1] / "_resume_worker.py"
STEPS = 24  # 3 epochs of 48 samples in batches of 6
EPOCH_STEPS = 8


def attempt(directory: Path, keep: str, *, pause_after: int | None = None, signal_to_send: int | None = None,
            background: bool = False) -> list[dict[str, Any]]:
    """One attempt of the loop: to its end, or stopped after the save of ``pause_after`` and then ended by
    ``signal_to_send`` (SIGKILL: there; SIGTERM: continued, to its next save, the preemption's safe point)."""
    worker = WorkerProcess(WORKER, {"directory": str(directory), "keep": keep, "pause_after": pause_after,
                                    "background": background}, TORCH)
    try:
        if pause_after is None:
            assert worker.process.wait(300) == 0, worker.stderr()
        else:
            assert signal_to_send is not None
            worker.wait_for("pausing", stopped=True)
            os.kill(worker.process.pid, signal_to_send)
            if signal_to_send != signal.SIGKILL:
                os.kill(worker.process.pid, signal.SIGCONT)
            status = worker.process.wait(300)
            expected = -signal.SIGKILL if signal_to_send == signal.SIGKILL else 128 + signal_to_send
            assert status == expected, (status, worker.stderr())
    finally:
        worker.kill()
    worker._reader.join(10)
    return worker.events


def run(directory: Path, keep: str, stops: list[int], how: int, *, background: bool = False
        ) -> tuple[dict[int, str], str | None, list[int | None]]:
    """Attempts until the loop ends, interrupted after the save of each step in ``stops``: the loss of every
    step (of the last attempt that ran it, after checking that attempts which ran the same step agree), the final
    parameters' digest, and the step each attempt resumed from."""
    losses: dict[int, str] = {}
    resumed: list[int | None] = []
    events: list[dict[str, Any]] = []
    for stop in [*stops, None]:
        events = attempt(directory, keep, pause_after=stop, signal_to_send=how if stop else None,
                         background=background)
        resumed += [e["step"] for e in events if e["event"] == "resumed"]
        for event in events:
            if event["event"] == "step":
                if keep == "all" and event["step"] in losses:  # replayed after a kill: the same step again
                    assert losses[event["step"]] == event["loss"], event
                losses[event["step"]] = event["loss"]
    done = [e for e in events if e["event"] == "done"]
    return losses, done[0]["params"] if done else None, resumed


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[int, str], str | None]:
    """The losses and final parameters of the run never interrupted: run once per session
    (:func:`_once.shared_once`), however many pytest-xdist workers run the tests that compare with it."""
    return shared_once(tmp_path_factory, "resume-exact-uninterrupted",
                       lambda: run_uninterrupted(tmp_path_factory.mktemp("uninterrupted")), 360)


def run_uninterrupted(directory: Path) -> tuple[dict[int, str], str | None]:
    losses, params, resumed = run(directory, "all", [], signal.SIGKILL)
    assert resumed == [None] and sorted(losses) == list(range(1, STEPS + 1))
    return losses, params


def two_stops(seed: int) -> list[int]:
    """Two steps to stop after, chosen at random (the seed is in every failure message)."""
    first = random.Random(seed).randrange(2, STEPS // 2)
    return [first, random.Random(seed + 1).randrange(first + 2, STEPS - 1)]


SEED = random.SystemRandom().randrange(1 << 30)


@pytest.mark.parametrize("how", [signal.SIGKILL, signal.SIGTERM], ids=["sigkill-after-save", "sigterm-preempted"])
def test_a_run_interrupted_twice_and_resumed_is_bit_identical_to_the_uninterrupted_run(tmp_path, uninterrupted, how):
    """SIGKILL: the process is killed right after a save (blocking saves). SIGTERM: the preemption notice makes
    the next save the safe point of the emergency save (background saves), which ends the process with 143."""
    stops = two_stops(SEED)
    losses, params, resumed = run(tmp_path / "steps", "all", stops, how, background=how == signal.SIGTERM)
    expected_resumed = [None, *stops] if how == signal.SIGKILL else [None, *(s + 1 for s in stops)]
    assert resumed == expected_resumed, (SEED, stops)
    assert losses == uninterrupted[0], (SEED, stops)
    assert params == uninterrupted[1], (SEED, stops)


@pytest.mark.parametrize("keep", ["no-rng", "no-data"])
def test_leaving_out_the_generators_or_the_data_position_makes_the_resumed_run_another_run(tmp_path, uninterrupted,
                                                                                           keep):
    """The controls: the same loop and interruption, the state saved without the generators (dropout and the
    items' noise differ after the resume) or without the loader's position (the epoch starts over, shuffled
    anew): the comparison that holds with both fails. The stop is inside an epoch: after an epoch's last step the
    next epoch starts from its first batch anyway, and a run resumed without the position is the same run."""
    first = two_stops(SEED)[0]
    stops = [first + 1 if first % EPOCH_STEPS == 0 else first]
    losses, params, resumed = run(tmp_path / "steps", keep, stops, signal.SIGKILL)
    assert resumed == [None, stops[0]]
    assert {s: losses[s] for s in range(1, stops[0] + 1)} == {s: uninterrupted[0][s] for s in range(1, stops[0] + 1)}
    assert losses != uninterrupted[0], (SEED, stops)
    assert params != uninterrupted[1], (SEED, stops)
