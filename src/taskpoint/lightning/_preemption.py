"""``SaveOnPreemption``: a preemption notice becomes a checkpoint where ``ckpt_path="last"`` finds it, then exit 143."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.plugins.io import AsyncCheckpointIO
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from taskpoint import preemption

#: The exit status after a preemption save: 128 + SIGTERM, what a process ended by SIGTERM reports, so that an
#: orchestrator counts the attempt as failed and retries it (never 0, which would end the task as done).
PREEMPTED_EXIT_STATUS = 143


class SaveOnPreemption(Callback):
    """On SIGTERM (or a spot notice, see :mod:`taskpoint.preemption`), stop at the next batch end, of training or
    of a validation inside the fit (or the epoch's end, when the notice comes after its last batch), save a
    checkpoint of that step through the trainer, wait for its commit, and exit with status 143.

    The handler is :func:`taskpoint.preemption.install`, put in place at ``setup``; Lightning's own SIGTERM
    handler, installed after it as the fit starts, chains it. Lightning's handler marks the trainer
    (``trainer.received_sigterm``), and its loops end the fit with a ``SIGTERMException`` (a ``SystemExit`` of
    status 0) at their next check: after each batch's hooks, the epoch's, and a validation batch's. A SIGTERM that
    lands after this callback's hook of the batch (in a ``ModelCheckpoint`` save that runs after it, say) reaches
    Lightning's check first: :meth:`on_exception`, where Lightning hands its ``SIGTERMException`` to the callbacks,
    saves the step there and sets the exception's status to 143.
    The checkpoint is ``last.ckpt`` in the folder of the trainer's ``ModelCheckpoint`` (its ``dirpath``, resolved
    by Lightning at setup), where ``trainer.fit(ckpt_path="last")`` finds it (with checkpointing disabled it goes
    to ``default_root_dir/checkpoints/last.ckpt``, which ``"last"`` does not search: pass that path);
    ``trainer.save_checkpoint`` writes it on rank 0 only, as Lightning does, and every rank waits for it before
    leaving. All ranks agree on the step: a rank
    that saw the notice stops them all (``reduce_boolean_decision``).

    The exit status is :attr:`exit_status`, 143 (128 + SIGTERM, what a process ended by SIGTERM reports), so
    that an orchestrator counts the attempt as failed and retries it; never 0, which would end the task as done.

    Args:
        filename: the name of the checkpoint in that folder (default ``last.ckpt``; another ``last-*.ckpt``
            name is found by ``"last"`` too).
    """

    exit_status = PREEMPTED_EXIT_STATUS

    def __init__(self, filename: str | None = None) -> None:
        self.filename = filename

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":
            preemption.install()

    def target(self, trainer: pl.Trainer) -> str:
        """Where the preemption checkpoint goes."""
        callback = trainer.checkpoint_callback
        if isinstance(callback, ModelCheckpoint) and callback.dirpath is not None:
            folder = str(callback.dirpath)
            name = self.filename or callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION
        else:
            folder = os.path.join(str(trainer.default_root_dir), "checkpoints")
            name = self.filename or "last.ckpt"
        return folder.rstrip("/") + "/" + name if "://" in folder else os.path.join(folder, name)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._stop_if_preempted(trainer)

    def on_validation_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        # Validation inside a fit: Lightning's evaluation loop would end the fit right after this hook (its
        # SIGTERMException, status 0); save the step the training reached instead.
        if trainer.state.fn == "fit":
            self._stop_if_preempted(trainer)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A notice after the epoch's last batch end: Lightning would end the fit right after this hook, exit 0.
        self._stop_if_preempted(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        # Lightning's SIGTERMException, raised at its check after this callback's hook had passed: the step is
        # trained and the loops' counters say so (Lightning resumes a checkpoint taken here as one taken at the
        # batch's or the epoch's end). Lightning tears the fit down and re-raises it after this hook: with status
        # 143 it ends the process as this callback's own SystemExit does.
        if isinstance(exception, SIGTERMException) and trainer.state.fn == "fit" and self._save_if_preempted(trainer):
            exception.code = self.exit_status

    def _stop_if_preempted(self, trainer: pl.Trainer) -> None:
        if self._save_if_preempted(trainer):
            raise SystemExit(self.exit_status)

    def _save_if_preempted(self, trainer: pl.Trainer) -> bool:
        """If a rank saw the notice: save, wait for the commit on every rank, log it, and say so."""
        noticed = preemption.notice() is not None
        if not trainer.strategy.reduce_boolean_decision(noticed, all=False):
            return False
        path = self.target(trainer)
        notice = preemption.notice()
        with preemption.emergency():
            trainer.save_checkpoint(path)
            _wait_for_commit(trainer)
            trainer.strategy.barrier("taskpoint.lightning.SaveOnPreemption")
        preemption.ending("taskpoint: preempted (%s): saved step %d to %s; exiting with status %d",
                          notice.name if notice else "another rank", trainer.global_step, path, self.exit_status)
        return True


def _wait_for_commit(trainer: pl.Trainer) -> None:
    """A synchronous plug-in has committed when ``save_checkpoint`` returns; ``AsyncCheckpointIO`` saves in a
    thread, and its ``teardown`` waits for every save it queued (and raises the first failure)."""
    io: Any = trainer.strategy.checkpoint_io
    while isinstance(io, _WrappingCheckpointIO):
        if isinstance(io, AsyncCheckpointIO):
            io.teardown()
            return
        io = io.checkpoint_io
