"""A SIGTERM that reaches Lightning's own check before ``SaveOnPreemption``'s still ends the fit with the
preemption save and status 143, and the resumed fit is the same run (issue 45).

Lightning 2.6 installs its own SIGTERM handler as the fit starts (it chains taskpoint's) and ends the fit with its
``SIGTERMException``, status 0, at its next check: after each batch's hooks and after the epoch's. A signal that
lands after ``SaveOnPreemption``'s hook of a step (in the ``ModelCheckpoint`` save of the step, which Lightning
runs after every other callback) used to be Lightning's alone: the attempt exited 0 with no preemption save, and
an orchestrator took the task as done. Here the worker (tests/_lightning_same_run.py, 3 epochs of 12 batches, a
``last.ckpt`` every 5 steps) sends itself SIGTERM from a callback placed between the two, at a chosen step: the
race made deterministic. The third place Lightning checks, after a validation batch's hooks, is tested in this
process (as tests/test_lightning_plugin.py tests a SIGTERM before them).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from _same_run import SCENARIO_TIMEOUT, assert_same_run, finish, run_to_end, start
from helpers import requires

pytestmark = [pytest.mark.slow, requires("lightning", "torch")]

WORKER = Path(__file__).resolve().parents[1] / "_lightning_same_run.py"


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


def test_a_sigterm_after_the_callbacks_check_of_a_validation_batch_saves_the_step_and_exits_143(
        tmp_path: Path) -> None:
    """The third place Lightning checks: after a validation batch's hooks (a validation inside the fit), where its
    evaluation loop ends the fit. In this process, with a real SIGTERM from a callback after ``SaveOnPreemption``."""
    import os
    import signal
    import warnings

    import lightning as L
    import torch

    import taskpoint.lightning as tl
    from _lightning_models import Regressor, StartedAt
    from taskpoint import preemption

    class TerminateAfterTheCheck(L.Callback):  # type: ignore[misc]
        def on_validation_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: object,
                                    batch: object, batch_idx: int, dataloader_idx: int = 0) -> None:
            if trainer.global_step == 5 and batch_idx == 0:  # not the last batch: Lightning checks after it
                os.kill(os.getpid(), signal.SIGTERM)

    class Validated(Regressor):
        def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.training_step(batch, batch_idx)

    def fit(max_steps: int, callbacks: list[L.Callback], ckpt_path: str | None = None) -> None:
        trainer = L.Trainer(default_root_dir=str(tmp_path / "run"), max_steps=max_steps, val_check_interval=5,
                            num_sanity_val_steps=0, logger=False, accelerator="cpu", devices=1,
                            plugins=[tl.CheckpointIO()], enable_progress_bar=False, enable_model_summary=False,
                            callbacks=[*callbacks, L.pytorch.callbacks.ModelCheckpoint(save_last=True)])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer.fit(Validated(), train_dataloaders=data, val_dataloaders=data, ckpt_path=ckpt_path)

    torch.manual_seed(0)
    x = torch.randn(40, 4)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sum(1, keepdim=True)), batch_size=4)
    try:
        with pytest.raises(SystemExit) as stopped:
            fit(30, [tl.SaveOnPreemption(), TerminateAfterTheCheck()])
    finally:
        preemption.clear()
        preemption.uninstall()
    assert stopped.value.code == 143
    last = str(tmp_path / "run" / "checkpoints" / "last.ckpt")
    assert tl.CheckpointIO().load_checkpoint(last)["global_step"] == 5
    started = StartedAt()
    fit(8, [started], ckpt_path=last)
    assert started.step == 5
