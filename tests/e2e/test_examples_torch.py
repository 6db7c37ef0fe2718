"""The PyTorch and Lightning examples, run as a user runs them: uninterrupted, failing, and killed then rerun.

Each example runs as a process of its own (forked from one that imported its framework: tests/_zygote.py) in a
temporary working directory with ``TASKPOINT_ROOT`` there too. A resumed run must start from the epoch after
the last save (never from epoch 0) and end with the weights of the uninterrupted run bit for bit: CPU kernels on
one thread are deterministic, ``torch.save``/``torch.load`` round-trip tensors exactly, and the examples restore
every piece of state an epoch depends on. Each uninterrupted run is run once per session (:func:`_once.shared_once`),
however many pytest-xdist workers run the tests that compare with it.
"""

from __future__ import annotations

import json
import os
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

import _zygote as zygote
from _once import shared_once
from helpers import requires

pytestmark = [pytest.mark.slow, requires("torch")]

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
TIMEOUT = 180

TORCH_EXAMPLE = "pytorch_task_checkpoint.py"
TORCH_EPOCHS = 6

LIGHTNING_EXAMPLE = "lightning_resume.py"
LIGHTNING_EPOCHS = 5
STEPS_PER_EPOCH = 4  # 128 samples in batches of 32
PRELOAD = {TORCH_EXAMPLE: zygote.TORCH, LIGHTNING_EXAMPLE: zygote.LIGHTNING}


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    result: dict[str, Any] | None  # what --out wrote; None when the process never got there

    def epochs_trained(self) -> list[int]:
        """The epochs this process trained and saved, in order, from the example's ``epoch E:`` lines."""
        return [int(e) for e in re.findall(r"^epoch (\d+):", self.stdout, re.MULTILINE)]


def run_example(example: str, workdir: Path, run_name: str, *args: str) -> Run:
    """Run ``examples/<example>`` with ``--run-name run_name`` and storage under ``workdir/root``."""
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "tmp").mkdir(exist_ok=True)  # the workspaces a SIGKILL leaves behind go with the test's files
    out = workdir / f"{run_name}-result.json"
    out.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    env.update(TASKPOINT_ROOT=str(workdir / "root"), TMPDIR=str(workdir / "tmp"))
    proc = zygote.run(PRELOAD[example], [str(EXAMPLES / example), "--run-name", run_name, "--out", str(out), *args],
                      env, cwd=workdir, timeout=TIMEOUT)  # a real process, forked from one that imported torch
    result = json.loads(out.read_text()) if out.exists() else None
    return Run(proc.returncode, proc.stdout, proc.stderr, result)


def ok(run: Run) -> dict[str, Any]:
    assert run.returncode == 0, f"stdout:\n{run.stdout}\nstderr:\n{run.stderr}"
    assert run.result is not None
    return run.result


def attempt_dirs(workdir: Path, run_name: str, action: str) -> list[str]:
    return sorted(p.name for p in (workdir / "root" / run_name / action).iterdir() if p.name.isdigit())


def assert_same_training(resumed: dict[str, Any], uninterrupted: dict[str, Any]) -> None:
    """Bit-for-bit: the digest of every parameter's bytes, then the values and the final loss as floats."""
    assert resumed["sha256"] == uninterrupted["sha256"]
    assert resumed["weights"] == uninterrupted["weights"]
    assert resumed["loss"] == uninterrupted["loss"]


# -- examples/pytorch_task_checkpoint.py ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def torch_uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    return shared_once(tmp_path_factory, "examples-torch-whole", lambda: run_example(
        TORCH_EXAMPLE, tmp_path_factory.mktemp("torch"), "whole", "--epochs", str(TORCH_EPOCHS)), TIMEOUT + 60)


def test_torch_example_trains_every_epoch_in_one_attempt(torch_uninterrupted: Run) -> None:
    result = ok(torch_uninterrupted)
    assert "attempt 1: started at epoch 0" in torch_uninterrupted.stdout
    assert "attempt 2" not in torch_uninterrupted.stdout
    assert torch_uninterrupted.epochs_trained() == list(range(TORCH_EPOCHS))
    assert (result["epochs"], result["attempt"]) == (TORCH_EPOCHS, 1)
    first = re.search(r"^epoch 0: loss ([0-9.]+)", torch_uninterrupted.stdout, re.MULTILINE)
    assert first is not None and result["loss"] < float(first[1]) / 4  # it learns
    assert f"result: {TORCH_EPOCHS} epochs" in torch_uninterrupted.stdout


def test_torch_example_resumes_after_each_failure_and_ends_with_identical_weights(
    tmp_path: Path, torch_uninterrupted: Run
) -> None:
    run = run_example(TORCH_EXAMPLE, tmp_path, "flaky", "--epochs", str(TORCH_EPOCHS),
                      "--fail-at-epoch", "1", "--fail-at-epoch", "3")
    result = ok(run)
    assert "attempt 1: failing on purpose after saving epoch 1" in run.stdout
    assert "attempt 2: resumed at epoch 2" in run.stdout
    assert "attempt 2: failing on purpose after saving epoch 3" in run.stdout
    assert "attempt 3: resumed at epoch 4" in run.stdout
    assert run.epochs_trained() == list(range(TORCH_EPOCHS))  # no epoch trained twice: never back to 0
    assert result["attempt"] == 3
    assert attempt_dirs(tmp_path, "flaky", "train") == ["1", "2", "3"]
    assert_same_training(result, ok(torch_uninterrupted))


# -- examples/lightning_resume.py -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def lightning_uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> Run:
    pytest.importorskip("lightning")
    return shared_once(tmp_path_factory, "examples-lightning-whole", lambda: run_example(
        LIGHTNING_EXAMPLE, tmp_path_factory.mktemp("lightning"), "whole", "--epochs", str(LIGHTNING_EPOCHS)),
        TIMEOUT + 60)


def test_lightning_example_trains_every_epoch_in_one_attempt(lightning_uninterrupted: Run) -> None:
    result = ok(lightning_uninterrupted)
    assert "attempt 1: started at epoch 0" in lightning_uninterrupted.stdout
    assert "attempt 2" not in lightning_uninterrupted.stdout
    assert lightning_uninterrupted.epochs_trained() == list(range(LIGHTNING_EPOCHS))
    assert result["global_step"] == LIGHTNING_EPOCHS * STEPS_PER_EPOCH
    assert (result["epochs"], result["attempt"]) == (LIGHTNING_EPOCHS, 1)


def test_lightning_example_resumes_from_the_latest_checkpoint_after_an_exception(
    tmp_path: Path, lightning_uninterrupted: Run
) -> None:
    run = run_example(LIGHTNING_EXAMPLE, tmp_path, "flaky", "--epochs", str(LIGHTNING_EPOCHS), "--fail-at-epoch", "1")
    result = ok(run)
    assert "attempt 1: failing on purpose after saving epoch 1" in run.stdout
    # Lightning itself reports where it resumed: after the restore, at the epoch and step after the save.
    assert (f"attempt 2: resumed at epoch 2, global step {2 * STEPS_PER_EPOCH}, "
            "from lightning_logs/version_0/checkpoints/last.ckpt") in run.stdout
    assert run.epochs_trained() == list(range(LIGHTNING_EPOCHS))
    assert (result["attempt"], result["global_step"]) == (2, LIGHTNING_EPOCHS * STEPS_PER_EPOCH)
    assert_same_training(result, ok(lightning_uninterrupted))


def test_lightning_example_rerun_after_sigkill_resumes_after_the_killed_epoch(
    tmp_path: Path, lightning_uninterrupted: Run
) -> None:
    kill_at = 2
    killed = run_example(LIGHTNING_EXAMPLE, tmp_path, "preempted", "--epochs", str(LIGHTNING_EPOCHS),
                         "--kill-at-epoch", str(kill_at))
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    assert killed.epochs_trained() == list(range(kill_at + 1))
    assert killed.result is None and "result:" not in killed.stdout

    rerun = run_example(LIGHTNING_EXAMPLE, tmp_path, "preempted", "--epochs", str(LIGHTNING_EPOCHS))
    result = ok(rerun)
    assert (f"attempt 2: resumed at epoch {kill_at + 1}, global step {(kill_at + 1) * STEPS_PER_EPOCH}, "
            "from lightning_logs/version_0/checkpoints/last.ckpt") in rerun.stdout
    assert rerun.epochs_trained() == list(range(kill_at + 1, LIGHTNING_EPOCHS))
    assert (result["attempt"], result["global_step"]) == (2, LIGHTNING_EPOCHS * STEPS_PER_EPOCH)
    assert attempt_dirs(tmp_path, "preempted", "fit") == ["1", "2"]
    assert_same_training(result, ok(lightning_uninterrupted))
