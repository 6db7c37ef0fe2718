"""Bring the newest step that verifies back as ``output_dir/checkpoint-N``, the folder the Trainer resumes from."""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path
from typing import Any

from taskpoint import CheckpointCorruptError, CheckpointManager

from ._callback import FOLDER_PREFIX

_log = logging.getLogger("taskpoint")


def resume(directory: str | os.PathLike[str], output_dir: str | os.PathLike[str],
           storage_options: dict[str, Any] | None = None) -> str | None:
    """Restore the newest step of ``directory`` that verifies into ``output_dir/checkpoint-N`` and return that
    path, for ``trainer.train(resume_from_checkpoint=...)``; None when ``directory`` holds no step.

    A damaged step is skipped with a warning on the ``taskpoint`` logger and the next older one is tried; a
    storage failure is raised (it is never a reason to go back to an older step). A ``checkpoint-N`` folder
    already in ``output_dir`` is replaced, only once the restored one has verified.
    """
    out = Path(output_dir)
    with CheckpointManager(directory, storage_options=storage_options, preemption=False) as manager:
        for step in reversed(manager.steps()):
            target = out / f"{FOLDER_PREFIX}{step}"
            staging = out / f".taskpoint-restore-{step}-{os.getpid()}"
            shutil.rmtree(staging, ignore_errors=True)
            try:
                manager.restore(step, into=staging)
            except CheckpointCorruptError as exc:
                shutil.rmtree(staging, ignore_errors=True)
                _log.warning("taskpoint: step %d of %s does not verify (%s); trying the one before", step,
                             directory, exc)
                continue
            shutil.rmtree(target, ignore_errors=True)
            staging.rename(target)
            return str(target)
    return None
