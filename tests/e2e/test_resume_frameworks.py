"""Issue 45: a Lightning fit and a Hugging Face Trainer run, killed mid-epoch and resumed, are the same run as
one never interrupted.

The workers train in real processes on one CPU thread with deterministic algorithms, a small model with dropout,
a shuffled loader, 3 epochs, on local disk (the behaviour does not depend on the store):
tests/_lightning_same_run.py with taskpoint's ``CheckpointIO``, ``SaveOnPreemption`` and ``ResumeExactly``
(36 steps, a ``last.ckpt`` every 5); tests/_hf_same_run.py, a tiny GPT-2 built from a config, with
``CheckpointCallback`` and ``resume`` (24 steps, a step every 5). One attempt is SIGKILLed after a save of a
random step, the next is SIGTERMed at a random step (the preemption save, exit 143), the third runs to the end:
every step any attempt trained has the loss, batch and generator state of the uninterrupted run, bit for bit,
and so do the final parameters. Two controls resume the SIGKILLed attempt's checkpoint without the generator
states or without the data position, and must differ (tests/_same_run.py).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import NamedTuple

import pytest

from _same_run import SCENARIO_TIMEOUT, check_kill_twice_and_resume
from helpers import requires

pytestmark = pytest.mark.slow

TESTS = Path(__file__).resolve().parents[1]


class Framework(NamedTuple):
    worker: Path
    store: str  # the worker's option naming where it saves
    kill_after: tuple[int, int]  # the steps the SIGKILL (after a save) is drawn from
    terminate_at: tuple[int, int]  # and the SIGTERM


FRAMEWORKS = [
    pytest.param(Framework(TESTS / "_lightning_same_run.py", "root", (5, 15), (20, 33)), id="lightning",
                 marks=requires("lightning", "torch")),
    pytest.param(Framework(TESTS / "_hf_same_run.py", "directory", (5, 10), (15, 22)), id="transformers",
                 marks=requires("transformers", "accelerate", "torch")),
]


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.timeout(SCENARIO_TIMEOUT)
def test_sigkill_after_a_save_then_sigterm_resume_to_the_same_losses_batches_and_weights(
        framework: Framework, tmp_path: Path) -> None:
    check_kill_twice_and_resume(framework.worker, tmp_path, framework.store,
                                int(os.environ.get("TASKPOINT_TEST_SEED", "45")), framework.kill_after,
                                framework.terminate_at)


@pytest.mark.parametrize("framework", FRAMEWORKS)
@pytest.mark.campaign("the same-run scenario at 10 pairs of random kill steps")
@pytest.mark.timeout(10 * SCENARIO_TIMEOUT)
def test_same_run_campaign(framework: Framework, tmp_path: Path) -> None:
    for seed in range(10):
        check_kill_twice_and_resume(framework.worker, tmp_path / f"seed-{seed}", framework.store, seed,
                                    framework.kill_after, framework.terminate_at)


@requires("transformers", "accelerate", "torch")
def test_the_callback_warns_of_the_trainer_settings_that_make_a_resumed_run_differ(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from transformers import TrainerControl, TrainerState, TrainingArguments

    from taskpoint.transformers import CheckpointCallback

    def warnings_at_train_begin(**settings: object) -> list[str]:
        args = TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **settings)
        callback = CheckpointCallback(tmp_path / "steps")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="taskpoint"):
            callback.on_train_begin(args, TrainerState(), TrainerControl())
        callback.on_train_end(args, TrainerState(), TrainerControl())
        return [r.getMessage() for r in caplog.records if r.name == "taskpoint"]

    assert warnings_at_train_begin() == []
    [warned] = warnings_at_train_begin(ignore_data_skip=True, save_only_model=True,
                                       accelerator_config={"use_seedable_sampler": False})
    assert "will not be the interrupted run" in warned
    assert all(setting in warned for setting in ("ignore_data_skip=True", "save_only_model=True",
                                                 "use_seedable_sampler=False"))
