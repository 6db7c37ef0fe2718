"""The ``CheckpointIO`` plug-in: each ``.ckpt`` is a :class:`taskpoint.Checkpoint` object with its record."""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fsspec
import torch
from fsspec.callbacks import Callback
from lightning.pytorch.plugins.io import CheckpointIO as _LightningCheckpointIO

import taskpoint

from . import _last

_logger = logging.getLogger("taskpoint")

#: The suffix of the record taskpoint writes beside each object (docs/checkpoint.md, "The record and integrity").
RECORD_SUFFIX = ".taskpoint.json"
#: taskpoint's own storage option, which fsspec does not take (it picks taskpoint's S3 client).
_TASKPOINT_OPTIONS = frozenset({"s3_client"})


class CheckpointIO(_LightningCheckpointIO):
    """Lightning's checkpoint plug-in, saving every ``.ckpt`` through taskpoint.

    ``Trainer(plugins=[CheckpointIO(...)])``: what ``ModelCheckpoint`` (top-k, ``save_last``,
    ``every_n_train_steps``) and ``trainer.save_checkpoint`` write becomes one atomic object with its record
    (``<ckpt>.taskpoint.json``, which Lightning's ``*.ckpt`` filters never take for a checkpoint), retried on
    transient storage errors. A load verifies every byte against the record before ``torch.load``: a damaged
    file raises :class:`~taskpoint.CheckpointCorruptError`. ``trainer.fit(ckpt_path="last")`` finds the newest
    ``last*.ckpt`` with this plug-in's ``storage_options``, on every store.

    Args:
        storage_options: fsspec options for every ``.ckpt`` (credentials, ``endpoint_url``, ...), as for
            :class:`taskpoint.Checkpoint`.
        retry: how storage failures are retried; see :class:`~taskpoint.RetryPolicy`.
        progress: as for :meth:`taskpoint.Checkpoint.save_sync`: True a bar, False none, an fsspec ``Callback``,
            or None (a bar on a terminal for transfers longer than about two seconds).
    """

    def __init__(
        self,
        storage_options: dict[str, Any] | None = None,
        retry: taskpoint.RetryPolicy | None = None,
        progress: bool | Callback | None = None,
    ) -> None:
        super().__init__()
        self.storage_options = dict(storage_options or {})
        self.retry = retry
        self.progress = progress
        _last.install(CheckpointIO)

    def _checkpoint(self, path: str | os.PathLike[str]) -> taskpoint.Checkpoint:
        return taskpoint.Checkpoint(os.fspath(path), os.fspath(path), storage_options=self.storage_options,
                                    retry=self.retry)

    def filesystem(self, path: str | os.PathLike[str]) -> tuple[fsspec.AbstractFileSystem, str]:
        """fsspec's filesystem for ``path`` with this plug-in's storage options, and the path inside it."""
        options = {k: v for k, v in self.storage_options.items() if k not in _TASKPOINT_OPTIONS}
        fs, inner = fsspec.core.url_to_fs(os.fspath(path), **options)
        return fs, inner

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        """``torch.save`` into a local temp file, then save that file as the object at ``path``: atomic,
        recorded, retried. ``storage_options`` here are refused, as Lightning's own plug-in does: give them
        to the constructor."""
        if storage_options is not None:
            raise TypeError("taskpoint.lightning.CheckpointIO takes its storage options in its constructor, "
                            "not in Trainer.save_checkpoint(..., storage_options=...)")
        with tempfile.TemporaryDirectory(prefix="taskpoint-lightning-") as folder:
            staged = Path(folder) / "checkpoint.ckpt"
            torch.save(checkpoint, staged)
            with self._checkpoint(path) as cp:
                cp.save_sync(staged, progress=self.progress)

    def load_checkpoint(self, path: str | os.PathLike[str],
                        map_location: Callable[..., Any] | Any | None = lambda storage, loc: storage,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """Download ``path``, verify every byte against its record, then ``torch.load`` it. Raises
        ``FileNotFoundError`` when nothing is there, :class:`~taskpoint.CheckpointCorruptError` when the bytes
        are not what was saved. A ``.ckpt`` with no record (written by Lightning itself) loads with a WARNING."""
        with self._checkpoint(path) as cp:
            local = cp.load_sync(progress=self.progress)
            if local is None:
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            loaded: dict[str, Any] = torch.load(local, map_location=map_location, weights_only=weights_only)
            return loaded

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        """Remove the object at ``path``, then its record (a record left alone names no ``.ckpt``)."""
        fs, inner = self.filesystem(path)
        for target in (inner, inner + RECORD_SUFFIX):
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(target)
        _logger.debug("removed checkpoint %s and its record", path)

    def teardown(self) -> None:
        """Nothing to release: each save and load opens and closes its own :class:`taskpoint.Checkpoint`."""
