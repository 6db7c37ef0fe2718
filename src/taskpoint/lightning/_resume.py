"""``ResumeExactly``: what Lightning leaves out of a ``.ckpt`` for a mid-epoch resume to be the same run.

Lightning 2.6 saves the weights, the optimizers, the schedulers and its loops' counters, but not the random
generators, and it does not skip the batches an interrupted epoch had trained: it warns "your dataloader is not
resumable" and draws the epoch again from its first batch. This callback keeps both in every checkpoint
(its ``state_dict``, which Lightning stores under ``callbacks``) and puts them back on ``ckpt_path=...``:

- the generators (Python ``random``, NumPy's global, torch CPU and every CUDA device) as they were when the
  checkpoint was taken, restored just before the first training batch after the resume;
- the generators as they were when the epoch's data iterator was created (a ``RandomSampler`` with no
  generator of its own draws its order from torch's global generator then, and the ``DataLoader`` its workers'
  base seed), restored before the resumed fit creates its iterator: the same order, the same worker seeds;
- how many batches of the epoch had been drawn: the sampler's first that many batches are skipped (indices
  only, no data is loaded for them).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator, Sized
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from torch.utils.data import BatchSampler, DataLoader, Sampler

from ..generators import global_states, set_global_states

_logger = logging.getLogger("taskpoint")


class _SkipOnce(Sampler[int]):
    """Stands in for a ``BatchSampler``'s sampler for one epoch: puts the sampler back and yields its indices from
    the ``skip``-th on. The ``BatchSampler`` starts iterating at the epoch's first batch, so the sampler draws its
    order then, from the generators the callback has set."""

    def __init__(self, batches: BatchSampler, skip: int) -> None:
        self.batches, self.sampler, self.skip = batches, batches.sampler, skip

    def __len__(self) -> int:
        return len(self.sampler) if isinstance(self.sampler, Sized) else 0

    def __iter__(self) -> Iterator[int]:
        self.batches.sampler = self.sampler
        return itertools.islice(iter(self.sampler), self.skip, None)


class ResumeExactly(Callback):
    """Keep the random generators and the place in the epoch in every checkpoint, and resume from them: a fit
    resumed mid-epoch draws the batch, and the dropout masks, that the interrupted fit would have drawn.

    Add it to the ``Trainer``'s callbacks beside ``ModelCheckpoint`` (and :class:`SaveOnPreemption`); it works
    with any checkpoint plug-in. The data position is kept for a map-style ``DataLoader`` with ``num_workers=0``
    that batches with a ``batch_size`` (the usual ``DataLoader(dataset, batch_size=..., shuffle=True)``, whose
    ``RandomSampler`` the tests resume); a loader with ``state_dict``/``load_state_dict`` (torchdata's
    ``StatefulDataLoader``) is left to Lightning, which saves its position itself. With another loader the
    resume logs a WARNING that its position is not kept. docs/resume-frameworks.md says what else it needs.
    """

    def __init__(self) -> None:
        self._trainer: pl.Trainer | None = None
        self._epoch_start: dict[str, Any] | None = None
        self._pending: dict[str, Any] | None = None
        #: Whether the epoch in progress created its data iterator before its on_train_epoch_start (the fit's first
        #: epoch does, in Lightning's setup_data; later ones after the hook).
        self._iterator_before_epoch_hook = False

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps: the generators now and at the epoch's start, and the batches drawn."""
        return {"generators": global_states(), "epoch_start": self._epoch_start,
                "batches": self._batches_drawn, "epoch_done": self._epoch_done}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._pending = dict(state_dict)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer

    @property
    def _batches_drawn(self) -> int:
        """The batches the epoch in progress has drawn (Lightning's own count, which it saves too)."""
        return int(self._trainer.fit_loop.epoch_loop.batch_progress.current.ready) if self._trainer else 0

    @property
    def _epoch_done(self) -> bool:
        return self._trainer is not None and self._batches_drawn >= self._trainer.num_training_batches

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # The fit creates its first data iterator after this hook (the sanity check between runs under Lightning's
        # isolate_rng): set the generators it draws from, the epoch's start when resuming mid-epoch, or the
        # checkpoint's own when it was taken at the end of an epoch (the next epoch draws from those).
        pending = self._pending
        if pending is not None and (pending["epoch_done"] or pending["epoch_start"] is None):
            set_global_states(pending["generators"])
            self._pending = None
        elif pending is not None:
            set_global_states(pending["epoch_start"])
        self._epoch_start = global_states()
        self._iterator_before_epoch_hook = True

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Later epochs create their iterator after this hook; the fit's first created it before (see above).
        if not self._iterator_before_epoch_hook:
            self._epoch_start = global_states()
        self._iterator_before_epoch_hook = False

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._iterator_before_epoch_hook = False

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self._pending is None:
            return
        # A mid-epoch resume calls no on_train_epoch_start for the epoch it resumes; the next one's comes first.
        self._iterator_before_epoch_hook = False
        if self._pending["batches"] == 0:
            return
        loader = trainer.train_dataloader
        if isinstance(loader, DataLoader) and loader.num_workers == 0 and isinstance(loader.batch_sampler,
                                                                                   BatchSampler):
            batches = loader.batch_sampler
            batches.sampler = _SkipOnce(batches, self._pending["batches"] * batches.batch_size)
            _logger.info("taskpoint: resuming mid-epoch: skipping the %d batches the interrupted epoch had drawn",
                         self._pending["batches"])
        elif not (hasattr(loader, "state_dict") and hasattr(loader, "load_state_dict")):
            _logger.warning("taskpoint: resuming mid-epoch with a train loader whose position is not kept (%s): "
                            "the epoch restarts from its first batch; see docs/resume-frameworks.md",
                            type(loader).__name__)

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        # The batch is drawn: from here on, the generators are those of the moment the checkpoint was taken.
        if self._pending is not None:
            set_global_states(self._pending["generators"])
            self._pending = None
