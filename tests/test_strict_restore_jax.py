"""Strict restores of PyTrees: a model with a layer added, one removed, or one of another shape raises
RestoreMismatch naming every leaf that differs, and returns nothing; ``strict=False`` restores what matches and
reports the rest. Through ``load_pytree_sync(manager, target=...)`` and Datarax's ``OrbaxCheckpointHandler``
with an ``nnx`` module, on local disk (what is checked is the tree, not the store)."""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from helpers import LazyModule, requires
from taskpoint import CheckpointManager, RestoreMismatch, RestoreReport

pytestmark = requires("jax", "orbax.checkpoint", "flax")

# Imported when a test first uses them: collecting this module imports no jax.
jnp = LazyModule("jax.numpy")
nnx = LazyModule("flax.nnx")
tpjax = LazyModule("taskpoint.jax")

SAVED = (4, 8, 2)
CHANGES: dict[str, tuple[tuple[int, ...], dict[str, Any]]] = {
    "a layer added": ((4, 8, 2, 3), {"missing": ("layers/2/bias", "layers/2/kernel")}),
    "a layer removed": ((4, 8), {"unexpected": ("layers/1/bias", "layers/1/kernel")}),
    "a layer of another shape": ((4, 16, 2), {"mismatched": (
        ("layers/0/bias", "shape (8,) in the checkpoint vs (16,) in the target"),
        ("layers/0/kernel", "shape (4, 8) in the checkpoint vs (4, 16) in the target"),
        ("layers/1/kernel", "shape (8, 2) in the checkpoint vs (16, 2) in the target"))}),
}


def params(widths: tuple[int, ...], fill: float) -> dict[str, Any]:
    return {"layers": [{"kernel": jnp.full((a, b), fill), "bias": jnp.full((b,), fill)}
                       for a, b in itertools.pairwise(widths)], "step": 3}


@pytest.mark.parametrize("change", list(CHANGES))
def test_a_pytree_target_that_does_not_match_raises_naming_every_leaf_or_reports_them(tmp_path, change):
    widths, differences = CHANGES[change]
    with CheckpointManager(tmp_path / "steps", preemption=False) as mgr:
        mgr.save(tpjax.PyTree(params(SAVED, 1.0)), 5)
        target = params(widths, 0.0)
        with pytest.raises(RestoreMismatch) as info:
            tpjax.load_pytree_sync(mgr, target=target)
        tree, report = tpjax.load_pytree_sync(mgr, target=target, strict=False)
    expected = RestoreReport(5, **differences)
    assert info.value.report == expected and report == expected
    assert isinstance(info.value, ValueError)  # as a mismatched target always was
    for line in expected.problems():
        assert line in str(info.value)
    different = {*expected.missing, *(name for name, _ in expected.mismatched)}
    for number, layer in enumerate(tree["layers"]):
        for name, value in layer.items():
            fill = 0.0 if f"layers/{number}/{name}" in different else 1.0
            np.testing.assert_array_equal(np.asarray(value), np.full(value.shape, fill))
    assert tree["step"] == 3


def model(widths: tuple[int, ...], seed: int) -> Any:
    class Stack(nnx.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            rngs = nnx.Rngs(seed)
            self.layers = nnx.List([nnx.Linear(a, b, rngs=rngs) for a, b in itertools.pairwise(widths)])

    return Stack()


def leaves(module: Any) -> dict[str, np.ndarray]:
    flat = nnx.to_flat_state(nnx.state(module))
    return {"/".join(map(str, path)): np.asarray(variable.get_value()) for path, variable in flat}


@pytest.mark.parametrize("change", list(CHANGES))
def test_an_nnx_module_that_does_not_match_is_left_untouched_or_restored_where_it_matches(tmp_path, change):
    widths, differences = CHANGES[change]
    saved, target = model(SAVED, 1), model(widths, 2)
    before = leaves(target)
    with tpjax.OrbaxCheckpointHandler() as handler:
        handler.save(tmp_path, saved, step=5)
        with pytest.raises(RestoreMismatch) as info:
            handler.restore(tmp_path, target=target)
        assert all(np.array_equal(before[name], value) for name, value in leaves(target).items())
        restored, report = handler.restore(tmp_path, target=target, strict=False)
    assert restored is target and report == info.value.report == RestoreReport(5, **differences)
    different = {*report.missing, *(name for name, _ in report.mismatched)}
    saved_leaves = leaves(saved)
    for name, value in leaves(target).items():
        np.testing.assert_array_equal(value, before[name] if name in different else saved_leaves[name])
