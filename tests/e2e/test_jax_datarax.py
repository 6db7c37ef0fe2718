"""The handler as Datarax code uses it: modules that are both nnx modules and Checkpointable, and
``handler.checkpointer``. Real jax, orbax-checkpoint and flax on the CPU."""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pytest

from helpers import LazyModule, requires

pytestmark = requires("jax", "orbax.checkpoint", "flax")

# Imported when a test first uses them: collecting this module imports no jax.
jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")
nnx = LazyModule("flax.nnx")
tpjax = LazyModule("taskpoint.jax")


@functools.cache
def pipeline_module() -> type:
    """An nnx module class shaped like a Datarax module (defined on first use: it subclasses ``nnx.Module``)."""

    class PipelineModule(nnx.Module):  # type: ignore[misc]
        """Its checkpoint is what ``get_state`` says (here the position in the data and the parameters under names
        of its own), not ``nnx.state``."""

        def __init__(self, seed: int) -> None:
            self.linear = nnx.Linear(2, 3, rngs=nnx.Rngs(seed))
            self.position = nnx.Variable(jnp.array(0))
            self.set_state_calls = 0

        def get_state(self) -> dict[str, Any]:
            return {"position": int(self.position[...]), "weights": {"w": self.linear.kernel[...]},
                    "source": "shard-0"}

        def set_state(self, state: dict[str, Any]) -> None:
            self.set_state_calls += 1
            self.position[...] = jnp.array(state["position"])
            self.linear.kernel[...] = state["weights"]["w"]
            self.source = state["source"]

    return PipelineModule


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_an_nnx_module_that_is_checkpointable_goes_through_get_state_and_set_state(store):
    trained = pipeline_module()(seed=0)
    trained.position[...] = jnp.array(41)
    fresh = pipeline_module()(seed=7)
    assert isinstance(trained, nnx.Module) and isinstance(trained, tpjax.Checkpointable)
    with tpjax.OrbaxCheckpointHandler(storage_options=store.storage_options) as h:
        h.save(store.base, trained, step=1)
        saved = h.restore(store.base, step=1)  # without a target: what was saved, which is get_state()
        assert sorted(saved) == ["position", "source", "weights"] and saved["source"] == "shard-0"
        assert h.restore(store.base, target=fresh, step=1) is fresh
    assert fresh.set_state_calls == 1
    assert int(fresh.position[...]) == 41 and fresh.source == "shard-0"
    np.testing.assert_array_equal(np.asarray(fresh.linear.kernel[...]), np.asarray(trained.linear.kernel[...]))


class _Recording:
    """Wraps the handler's checkpointer and records the calls the handler makes through it."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, []

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self.inner, name)
        if name in ("save", "restore", "wait_until_finished", "close"):
            def recorded(*args: Any, **kwargs: Any) -> Any:
                self.calls.append(name)
                return attribute(*args, **kwargs)
            return recorded
        return attribute


def test_the_handler_saves_restores_and_waits_through_its_checkpointer(tmp_path):
    h = tpjax.OrbaxCheckpointHandler(async_checkpointing=True)
    for name in ("save", "restore", "wait_until_finished", "close"):
        assert callable(getattr(h.checkpointer, name))
    h.checkpointer = recording = _Recording(h.checkpointer)
    h.save(tmp_path, {"w": jnp.ones(2)}, step=1)
    h.wait_until_finished()
    restored = h.restore(tmp_path, step=1)
    h.close()
    assert recording.calls == ["save", "wait_until_finished", "restore", "close"]
    np.testing.assert_array_equal(np.asarray(restored["w"]), np.ones(2))


@pytest.mark.parametrize("async_checkpointing", [False, True])
def test_checkpointer_calls_read_and_write_the_handlers_checkpoints(tmp_path, async_checkpointing):
    """Datarax code calls ``handler.checkpointer.save(path, state, force=...)``, ``.restore(path, item=...)``
    and ``.wait_until_finished()`` with the paths the handler uses (``dir/ckpt-N``, ``dir/checkpoint``)."""
    with tpjax.OrbaxCheckpointHandler(async_checkpointing=async_checkpointing) as h:
        checkpointer = h.checkpointer
        assert checkpointer.save(str(tmp_path / "ckpt-3"), {"w": jnp.arange(3)}) == f"{tmp_path}/ckpt-3"
        checkpointer.wait_until_finished()
        assert h.get_checkpoint_steps(tmp_path) == [3]
        np.testing.assert_array_equal(np.asarray(h.restore(tmp_path, step=3)["w"]), np.arange(3))

        h.save(tmp_path, {"w": jnp.full(2, 5.0)}, step=4)
        got = checkpointer.restore(str(tmp_path / "ckpt-4"), item={"w": jax.ShapeDtypeStruct((2,), jnp.float16)})
        assert got["w"].dtype == jnp.float16 and float(got["w"][0]) == 5.0

        h.save(tmp_path, {"unversioned": 1})
        assert checkpointer.restore(str(tmp_path / "checkpoint")) == {"unversioned": 1}
        with pytest.raises(FileExistsError):
            checkpointer.save(str(tmp_path / "ckpt-3"), {"w": jnp.zeros(3)})
        checkpointer.save(str(tmp_path / "ckpt-3"), {"w": jnp.zeros(3)}, force=True)
        checkpointer.wait_until_finished()
        np.testing.assert_array_equal(np.asarray(h.restore(tmp_path, step=3)["w"]), np.zeros(3))
        with pytest.raises(FileNotFoundError):
            checkpointer.restore(str(tmp_path / "ckpt-99"))
