"""A SIGTERM that reaches Lightning's own check before ``SaveOnPreemption``'s still ends the fit with the
preemption save and status 143, and the resumed fit is the same run (issue 45).

Lightning 2.6 installs its own SIGTERM handler as the fit starts (it chains taskpoint's) and ends the fit with its
``SIGTERMException``, status 0, at its next check: after each batch's hooks and after the epoch's. A signal that
lands after ``SaveOnPreemption``'s hook of a step (in the ``ModelCheckpoint`` save of the step, which Lightning
runs after every other callback) used to be Lightning's alone: the attempt exited 0 with no preemption save, and
an orchestrator took the task as done. Here the worker (tests/_lightning_same_run.py, 3 epochs of 12 batches, a
``last.ckpt`` every 5 steps) sends itself SIGTERM from a callback placed between the two, at a chosen step: the
race made deterministic.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _same_run import SCENARIO_TIMEOUT, assert_same_run, finish, run_to_end, start
from helpers import requires

pytestmark = [pytest.mark.slow, requires("lightning", "torch")]

WORKER = Path(__file__).resolve().parent / "_lightning_same_run.py"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The log of the uninterrupted fit."""
    folder = tmp_path_factory.mktemp("reference")
    run_to_end(WORKER, {"root": str(folder / "root"), "log": str(folder / "reference.log")})
    return folder / "reference.log"


@pytest.mark.parametrize(("hook", "step"), [
    ("on_train_batch_end", 20),  # mid-epoch, a step ModelCheckpoint saves: the draw the scenario failed at
    ("on_train_epoch_end", 24),  # the end of the second epoch, where Lightning checks after the epoch's hooks
])
@pytest.mark.timeout(SCENARIO_TIMEOUT)
def test_a_sigterm_after_the_callbacks_check_saves_exits_143_and_resumes_to_the_same_run(
        reference: Path, tmp_path: Path, hook: str, step: int) -> None:
    run = {"root": str(tmp_path / "root"), "log": str(tmp_path / "run.log")}
    status, output = finish(start(WORKER, {**run, "terminate": {"hook": hook, "step": step}}))
    assert status == 143, output[-3000:]
    assert f"taskpoint: preempted (SIGTERM): saved step {step} to " in output, output[-3000:]
    run_to_end(WORKER, run)
    assert_same_run(reference, tmp_path / "run.log")
