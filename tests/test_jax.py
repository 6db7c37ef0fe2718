"""taskpoint.jax with real jax, orbax-checkpoint and flax on the CPU: PyTree payloads and the handler."""

from __future__ import annotations

import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from collections import namedtuple
from pathlib import Path
from typing import Any

import anyio
import numpy as np
import pytest

from helpers import LazyModule, requires
from taskpoint import Checkpoint, CheckpointCorruptError, CheckpointError, CheckpointManager

# Two virtual CPU devices, so that restoring onto a target's sharding is visible. It only takes effect
# when jax is first imported here; the sharding test skips otherwise.
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=2")

pytestmark = requires("jax", "orbax.checkpoint")

# Imported when a test first uses them: collecting this module imports no jax.
jax = LazyModule("jax")
jnp = LazyModule("jax.numpy")
tpjax = LazyModule("taskpoint.jax")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
Point = namedtuple("Point", "x y")


def every_leaf() -> dict[str, Any]:
    """A tree with every leaf type a PyTree may hold, and every container."""
    return {
        "params": {"dense": {"kernel": jnp.arange(12, dtype=jnp.float32).reshape(3, 4),
                             "bias": jnp.full(4, 0.5, jnp.bfloat16)}},
        "numpy": np.arange(6, dtype=np.int64).reshape(2, 3),
        "empty": {"numpy": np.zeros((0, 3), np.float32), "jax": jnp.zeros((2, 0), jnp.int32)},
        "python": {"int": 7, "big": 2**70, "float": 0.1, "inf": -math.inf, "bool": True, "complex": 1 - 2j},
        "numpy_scalars": {"f32": np.float32(1.5), "i8": np.int8(-3), "bool": np.bool_(True), "f64": np.float64(1e-300)},
        "text": "héllo wörld ✓", "empty_text": "",
        "key": jax.random.key(42), "rbg_key": jax.random.key(1, impl="rbg"),
        "keys": jax.random.split(jax.random.key(0), 3), "no_keys": jax.random.split(jax.random.key(0), 0),
        "raw_key": jax.random.PRNGKey(3),
        "seq": [1, (2.5, "x", None), []], "nothing": None, "by_index": {0: "zero", 1: jnp.ones(2)},
        "point": Point(x=jnp.ones(2), y=3),
    }


def as_saved_without_target(tree: dict[str, Any]) -> dict[str, Any]:
    """What a restore without target returns: registered nodes (the namedtuple) come back as dicts."""
    return {**tree, "point": dict(tree["point"]._asdict())}


def assert_same(actual: Any, expected: Any, path: str = "") -> None:
    """Equal values of the same types: dtypes, shapes, PRNG key implementations, Python scalar types."""
    where = path or "<root>"
    if isinstance(expected, jax.Array) and jax.dtypes.issubdtype(expected.dtype, jax.dtypes.prng_key):
        assert isinstance(actual, jax.Array) and actual.dtype == expected.dtype, where
        assert jax.random.key_impl(actual) == jax.random.key_impl(expected), where
        np.testing.assert_array_equal(jax.random.key_data(actual), jax.random.key_data(expected), err_msg=where)
    elif isinstance(expected, (jax.Array, np.ndarray)):
        assert type(actual) is type(expected) or (isinstance(actual, jax.Array) and isinstance(expected, jax.Array)), \
            f"{where}: {type(actual)} vs {type(expected)}"
        assert (actual.dtype, actual.shape) == (expected.dtype, expected.shape), where
        np.testing.assert_array_equal(np.asarray(actual), np.asarray(expected), err_msg=where)
    elif isinstance(expected, dict):
        assert type(actual) is type(expected) and sorted(map(str, actual)) == sorted(map(str, expected)), where
        for key in expected:
            assert_same(actual[key], expected[key], f"{path}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same(a, e, f"{path}/{i}")
    else:
        assert type(actual) is type(expected) and actual == expected, f"{where}: {actual!r} vs {expected!r}"


# -- the payload kind ------------------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_every_leaf_type_round_trips_through_a_checkpoint(store):
    opts = store.storage_options
    Checkpoint(store.url("a"), storage_options=opts).save_sync(tpjax.PyTree(every_leaf()))
    with Checkpoint(store.url("b"), store.url("a"), storage_options=opts) as cp:
        assert_same(tpjax.load_pytree_sync(cp), as_saved_without_target(every_leaf()))
        assert_same(tpjax.load_pytree_sync(cp, target=every_leaf()), every_leaf())


def test_strings_and_scalars_are_kept_whole_in_the_sidecar_and_arrays_in_orbax(tmp_path):
    Checkpoint(tmp_path / "a").save_sync(tpjax.PyTree({"name": "abc", "n": 3, "w": jnp.ones(2)}))
    with Checkpoint(tmp_path / "b", tmp_path / "a") as cp:
        folder = cp.load_sync()
        assert sorted(os.listdir(folder)) == ["orbax", "taskpoint-pytree.json"]
        sidecar = (folder / "taskpoint-pytree.json").read_text()
        assert '"abc"' in sidecar and '"kind": "str"' in sidecar and '"kind": "jax.Array"' in sidecar


def test_typed_keys_keep_their_implementation_and_raw_keys_stay_uint32(tmp_path):
    tree = {"fry": jax.random.key(0), "rbg": jax.random.key(0, impl="unsafe_rbg"), "raw": jax.random.PRNGKey(0)}
    Checkpoint(tmp_path / "a").save_sync(tpjax.PyTree(tree))
    with Checkpoint(tmp_path / "b", tmp_path / "a") as cp:
        out = tpjax.load_pytree_sync(cp)
    assert str(jax.random.key_impl(out["fry"])) == "threefry2x32"
    assert str(jax.random.key_impl(out["rbg"])) == "unsafe_rbg"
    assert out["raw"].dtype == jnp.uint32 and out["raw"].shape == (2,)
    np.testing.assert_array_equal(jax.random.key_data(jax.random.split(out["rbg"])),
                                  jax.random.key_data(jax.random.split(tree["rbg"])))


def test_manager_saves_a_pytree_step_and_load_pytree_reads_its_restored_folder(tmp_path):
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(tpjax.PyTree(every_leaf()), 3, metadata={"epoch": 1})
        assert m.metadata(3) == {"epoch": 1}
        assert_same(tpjax.load_pytree_sync(m.restore(3), target=every_leaf()), every_leaf())


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_load_pytree_async_on_asyncio_and_trio(tmp_path, backend):
    tree = {"w": jnp.arange(3.0), "name": "x"}

    async def main() -> Any:
        await Checkpoint(tmp_path / "a").save(tpjax.PyTree(tree))
        with Checkpoint(tmp_path / "b", tmp_path / "a") as cp:
            return await tpjax.load_pytree(cp, target=tree)

    assert_same(anyio.run(main, backend=backend), tree)


def test_load_pytree_without_a_previous_checkpoint_returns_none(tmp_path):
    with Checkpoint(tmp_path / "a") as cp:
        assert tpjax.load_pytree_sync(cp) is None


def test_load_pytree_of_a_checkpoint_that_holds_no_pytree_says_so(tmp_path):
    Checkpoint(tmp_path / "a").save_sync(b"not a tree")
    with Checkpoint(tmp_path / "b", tmp_path / "a") as cp, pytest.raises(CheckpointError, match="holds no taskpoint"):
        tpjax.load_pytree_sync(cp)


@pytest.mark.e2e("starts a save process")
def test_the_caller_may_change_its_arrays_once_save_returns(tmp_path):
    weights = np.zeros(1000)
    with CheckpointManager(tmp_path / "steps", async_save=True) as m:
        m.save(tpjax.PyTree({"w": weights}), 1)
        weights[:] = 7.0
    with CheckpointManager(tmp_path / "steps") as m:
        assert not tpjax.load_pytree_sync(m.restore(1))["w"].any()


def test_target_sets_dtypes_array_types_and_abstract_shapes(tmp_path):
    saved = {"kernel": jnp.ones((2, 3), jnp.float32), "table": np.arange(4, dtype=np.int32), "scale": 2,
             "key": jax.random.key(1)}
    Checkpoint(tmp_path / "a").save_sync(tpjax.PyTree(saved))
    target = {"kernel": jax.ShapeDtypeStruct((2, 3), jnp.bfloat16), "table": jnp.zeros(4, jnp.int32),
              "scale": 0.0, "key": jax.ShapeDtypeStruct((), jax.random.key(0).dtype)}
    with Checkpoint(tmp_path / "b", tmp_path / "a") as cp:
        out = tpjax.load_pytree_sync(cp, target=target)
    assert out["kernel"].dtype == jnp.bfloat16 and isinstance(out["kernel"], jax.Array)
    assert isinstance(out["table"], jax.Array) and out["table"].tolist() == [0, 1, 2, 3]
    assert out["scale"] == 2.0 and type(out["scale"]) is float
    assert_same(out["key"], saved["key"])


def test_target_places_arrays_and_keys_on_its_shardings(tmp_path):
    if len(jax.devices()) < 2:
        pytest.skip("needs two devices (jax was imported before XLA_FLAGS was set)")
    mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("data",))
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    second = jax.sharding.SingleDeviceSharding(jax.devices()[1])
    saved = {"w": jnp.arange(8.0), "key": jax.random.key(5)}
    Checkpoint(tmp_path / "a").save_sync(tpjax.PyTree(saved))
    target = {"w": jax.device_put(jnp.zeros(8), split), "key": jax.device_put(jax.random.key(0), second)}
    with Checkpoint(tmp_path / "b", tmp_path / "a") as cp:
        out = tpjax.load_pytree_sync(cp, target=target)
    assert out["w"].sharding == split and out["w"].tolist() == list(range(8))
    assert out["key"].sharding == second
    assert_same(out["key"], saved["key"])


@pytest.mark.parametrize(("change", "message"), [
    (lambda t: t["params"]["dense"].update(kernel=jnp.zeros((4, 4))),
     "params/dense/kernel: shape (3, 4) in the checkpoint vs (4, 4) in the target"),
    (lambda t: t["params"]["dense"].update(scale=jnp.zeros(4)),
     "params/dense/scale: the target has this, the checkpoint does not"),
    (lambda t: t["params"]["dense"].pop("bias"),
     "params/dense/bias: the checkpoint has this, the target does not"),
    (lambda t: t.update(text=jnp.zeros(3)), "text: the checkpoint holds a str, the target a jax.Array"),
    (lambda t: t.update(key=jax.random.key(0, impl="rbg")),
     "key: PRNG key implementation threefry2x32 in the checkpoint vs rbg in the target"),
])
def test_target_that_does_not_match_names_the_first_mismatching_path(tmp_path, change, message):
    Checkpoint(tmp_path / "a").save_sync(tpjax.PyTree(every_leaf()))
    target = every_leaf()
    change(target)
    with Checkpoint(tmp_path / "b", tmp_path / "a") as cp, pytest.raises(ValueError, match=re.escape(message)):
        tpjax.load_pytree_sync(cp, target=target)


def test_a_target_that_does_not_match_names_the_checkpoints_uri_not_a_temporary_folder(tmp_path):
    """The issue's row: the message named the scratch folder a restore extracts into, gone afterwards."""
    target = every_leaf()
    target["params"]["dense"].update(kernel=jnp.zeros((4, 4)))
    steps = str(tmp_path / "steps")
    with tpjax.OrbaxCheckpointHandler() as h:
        h.save(steps, every_leaf(), step=3)
        with pytest.raises(ValueError) as info:
            h.restore(steps, target=target, step=3)
    assert f"(step 3 in {steps} does not match the target's structure" in str(info.value)
    Checkpoint(tmp_path / "a").save_sync(tpjax.PyTree(every_leaf()))
    with Checkpoint(tmp_path / "b", tmp_path / "a") as cp, pytest.raises(ValueError) as loaded:
        tpjax.load_pytree_sync(cp, target=target)
    assert f"(the checkpoint at {tmp_path / 'a'} does not match" in str(loaded.value)
    for message in (str(info.value), str(loaded.value)):
        assert "/taskpoint-" not in message  # neither the restore's scratch folder nor the workspace


def test_a_target_that_does_not_match_a_managers_step_names_the_step_and_its_directory(tmp_path):
    """The issue's row through load_pytree: given the manager, not the folder its restore returned (a temporary
    one of the manager's, gone once it closes), the message names the step and the manager's directory."""
    target = every_leaf()
    target["params"]["dense"].update(kernel=jnp.zeros((4, 4)))
    steps = str(tmp_path / "steps")
    with CheckpointManager(steps, preemption=False) as manager:
        assert tpjax.load_pytree_sync(manager, target=every_leaf()) is None  # no step yet, as a first attempt
        manager.save(tpjax.PyTree(every_leaf()), 3)
        manager.save(tpjax.PyTree(every_leaf()), 4)
        with pytest.raises(ValueError) as newest:
            tpjax.load_pytree_sync(manager, target=target)
        with pytest.raises(ValueError) as chosen:
            anyio.run(lambda: tpjax.load_pytree(manager, target=target, step=3))
        assert_same(tpjax.load_pytree_sync(manager, target=every_leaf(), step=3), every_leaf())
    assert str(newest.value).startswith("params/dense/kernel: shape (3, 4) in the checkpoint vs (4, 4)")
    assert f"(step 4 in {steps} does not match the target's structure" in str(newest.value)
    assert f"(step 3 in {steps} does not match" in str(chosen.value)
    for message in (str(newest.value), str(chosen.value)):
        assert "/taskpoint-" not in message  # the manager's own folder a restore lands in
    with pytest.raises(TypeError, match="step= is for a CheckpointManager, not a Checkpoint"):
        tpjax.load_pytree_sync(Checkpoint(tmp_path / "c"), step=3)


def test_an_orbax_error_restoring_into_a_target_names_the_step_and_keeps_the_original(tmp_path):
    """A target leaf Orbax cannot restore into (a numpy array of strings) fails inside Orbax, after the
    structure matched: the message names the step's URI, never the workspace, and Orbax's error is chained."""
    steps = str(tmp_path / "steps")
    with tpjax.OrbaxCheckpointHandler() as h:
        h.save(steps, {"w": jnp.arange(12, dtype=jnp.float32).reshape(3, 4)}, step=2)
        with pytest.raises(ValueError) as info:
            h.restore(steps, target={"w": np.zeros((3, 4), dtype="<U1")}, step=2)
    message = str(info.value)
    assert message.startswith(f"step 2 in {steps}: Orbax could not restore its arrays as the target asks (")
    assert "/taskpoint-" not in message
    assert info.value.__cause__ is not None and str(info.value.__cause__) in message


def test_unsupported_leaves_are_refused_with_their_path(tmp_path):
    with pytest.raises(TypeError, match="opt/state: a PyTree leaf cannot be a object"):
        Checkpoint(tmp_path / "a").save_sync(tpjax.PyTree({"opt": {"state": object()}}))
    assert not (tmp_path / "a").exists()


@pytest.mark.e2e("starts a python process")
def test_import_taskpoint_never_imports_jax_and_a_pytree_step_loads_without_importing_the_extra(tmp_path):
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(tpjax.PyTree({"w": jnp.arange(3.0)}), 1)
    script = f"""
        import sys, taskpoint
        assert not [m for m in sys.modules if m.split(".")[0] in ("jax", "orbax", "flax")], "jax imported"
        with taskpoint.CheckpointManager({str(tmp_path / 'steps')!r}) as m:
            print(sorted(p.name for p in m.restore(1).iterdir()))
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "['orbax', 'taskpoint-pytree.json']"


@pytest.mark.e2e("starts a python process")
def test_without_jax_importing_the_extra_or_loading_a_pytree_says_which_extra_to_install(tmp_path):
    with CheckpointManager(tmp_path / "steps") as m:
        m.save(tpjax.PyTree({"w": jnp.arange(3.0)}), 1)
    script = f"""
        import sys
        sys.modules["jax"] = None  # as if jax were not installed
        import taskpoint
        try:
            import taskpoint.jax
        except ImportError as exc:
            print("import:", exc)
        try:
            taskpoint.CheckpointManager({str(tmp_path / 'steps')!r}).restore(1)
        except taskpoint.CheckpointError as exc:
            print("restore:", exc)
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=60)
    lines = out.stdout.splitlines()
    assert len(lines) == 2, out.stdout + out.stderr
    assert lines[0].startswith("import:") and 'pip install "taskpoint[jax]"' in lines[0]
    assert lines[1].startswith("restore:") and 'pip install "taskpoint[jax]"' in lines[1]


# -- OrbaxCheckpointHandler ------------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_handler_saves_and_restores_a_pytree_by_step(store):
    with tpjax.OrbaxCheckpointHandler(storage_options=store.storage_options) as h:
        uri = h.save(store.base, every_leaf(), step=1, metadata={"epoch": 3})
        assert uri == f"{store.base}/ckpt-1"
        assert h.get_checkpoint_steps(store.base) == [1] and h.latest_step(store.base) == 1
        assert h.list_checkpoints(store.base) == {1: uri}
        assert_same(h.restore(store.base), as_saved_without_target(every_leaf()))
        assert_same(h.restore(store.base, target=every_leaf(), step=1), every_leaf())
        assert h.restore(store.base, metadata_only=True) == {"epoch": 3}


class Reader:
    """A data pipeline position: a Checkpointable object."""

    def __init__(self, seed: int) -> None:
        self.position, self.shard, self.key = 0, "train-000", jax.random.key(seed)

    def get_state(self) -> dict[str, Any]:
        return {"position": self.position, "shard": self.shard, "key": self.key}

    def set_state(self, state: dict[str, Any]) -> None:
        self.position, self.shard, self.key = state["position"], state["shard"], state["key"]


def test_handler_restores_a_checkpointable_object_through_set_state(tmp_path):
    reader = Reader(seed=1)
    reader.position, reader.shard = 1234, "train-007"
    fresh = Reader(seed=2)
    assert isinstance(reader, tpjax.Checkpointable) and not isinstance({"a": 1}, tpjax.Checkpointable)
    with tpjax.OrbaxCheckpointHandler() as h:
        h.save(tmp_path, reader, step=10)
        assert h.restore(tmp_path, target=fresh) is fresh
    assert (fresh.position, fresh.shard) == (1234, "train-007")
    assert_same(fresh.key, reader.key)


def test_handler_updates_an_nnx_module_in_place_with_its_own_rngs(tmp_path):
    nnx = pytest.importorskip("flax.nnx")

    class Model(nnx.Module):
        def __init__(self, seed: int) -> None:
            self.rngs = nnx.Rngs(seed, dropout=seed + 1)
            self.dense = nnx.Linear(3, 4, rngs=self.rngs)
            self.drop = nnx.Dropout(0.5, rngs=self.rngs)

        def __call__(self, x: jax.Array) -> jax.Array:
            return self.drop(self.dense(x))

    trained = Model(seed=0)
    trained(jnp.ones((2, 3)))  # advances the dropout stream
    other = Model(seed=5)
    with tpjax.OrbaxCheckpointHandler() as h:
        h.save(tmp_path, trained, step=1)
        assert h.restore(tmp_path, target=other) is other
    assert_same(other.dense.kernel[...], trained.dense.kernel[...])
    assert_same(other.rngs.dropout.key[...], trained.rngs.dropout.key[...])
    assert jax.random.key_impl(other.rngs.default.key[...]) == jax.random.key_impl(trained.rngs.default.key[...])
    np.testing.assert_array_equal(other(jnp.ones((2, 3))), trained(jnp.ones((2, 3))))  # same dropout mask


def test_metadata_only_reads_the_metadata_and_not_the_payload(tmp_path):
    with tpjax.OrbaxCheckpointHandler() as h:
        h.save(tmp_path, {"w": jnp.ones(3)}, step=2, metadata={"loss": 0.25, "tags": ["a"]})
        for stored in (tmp_path / "ckpt-2").glob("pytree-*"):  # the tree's files and their list
            shutil.rmtree(stored) if stored.is_dir() else stored.unlink()  # only metadata_only can still succeed
        assert h.restore(tmp_path, step=2, metadata_only=True) == {"loss": 0.25, "tags": ["a"]}
        with pytest.raises(CheckpointCorruptError):
            h.restore(tmp_path, step=2)


def test_keep_keeps_the_newest_steps_and_the_default_keeps_them_all(tmp_path):
    with tpjax.OrbaxCheckpointHandler() as h:
        for step in range(1, 6):
            h.save(tmp_path / "all", {"step": step}, step=step)
            h.save(tmp_path / "two", {"step": step}, step=step, keep=2)
        assert h.get_checkpoint_steps(tmp_path / "all") == [1, 2, 3, 4, 5]
        assert h.get_checkpoint_steps(tmp_path / "two") == [4, 5]
        assert sorted(os.listdir(tmp_path / "two")) == ["ckpt-4", "ckpt-5"]
        assert h.restore(tmp_path / "two", step=4) == {"step": 4}
        with pytest.raises(FileExistsError):
            h.save(tmp_path / "two", {"step": 0}, step=5)
        h.save(tmp_path / "two", {"step": 0}, step=5, overwrite=True)
        assert h.restore(tmp_path / "two") == {"step": 0}


def test_save_without_step_writes_directory_checkpoint_and_restore_prefers_steps(tmp_path):
    with tpjax.OrbaxCheckpointHandler() as h:
        with pytest.raises(FileNotFoundError):
            h.restore(tmp_path)
        assert h.save(tmp_path, {"v": "single"}, metadata={"kind": "single"}) == f"{tmp_path}/checkpoint"
        assert os.listdir(tmp_path) == ["checkpoint"]
        assert h.get_checkpoint_steps(tmp_path) == [] and h.latest_step(tmp_path) is None
        assert h.restore(tmp_path) == {"v": "single"}
        assert h.restore(tmp_path, metadata_only=True) == {"kind": "single"}
        with pytest.raises(FileExistsError):
            h.save(tmp_path, {"v": "again"})
        h.save_to_directory(tmp_path, {"v": "again"}, overwrite=True)
        assert h.restore(tmp_path) == {"v": "again"}
        h.save(tmp_path, {"v": "step 1"}, step=1)
        assert h.restore(tmp_path) == {"v": "step 1"}


@pytest.mark.e2e("starts a save process")
def test_async_checkpointing_snapshots_at_save_and_wait_until_finished_commits(tmp_path):
    weights = np.zeros(10_000)
    with tpjax.OrbaxCheckpointHandler(async_checkpointing=True) as h:
        for step in (1, 2, 3):
            weights[:] = step
            h.save(tmp_path, {"w": weights}, step=step, keep=2)
            weights[:] = -1  # the saved step still holds `step`
        h.wait_until_finished()
        assert h.get_checkpoint_steps(tmp_path) == [2, 3]
        assert [h.restore(tmp_path, step=s)["w"][0] for s in (2, 3)] == [2.0, 3.0]
        h.save(tmp_path, {"w": weights}, step=4)
        assert h.restore(tmp_path)["w"][0] == -1.0  # restore waits for the save in flight
    with pytest.raises(CheckpointError, match="closed"):
        h.save(tmp_path, {"w": weights}, step=5)


_KILLED_SAVE = """
    import os, signal, sys
    import numpy as np
    import taskpoint.manager.kinds.files as files_kind
    from taskpoint.jax import OrbaxCheckpointHandler

    directory = sys.argv[1]
    with OrbaxCheckpointHandler() as h:
        h.save(directory, {"w": np.arange(4.0), "step": 1}, step=1)

    def dies_midway(root, plan, **kw):  # Orbax has written the tree into the step's folder; nothing is committed
        os.kill(os.getpid(), signal.SIGKILL)

    files_kind.hash_local = dies_midway
    OrbaxCheckpointHandler().save(directory, {"w": np.arange(40_000.0), "step": 2}, step=2)
"""


@pytest.mark.slow
@pytest.mark.e2e("starts a python process")
def test_save_killed_midway_leaves_the_previous_step_restorable_and_its_leftovers_are_removed(tmp_path):
    directory, scratch = tmp_path / "ckpts", tmp_path / "tmp"
    scratch.mkdir()
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(_KILLED_SAVE), str(directory)],
                         capture_output=True, text=True, timeout=120, env={**os.environ, "TMPDIR": str(scratch)})
    assert out.returncode == -9, out.stderr
    leftovers = list((directory / "ckpt-2").iterdir())
    assert leftovers and not (directory / "ckpt-2" / "taskpoint.json").exists()
    with tpjax.OrbaxCheckpointHandler() as h:
        assert h.get_checkpoint_steps(directory) == [1] and h.latest_step(directory) == 1
        assert_same(h.restore(directory), {"w": np.arange(4.0), "step": 1})
        for leftover in leftovers:  # older than the grace period that protects a save in progress
            for path in [leftover, *leftover.rglob("*")]:  # a PyTree step's tree: a folder of files
                os.utime(path, (1, 1))
        h.save(directory, {"w": np.arange(4.0), "step": 3}, step=3)
        assert not (directory / "ckpt-2").exists()
        assert h.get_checkpoint_steps(directory) == [1, 3]


@pytest.mark.slow
@pytest.mark.e2e("runs an example as a process")
def test_jax_training_example_resumes_after_a_forced_failure_and_ends_as_an_uninterrupted_run(tmp_path):
    def run(*args: str) -> str:
        env = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
        out = subprocess.run([sys.executable, str(EXAMPLES / "jax_train_resume.py"), *args], cwd=tmp_path,
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stdout + out.stderr
        return out.stdout

    failed = run("--steps", "30", "--save-every", "5", "--fail-at", "17")
    assert re.findall(r"attempt (\d): resumed at step (\d+)", failed) == [("1", "0"), ("2", "15")]
    clean = run("--steps", "30", "--save-every", "5")
    assert re.findall(r"attempt (\d): resumed at step (\d+)", clean) == [("1", "0")]
    assert failed.splitlines()[-1] == clean.splitlines()[-1]
    assert failed.splitlines()[-1].startswith("final params: ")
