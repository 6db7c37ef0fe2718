"""Issue 45: a Hugging Face Trainer run killed mid-epoch and resumed is the same run as one never interrupted.

tests/_hf_same_run.py trains a tiny GPT-2 (dropout, the Trainer's shuffled sampler, 3 epochs, full determinism,
CPU) in real processes with taskpoint's ``CheckpointCallback`` and ``resume``, on local disk (the behaviour does
not depend on the store). One attempt is SIGKILLed after a committed step chosen at random, the next is
SIGTERMed at a random step (the callback's preemption save, exit 143), the third runs to the end: every step
any attempt trained has the loss, batch and generator state of the uninterrupted run, bit for bit, and so do the
final parameters. Two controls resume the SIGKILLed attempt's step without the generator states (no
``rng_state.pth``) or without the data position (``ignore_data_skip=True``): both must differ.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from _same_run import SCENARIO_TIMEOUT, check_kill_twice_and_resume
from helpers import requires

pytestmark = [pytest.mark.slow, requires("transformers", "accelerate", "torch")]

WORKER = Path(__file__).with_name("_hf_same_run.py")
STEPS, SAVE_EVERY = 24, 5  # 3 epochs of 8 steps, a step saved every 5: every save is mid-epoch


@pytest.mark.timeout(SCENARIO_TIMEOUT)
def test_sigkill_after_a_save_then_sigterm_resume_to_the_same_losses_batches_and_weights(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("TASKPOINT_TEST_SEED", "45")))
    killed_after, terminated_at = rng.randint(SAVE_EVERY, 2 * SAVE_EVERY), rng.randint(3 * SAVE_EVERY, STEPS - 2)
    check_kill_twice_and_resume(WORKER, tmp_path, "directory", killed_after, terminated_at)
