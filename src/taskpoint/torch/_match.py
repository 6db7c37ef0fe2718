"""Matching a saved state dict against the objects it is restored into, before anything is restored.

A restore into a target first finds every name that is missing, unexpected, or of another shape or dtype
(:class:`Mismatches`), and only then changes anything: strict, it raises :class:`~taskpoint.errors.RestoreMismatch`
and the target is untouched; with ``strict=False`` it restores what matches and reports the rest. Torch's own
``load_state_dict(strict=True)`` raises only after copying the tensors that did match, and casts a float64
tensor into a float32 parameter without a word.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ..errors import RestoreReport

#: What restores one part of a target once every part was checked.
Apply = Callable[[], object]


class Mismatches:
    """The names that did not match, collected over every part of a target."""

    def __init__(self) -> None:
        self.missing: list[str] = []
        self.unexpected: list[str] = []
        self.mismatched: list[tuple[str, str]] = []

    def report(self, step: int | None) -> RestoreReport:
        return RestoreReport(step, tuple(self.missing), tuple(self.unexpected), tuple(self.mismatched))

    def entries(self, saved: Mapping[str, Any], target: Mapping[str, Any], prefix: str) -> dict[str, Any]:
        """Compare two flat state dicts by name, tensors also by shape and dtype; the saved entries that fit."""
        self.missing += [f"{prefix}{name}" for name in target if name not in saved]
        fitting: dict[str, Any] = {}
        for name, value in saved.items():
            if name not in target:
                self.unexpected.append(f"{prefix}{name}")
                continue
            problem = _differs(value, target[name])
            if problem:
                self.mismatched.append((f"{prefix}{name}", problem))
            else:
                fitting[name] = value
        return fitting


def _differs(saved: Any, target: Any) -> str | None:
    if not (isinstance(saved, torch.Tensor) and isinstance(target, torch.Tensor)):
        return None
    if saved.shape != target.shape:
        return f"shape {tuple(saved.shape)} in the checkpoint vs {tuple(target.shape)} in the target"
    if saved.dtype != target.dtype:
        return f"dtype {saved.dtype} in the checkpoint vs {target.dtype} in the target"
    return None


def module_plan(module: torch.nn.Module, saved: Any, prefix: str, found: Mismatches) -> Apply | None:
    """Check ``saved`` against ``module.state_dict()``; what loads it (only what fits when something did not)."""
    if not isinstance(saved, Mapping):
        found.mismatched.append((prefix.rstrip("."), f"the checkpoint holds a {type(saved).__name__}, not a "
                                                     "state dict"))
        return None
    before = len(found.missing) + len(found.unexpected) + len(found.mismatched)
    fitting = found.entries(saved, module.state_dict(), prefix)
    if before == len(found.missing) + len(found.unexpected) + len(found.mismatched):
        return lambda: module.load_state_dict(saved, strict=True)
    return lambda: module.load_state_dict(fitting, strict=False)


def optimizer_plan(optimizer: torch.optim.Optimizer, saved: Any, prefix: str, found: Mismatches) -> Apply | None:
    """Check ``saved`` against the optimizer's parameter groups (what torch's ``load_state_dict`` would refuse
    after a partial load elsewhere) and its per-parameter tensors against the parameters' shapes; what loads it,
    or None when it does not fit (an optimizer's state is restored whole or not at all)."""
    groups = saved.get("param_groups") if isinstance(saved, Mapping) else None
    current = optimizer.param_groups
    if not isinstance(groups, list) or len(groups) != len(current):
        count = len(groups) if isinstance(groups, list) else "no"
        found.mismatched.append((f"{prefix}param_groups", f"{count} parameter groups in the checkpoint vs "
                                                          f"{len(current)} in the target"))
        return None
    fits = True
    for number, (group, now) in enumerate(zip(groups, current, strict=True)):
        if len(group["params"]) != len(now["params"]):
            found.mismatched.append((f"{prefix}param_groups.{number}", f"{len(group['params'])} parameters in the "
                                                                       f"checkpoint vs {len(now['params'])}"))
            fits = False
    if not fits:
        return None
    states = saved.get("state", {})
    for group, now in zip(groups, current, strict=True):
        for key, param in zip(group["params"], now["params"], strict=True):
            for name, value in states.get(key, {}).items():
                if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape != param.shape:
                    found.mismatched.append((f"{prefix}state.{key}.{name}", f"shape {tuple(value.shape)} in the "
                                             f"checkpoint vs {tuple(param.shape)} for its parameter"))
                    fits = False
    return (lambda: optimizer.load_state_dict(saved)) if fits else None
