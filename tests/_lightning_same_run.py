"""One attempt of a Lightning fit for tests/e2e/test_resume_frameworks.py:
``python _lightning_same_run.py '<json>'``.

A small regressor with dropout, a shuffled ``DataLoader`` (``RandomSampler``, no generator of its own), three
epochs of 12 batches, deterministic algorithms on one CPU thread; taskpoint's ``CheckpointIO``,
``SaveOnPreemption`` and ``ResumeExactly``, a ``last.ckpt`` every 5 steps, resumed with ``ckpt_path="last"``.
It appends JSON lines to ``log``: ``step`` (the step, its loss as ``float.hex``, the sha256 of its batch and of
torch's generator state as the step began) from inside ``training_step``; ``saved`` once a ``last.ckpt`` is
committed; ``done`` with the sha256 of the final parameters. Options: ``root``; ``log``; ``leave_out``
(``"generators"`` or ``"position"``: a control whose resume drops that part of what ``ResumeExactly`` kept;
``"all"``: Lightning alone, without ``ResumeExactly``); ``terminate`` (``{"hook": ..., "step": ...}``: the process
sends itself SIGTERM from that hook of a callback after ``SaveOnPreemption``'s, at that step, once: after
``SaveOnPreemption`` checked for a notice there and before Lightning's own check).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import warnings
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import taskpoint.lightning
from taskpoint.generators import global_states

opts: dict[str, Any] = json.loads(sys.argv[1])
SAMPLES, BATCH, EPOCHS, SAVE_EVERY = 48, 4, 3, 5


def log(event: str, **fields: Any) -> None:
    with open(opts["log"], "a") as f:
        f.write(json.dumps({"event": event, **fields}) + "\n")


def sha256(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().contiguous().numpy().tobytes()).hexdigest()


class Regressor(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.3),
                                       torch.nn.Linear(32, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        generators = sha256(torch.get_rng_state())
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        log("step", step=self.trainer.global_step + 1, loss=loss.item().hex(), batch=sha256(x),
            generators=generators)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


class Committed(taskpoint.lightning.CheckpointIO):
    """The plug-in, logging each checkpoint once it is committed (what the test's SIGKILL waits for)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        if str(path).endswith("last.ckpt"):  # the one ckpt_path="last" resumes from
            log("saved", step=checkpoint["global_step"])


class LeavingOut(taskpoint.lightning.ResumeExactly):
    """The control: resumes with one part of what was kept replaced by what a fresh process has."""

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if opts["leave_out"] == "generators":
            state_dict = {**state_dict, "generators": global_states(), "epoch_start": global_states()}
        elif opts["leave_out"] == "position":
            state_dict = {**state_dict, "batches": 0}
        super().load_state_dict(state_dict)


class TerminateAfterTheCheck(L.Callback):
    """Sends this process SIGTERM from its ``hook`` (``on_train_batch_end`` or ``on_train_epoch_end``) at ``step``:
    a signal that lands after ``SaveOnPreemption``'s hook of that step, as one does that lands in the
    ``ModelCheckpoint`` save of the step (Lightning runs checkpoint callbacks last)."""

    def __init__(self, hook: str, step: int) -> None:
        self.hook, self.step = hook, step

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._terminate(trainer, "on_train_batch_end")

    def on_train_epoch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self._terminate(trainer, "on_train_epoch_end")

    def _terminate(self, trainer: L.Trainer, hook: str) -> None:
        if hook == self.hook and trainer.global_step == self.step:
            os.kill(os.getpid(), signal.SIGTERM)


def main() -> None:
    warnings.filterwarnings("ignore")
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    x = torch.randn(SAMPLES, 8, generator=torch.Generator().manual_seed(1))
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, x.sin().sum(1, keepdim=True)),
                                       batch_size=BATCH, shuffle=True)
    exactly = LeavingOut() if opts.get("leave_out") else taskpoint.lightning.ResumeExactly()
    callbacks = [exactly] if opts.get("leave_out") != "all" else []
    terminate = [TerminateAfterTheCheck(**opts["terminate"])] if opts.get("terminate") else []
    trainer = L.Trainer(
        default_root_dir=opts["root"], max_epochs=EPOCHS, logger=False, accelerator="cpu", devices=1,
        deterministic=True, plugins=[Committed()], enable_progress_bar=False, enable_model_summary=False,
        callbacks=[*callbacks, taskpoint.lightning.SaveOnPreemption(), *terminate,
                   ModelCheckpoint(every_n_train_steps=SAVE_EVERY, save_last=True)])
    model = Regressor()
    trainer.fit(model, train_dataloaders=data, ckpt_path="last")
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    log("done", step=trainer.global_step, params=sha256(params))


if __name__ == "__main__":
    main()
