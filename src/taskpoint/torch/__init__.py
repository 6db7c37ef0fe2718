"""taskpoint's PyTorch extra: a storage layer for ``torch.distributed.checkpoint`` (DCP) on any fsspec URL.

Install it with ``pip install "taskpoint[torch]"``::

    import torch.distributed.checkpoint as dcp
    import taskpoint.torch

    dcp.save(state, storage_writer=taskpoint.torch.Writer("s3://bucket/run/step-100"))
    dcp.load(state, storage_reader=taskpoint.torch.Reader("s3://bucket/run/step-100"))

Every file goes up atomically and in parallel, hashed (sha256) as it is written; DCP's ``.metadata`` is
written last, after taskpoint's manifest of every file, and is the commit. A load verifies every byte it
reads. DCP does the planning and the resharding. A plain state dict goes into a
:class:`~taskpoint.CheckpointManager` step with ``manager.save(StateDict(model.state_dict()), step)`` and comes
back, verified, with ``load_state_dict_sync(manager)`` (or into a model, checked name by name, with
``into=model``). A training loop's whole state, generators and data position included, is a
:class:`TrainState`: ``manager.save(state, step)`` and ``state.restore(manager)``. See docs/torch.md and
docs/resume.md.
"""

from typing import TYPE_CHECKING, Any

try:
    import torch.distributed
except ImportError as exc:
    raise ImportError(f'taskpoint.torch needs PyTorch with torch.distributed ({exc}); install it with '
                      f'pip install "taskpoint[torch]"') from exc
if not torch.distributed.is_available():
    raise ImportError('taskpoint.torch needs PyTorch with torch.distributed (this build has none); install it '
                      'with pip install "taskpoint[torch]"')

from . import _state_kind  # noqa: F401  (registers the torch.state_dict step kind of CheckpointManager)
from ._kind import FileSetStep
from ._state import StateDict, load_state_dict, load_state_dict_sync
from ._state_file import STATE_FILE
from ._train import TrainState

if TYPE_CHECKING:
    from ._reader import Reader
    from ._writer import Writer


def __getattr__(name: str) -> Any:
    """``Writer`` and ``Reader``, imported on first use: they subclass DCP's storage classes, and importing
    ``torch.distributed.checkpoint`` (DTensor, sympy) costs 0.6 CPU-s on top of torch's 1.4, which every rank
    and every restart that saves state dicts alone would pay for nothing."""
    if name == "Writer":
        from ._writer import Writer
        return Writer
    if name == "Reader":
        from ._reader import Reader
        return Reader
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

__all__ = ["STATE_FILE", "FileSetStep", "Reader", "StateDict", "TrainState", "Writer", "load_state_dict", "load_state_dict_sync"]  # noqa: E501  (one line: tests/e2e/test_docs.py reads it)
