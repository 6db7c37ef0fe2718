"""``trainer.fit(ckpt_path="last")`` on every store, with the plug-in's storage options.

Lightning 2.6 resolves ``"last"`` in ``_CheckpointConnector._parse_ckpt_path``: it lists each
``ModelCheckpoint``'s folder with an fsspec instance built without storage options, keeps the names with the
protocol dropped (``bucket/run/checkpoints/last.ckpt``), then checks them with ``get_filesystem``, which reads
such a name as a local path: on ``s3://`` nothing is ever found. No public hook decides this, so
:func:`install` wraps that one method: when the trainer's checkpoint plug-in is taskpoint's (directly or
inside ``AsyncCheckpointIO``), ``"last"`` is resolved here, in the same folders and by the same rule (the
``last*.ckpt`` modified most recently), listed with the plug-in's options and kept as full URIs. Any other
trainer, and any other ``ckpt_path``, goes to Lightning's own code unchanged.
"""

from __future__ import annotations

import functools
import os
import re
from typing import TYPE_CHECKING, Any, Protocol

import fsspec
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
from lightning.pytorch.trainer.connectors.checkpoint_connector import _CheckpointConnector
from lightning.pytorch.utilities import rank_zero_warn

if TYPE_CHECKING:
    import lightning.pytorch as pl

_MARK = "__taskpoint_last__"


class Lister(Protocol):
    """What ``"last"`` needs of the plug-in: its filesystem for a folder. The plug-in's class is handed to
    :func:`install` rather than imported here, so that ``_io`` (which installs) and this module form no cycle."""

    def filesystem(self, path: str | os.PathLike[str]) -> tuple[fsspec.AbstractFileSystem, str]: ...


def plugin_of(trainer: pl.Trainer, plugin_type: type[Lister]) -> Lister | None:
    """The trainer's plug-in of ``plugin_type``, also when wrapped (``AsyncCheckpointIO``); None when it has
    none."""
    io: Any = trainer.strategy.checkpoint_io
    while isinstance(io, _WrappingCheckpointIO):
        io = io.checkpoint_io
    return io if isinstance(io, plugin_type) else None


def checkpoint_folder(callback: ModelCheckpoint, trainer: pl.Trainer) -> str:
    """The folder ``callback`` writes to: its ``dirpath``, else the one Lightning derives from the logger or
    ``default_root_dir`` (the same private method Lightning's own ``"last"`` lookup calls)."""
    if callback.dirpath is not None:
        return str(callback.dirpath)
    return str(callback._ModelCheckpoint__resolve_ckpt_dir(trainer))  # type: ignore[attr-defined]


def find_last(trainer: pl.Trainer, plugin: Lister) -> str | None:
    """The ``last*.ckpt`` modified most recently in the folders of the trainer's ``ModelCheckpoint`` callbacks,
    as a full URI (a local path on local disk), or None."""
    mtimes: dict[str, float] = {}
    for callback in trainer.checkpoint_callbacks:
        if not isinstance(callback, ModelCheckpoint):
            continue
        folder = checkpoint_folder(callback, trainer)
        fs, inner = plugin.filesystem(folder)
        last, extension = re.escape(callback.CHECKPOINT_NAME_LAST), re.escape(callback.FILE_EXTENSION)
        pattern = re.compile(rf"^{last}(-(\d+))?{extension}$")
        fs.invalidate_cache(inner)  # fsspec instances are shared and cache listings: this one must be fresh
        try:
            entries = fs.ls(inner, detail=True)
        except FileNotFoundError:
            continue
        for entry in entries:
            name = entry["name"].rstrip("/")
            if entry.get("type") != "file" or not pattern.match(name.rsplit("/", 1)[-1]):
                continue
            uri = os.path.join(folder, name.rsplit("/", 1)[-1]) if "://" not in folder \
                else folder.rstrip("/") + "/" + name.rsplit("/", 1)[-1]
            mtimes[uri] = fs.modified(name).timestamp()
    return max(mtimes, key=mtimes.__getitem__) if mtimes else None


def _hint(trainer: pl.Trainer) -> str:
    """What to change when ``"last"`` found nothing: ``save_last=True`` when no ``ModelCheckpoint`` sets it;
    when one does, nothing to change (a first run has no last checkpoint yet), only where it was looked for."""
    callbacks = [c for c in trainer.checkpoint_callbacks if isinstance(c, ModelCheckpoint)]
    if not any(callback.save_last for callback in callbacks):
        return " HINT: Set `ModelCheckpoint(..., save_last=True)`."
    folders = ", ".join(sorted({checkpoint_folder(callback, trainer) for callback in callbacks}))
    return f" (looked for last*.ckpt in {folders}: none saved there yet)"


def install(plugin_type: type[Lister]) -> None:
    """Wrap ``_CheckpointConnector._parse_ckpt_path`` once per process (see the module's docstring), for the
    trainers whose checkpoint plug-in is a ``plugin_type``."""
    original = _CheckpointConnector._parse_ckpt_path
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def parse_ckpt_path(self: _CheckpointConnector, state_fn: Any, ckpt_path: Any, model_provided: bool,
                        model_connected: bool) -> Any:
        plugin = plugin_of(self.trainer, plugin_type) if ckpt_path == "last" else None
        if plugin is None:
            return original(self, state_fn, ckpt_path, model_provided=model_provided,
                            model_connected=model_connected)
        found = find_last(self.trainer, plugin)
        if found is None:
            rank_zero_warn(f'.{state_fn.value}(ckpt_path="last") is set, but there is no last checkpoint '
                           f"available. No checkpoint will be loaded.{_hint(self.trainer)}")
        return found

    setattr(parse_ckpt_path, _MARK, True)
    _CheckpointConnector._parse_ckpt_path = parse_ckpt_path  # type: ignore[method-assign]
