"""``TrainState``: everything a plain PyTorch loop needs to resume as the same run, saved as one step.

A model's and an optimizer's state dicts are not enough for a resumed run to continue the interrupted one:
dropout masks come from torch's generator, the data order from the sampler's, augmentations from Python's and
NumPy's. ``TrainState`` saves those too, and the position of the data loader inside its epoch
(:mod:`._data`), so that the run killed at step k and resumed gives the same losses and parameters, bit for bit,
as the run never interrupted (tests/e2e/test_resume_exact.py).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

import torch
from torch.utils.data import DataLoader

from ..errors import RestoreReport
from ..generators import global_states, numpy_or_none, plain, set_global_states
from ._data import SamplerPosition
from ._match import Apply, Mismatches, module_plan, optimizer_plan
from ._state import SavedAsStateDict, restore_into

if TYPE_CHECKING:
    import numpy

    from ..manager import CheckpointManager

class TrainState(SavedAsStateDict):
    """A training loop's state: save it with ``manager.save(state, step)`` (background saves too), restore it
    in place with ``state.restore(manager)``.

    Args:
        model: a module, or a dict of named modules: their state dicts.
        optimizer: an optimizer, a dict of them, or None: their state dicts.
        scheduler: a learning-rate scheduler (or anything with ``state_dict()``/``load_state_dict()``).
        scaler: a ``torch.amp.GradScaler``.
        data: a ``DataLoader`` whose sampler is a ``RandomSampler``, ``DistributedSampler`` or
            ``SequentialSampler`` (``num_workers=0``): its epoch, seed and the index reached inside the epoch, so
            that the first batch after a restore is the one the interrupted run would have drawn next. Or any
            object with ``state_dict()``/``load_state_dict()`` (torchdata's ``StatefulDataLoader``).
        rng: True saves the random generators: Python's ``random``, NumPy's global one, torch's on the CPU and
            on every CUDA device; a list of ``numpy.random.Generator`` or ``torch.Generator`` adds those; False
            saves none.
        extra: a dict of your own values (numbers, strings, tensors), updated in place on restore.
    """

    def __init__(self, model: torch.nn.Module | Mapping[str, torch.nn.Module],
                 optimizer: torch.optim.Optimizer | Mapping[str, torch.optim.Optimizer] | None,
                 scheduler: Any = None, scaler: Any = None, data: Any = None,
                 rng: bool | Sequence[numpy.random.Generator | torch.Generator] = True,
                 extra: dict[str, Any] | None = None) -> None:
        self.models = _named(model, torch.nn.Module, "model")
        self.optimizers = _named(optimizer, torch.optim.Optimizer, "optimizer") if optimizer is not None else {}
        self.scheduler, self.scaler, self.extra = scheduler, scaler, extra
        for name, value in (("scheduler", scheduler), ("scaler", scaler)):
            if value is not None and not _stateful(value):
                raise TypeError(f"TrainState({name}=...) takes an object with state_dict() and load_state_dict(), "
                                f"not a {type(value).__name__}")
        if data is None or _stateful(data):
            self.data = data
        elif isinstance(data, DataLoader):
            self.data = SamplerPosition.of(data)
        else:
            raise TypeError(f"TrainState(data=...) takes a DataLoader or an object with state_dict() and "
                            f"load_state_dict() (torchdata's StatefulDataLoader), not a {type(data).__name__}")
        self.rng = rng is not False
        self.generators = list(rng) if not isinstance(rng, bool) else []

    def state_dict(self) -> dict[str, Any]:
        """The state as one dict, taken now: what ``manager.save(state, step)`` saves."""
        state: dict[str, Any] = {"model": {name: module.state_dict() for name, module in self.models.items()}}
        optional = {"optimizer": {name: opt.state_dict() for name, opt in self.optimizers.items()} or None,
                    "scheduler": self.scheduler, "scaler": self.scaler, "data": self.data}
        for key, value in optional.items():
            if value is not None:
                state[key] = value if isinstance(value, dict) else value.state_dict()
        if self.rng:
            state["rng"] = _rng_state(self.generators)
        if self.extra is not None:
            state["extra"] = dict(self.extra)
        return state

    @overload
    def restore(self, manager: CheckpointManager, step: int | None = None, *,
                strict: Literal[True] = True) -> int | None: ...

    @overload
    def restore(self, manager: CheckpointManager, step: int | None = None, *,
                strict: Literal[False]) -> RestoreReport | None: ...

    def restore(self, manager: CheckpointManager, step: int | None = None, *,
                strict: bool = True) -> int | RestoreReport | None:
        """Restore ``step`` (the newest when None) into the objects in place; the step, or None when there is
        none (a first attempt).

        Everything is checked before anything changes: a name missing, unexpected or of another shape or dtype
        (in a model, an optimizer's groups and state, the parts saved) raises
        :class:`~taskpoint.errors.RestoreMismatch` naming them, with every object untouched. ``strict=False``
        restores what matches (an optimizer only whole) and returns a :class:`~taskpoint.errors.RestoreReport`
        of the rest instead of the step.
        """
        return restore_into(manager, step, strict, self._plan)

    def _plan(self, saved: dict[str, Any], found: Mismatches) -> list[Apply | None]:
        actions: list[Apply | None] = []
        present = {"model": True, "optimizer": bool(self.optimizers), "scheduler": self.scheduler is not None,
                   "scaler": self.scaler is not None, "data": self.data is not None, "rng": self.rng,
                   "extra": self.extra is not None}
        found.missing += [part for part, here in present.items() if here and part not in saved]
        found.unexpected += [part for part in saved if not present.get(part, False)]
        models, optimizers = saved.get("model", {}), saved.get("optimizer", {})
        for part, objects, saved_part in (("model", self.models, models), ("optimizer", self.optimizers, optimizers)):
            if part not in saved:
                continue
            found.missing += [f"{part}.{name}" for name in objects if name not in saved_part]
            found.unexpected += [f"{part}.{name}" for name in saved_part if name not in objects]
            plan = module_plan if part == "model" else optimizer_plan
            actions += [plan(item, saved_part[name], _prefix(part, name, objects), found)
                        for name, item in objects.items() if name in saved_part]
        for part in ("scheduler", "scaler"):
            target = getattr(self, part)
            if target is not None and part in saved:
                actions.append(functools.partial(target.load_state_dict, saved[part]))
        if self.rng and "rng" in saved:
            actions.append(_rng_plan(saved["rng"], self.generators, found))
        if self.data is not None and "data" in saved:
            if isinstance(self.data, SamplerPosition):
                after = saved["rng"]["torch"] if self.rng and "rng" in saved else None
                actions.append(self.data.plan(saved["data"], "data.", found, after))
            else:
                actions.append(lambda: self.data.load_state_dict(saved["data"]))
        if self.extra is not None and "extra" in saved:
            actions.append(functools.partial(self.extra.update, found.entries(saved["extra"], self.extra, "extra.")))
        return actions


def _named(value: Any, kind: type, what: str) -> dict[str, Any]:
    """One object as ``{"": it}``, or a dict of named ones; TypeError for anything else."""
    if isinstance(value, kind):
        return {"": value}
    if isinstance(value, Mapping) and value and all(isinstance(v, kind) for v in value.values()):
        return {str(name): item for name, item in value.items()}
    raise TypeError(f"TrainState({what}=...) takes a {kind.__module__}.{kind.__qualname__} or a dict of them, "
                    f"not a {type(value).__name__}")


def _prefix(part: str, name: str, objects: Mapping[str, Any]) -> str:
    return f"{part}." if list(objects) == [""] else f"{part}.{name}."


def _stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


# -- random generators -------------------------------------------------------------------------------------


def _rng_state(generators: Sequence[Any]) -> dict[str, Any]:
    """The states of the global generators and of ``generators``, as values a state dict holds."""
    return {**global_states(), "generators": [_generator_state(g) for g in generators]}


def _generator_state(generator: Any) -> Any:
    if isinstance(generator, torch.Generator):
        return generator.get_state()
    bit_generator = getattr(generator, "bit_generator", None)
    if bit_generator is None:
        raise TypeError(f"TrainState(rng=[...]) takes numpy.random.Generator and torch.Generator objects, not a "
                        f"{type(generator).__name__}")
    return plain(bit_generator.state)


def _rng_plan(saved: Any, generators: Sequence[Any], found: Mismatches) -> Apply | None:
    count = len(saved.get("generators", ())) if isinstance(saved, dict) else 0
    if count != len(generators):
        found.mismatched.append(("rng.generators", f"{count} generators in the checkpoint vs {len(generators)}"))
        return None
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if len(saved["cuda"]) not in (0, devices):
        found.mismatched.append(("rng.cuda", f"{len(saved['cuda'])} CUDA devices in the checkpoint vs {devices}"))
        return None
    if "numpy" in saved and numpy_or_none() is None:
        found.unexpected.append("rng.numpy")

    def apply() -> None:
        set_global_states(saved)
        for generator, state in zip(generators, saved["generators"], strict=True):
            if isinstance(generator, torch.Generator):
                generator.set_state(state)
            else:
                generator.bit_generator.state = state

    return apply
