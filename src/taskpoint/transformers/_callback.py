"""The ``TrainerCallback``: each checkpoint the Trainer writes becomes a step of a :class:`CheckpointManager`.

The Trainer writes ``output_dir/checkpoint-{global_step}`` and then calls ``on_save``; the callback saves that
folder as step ``global_step``. A background save snapshots the folder before ``save`` returns, so the Trainer
may rotate or delete it right after (``save_total_limit``).
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from taskpoint import CheckpointManager, Preempted, Retention, preemption

#: The Trainer's name for its checkpoint folders (``transformers.trainer_utils.PREFIX_CHECKPOINT_DIR``).
FOLDER_PREFIX = "checkpoint-"
#: Where the Trainer writes when ``output_dir`` is None (``TrainingArguments`` fills it in; older versions did not).
DEFAULT_OUTPUT_DIR = "trainer_output"

_log = logging.getLogger("taskpoint")


def not_the_same_run(args: TrainingArguments) -> list[str]:
    """The settings of ``args`` with which a resumed run draws other batches or other random numbers than the run
    it resumes (the Trainer keeps both by default: its ``rng_state.pth`` and its skip of the trained batches)."""
    unlike = []
    if args.ignore_data_skip:
        unlike.append("ignore_data_skip=True trains the resumed epoch from its first batch again")
    if args.save_only_model:
        unlike.append("save_only_model=True saves neither the optimizer nor the random generators")
    if not getattr(args.accelerator_config, "use_seedable_sampler", True):
        unlike.append("use_seedable_sampler=False draws the resumed epoch's order before the Trainer puts the "
                      "saved generators back")
    return unlike


class CheckpointCallback(TrainerCallback):
    """Store every checkpoint the Trainer saves as step ``global_step`` of a manager at ``directory``.

    Args:
        directory: any fsspec URL or local path (``s3://bucket/run-7/hf``), the manager's directory.
        storage_options: for the store (credentials, endpoint), as for :class:`~taskpoint.CheckpointManager`.
        keep: how many of the newest steps to keep; None follows ``args.save_total_limit`` (None keeps all).
        dedup: store each file once across steps (consecutive checkpoints share most bytes).
        blocking: wait for each upload in ``on_save``; by default it runs in the background and
            ``on_train_end`` waits for the last one.

    On a preemption notice (SIGTERM, or ``$TASKPOINT_PREEMPTION_SIGNALS``), the next ``on_step_end`` asks the
    Trainer to save and stop; the ``on_save`` that follows commits that checkpoint (blocking) and raises
    :class:`~taskpoint.Preempted`, which ends the process with status ``128 + signal`` (143 for SIGTERM).
    Only the main process (``args.process_index == 0``) saves.
    """

    def __init__(self, directory: str | os.PathLike[str], storage_options: dict[str, Any] | None = None,
                 keep: int | None = None, dedup: bool = True, blocking: bool = False) -> None:
        self.directory = directory
        self.storage_options = storage_options
        self.keep = keep
        self.dedup = dedup
        self.blocking = blocking
        #: The manager of the training in progress (created at the Trainer's init or at the start of training).
        self.manager: CheckpointManager | None = None

    def _open(self, args: TrainingArguments) -> CheckpointManager | None:
        if self.manager is None and args.process_index == 0:
            keep = self.keep if self.keep is not None else args.save_total_limit
            self.manager = CheckpointManager(self.directory, retention=Retention(keep=keep), dedup=self.dedup,
                                             storage_options=self.storage_options)
        return self.manager

    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        self._open(args)  # as early as possible: the manager installs the preemption handlers

    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        if self._open(args) is not None and (unlike := not_the_same_run(args)):
            _log.warning("taskpoint: a run resumed from these checkpoints will not be the interrupted run: %s; "
                         "see docs/resume-frameworks.md", "; ".join(unlike))

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                    **kwargs: Any) -> None:
        if self.manager is not None and self.manager.reached_preemption():
            control.should_save = True
            control.should_training_stop = True

    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        manager = self._open(args)
        if manager is None:
            return
        step = state.global_step
        folder = Path(args.output_dir or DEFAULT_OUTPUT_DIR) / f"{FOLDER_PREFIX}{step}"
        metadata = {"global_step": step, "epoch": state.epoch, "checkpoint": folder.name}
        notice = preemption.notice() if manager.reached_preemption() else None
        if notice is None:
            manager.save(folder, step, metadata=metadata, overwrite=True, blocking=self.blocking)
            return
        with preemption.emergency():  # repeated signals are only counted until the commit
            try:
                manager.wait_until_finished()
            except Exception as exc:  # the checkpoint of this step is newer: it is saved all the same
                _log.warning("taskpoint: the background save in flight when %s arrived failed (%s: %s); "
                             "saving step %d all the same", notice.name, type(exc).__name__, exc, step)
            uri = manager.save(folder, step, metadata=metadata, overwrite=True, blocking=True)
            committed = time.time()
            self.manager = None
            manager.close()
        preemption.ending("taskpoint: %s: committed step %d at %s, %.2f s after the notice; ending the process "
                          "with status %d", notice.name, step, uri, committed - notice.at, 128 + notice.signal)
        raise Preempted(notice.signal, step, uri, committed)

    def on_train_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                     **kwargs: Any) -> None:
        manager, self.manager = self.manager, None
        if manager is not None:
            manager.close()  # waits for the last background save and raises its error, if any
