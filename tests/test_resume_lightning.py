"""Issue 45: a Lightning fit killed mid-epoch and resumed is the same run as one never interrupted.

tests/_lightning_same_run.py trains in real processes (dropout, a shuffled loader, 3 epochs, deterministic
algorithms, CPU) with taskpoint's ``CheckpointIO``, ``SaveOnPreemption`` and ``ResumeExactly``, on local disk
(the behaviour does not depend on the store). One attempt is SIGKILLed after a save at a random step, the next
is SIGTERMed at a random step (the plug-in's preemption save, exit 143), the third runs to the end: every step
any attempt trained has the loss, batch and generator state of the uninterrupted run, bit for bit, and so do the
final parameters. Two controls resume the SIGKILLed attempt's checkpoint without the generator states or
without the data position: both must differ from the uninterrupted run.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from _same_run import SCENARIO_TIMEOUT, check_kill_twice_and_resume
from helpers import requires

pytestmark = [pytest.mark.slow, requires("lightning", "torch")]

WORKER = Path(__file__).with_name("_lightning_same_run.py")
STEPS, SAVE_EVERY = 36, 5  # 3 epochs of 12 batches, a last.ckpt every 5 steps: every save is mid-epoch


@pytest.mark.timeout(SCENARIO_TIMEOUT)
def test_sigkill_after_a_save_then_sigterm_resume_to_the_same_losses_batches_and_weights(tmp_path: Path) -> None:
    rng = random.Random(int(os.environ.get("TASKPOINT_TEST_SEED", "45")))
    killed_after, terminated_at = rng.randint(SAVE_EVERY, 3 * SAVE_EVERY), rng.randint(4 * SAVE_EVERY, STEPS - 3)
    check_kill_twice_and_resume(WORKER, tmp_path, "root", killed_after, terminated_at)
