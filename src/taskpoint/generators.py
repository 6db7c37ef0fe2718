"""The global random generators' states, taken and put back, in one format for every extra that resumes a run.

A resumed run draws the same dropout masks, shuffles and augmentations as the interrupted one only if Python's
``random``, NumPy's global generator, torch's CPU generator and every CUDA device's are put back as they were.
:class:`taskpoint.torch.TrainState` and :class:`taskpoint.lightning.ResumeExactly` keep them in this format: plain
values and tensors only, so that ``torch.load(weights_only=True)`` reads them back. torch is imported when a
function is called (both callers have it), NumPy only where installed.
"""

from __future__ import annotations

import random
from typing import Any


def global_states() -> dict[str, Any]:
    """The states of Python's, torch's CPU and every CUDA device's generator, and NumPy's global one when NumPy
    is installed (its arrays as lists of ints)."""
    import torch

    states: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state(),
                              "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}
    numpy = numpy_or_none()
    if numpy is not None:
        states["numpy"] = plain(numpy.random.get_state(legacy=False))
    return states


def set_global_states(states: dict[str, Any]) -> None:
    """Put back what :func:`global_states` took. The CUDA states only where CUDA is present (a step saved on a
    GPU machine resumes the CPU generators elsewhere), NumPy's only where NumPy is installed."""
    import torch

    python = states["python"]
    random.setstate((python[0], tuple(python[1]), python[2]))  # a tuple read back from a checkpoint may be a list
    torch.set_rng_state(states["torch"])
    if states.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    numpy = numpy_or_none()
    if numpy is not None and "numpy" in states:
        numpy.random.set_state(states["numpy"])


def plain(value: Any) -> Any:
    """A NumPy generator's state with its arrays as lists of ints (NumPy takes them back as they are)."""
    if isinstance(value, dict):
        return {key: plain(item) for key, item in value.items()}
    tolist = getattr(value, "tolist", None)
    return tolist() if callable(tolist) and not isinstance(value, (int, float, str)) else value


def numpy_or_none() -> Any:
    """NumPy when it is installed (torch does not need it), else None."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy
