"""Background saves of JAX PyTrees staged in shared memory (issue 43): the step the save process writes (the
``jax.pytree`` step a blocking save writes), what survives a SIGKILL of the trainer or of the save process, and
the staging bound."""

from __future__ import annotations

import json
import logging
import os
import random
import re
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from _staged_kills import kill_save_process_mid_write, kill_trainer_after_return
from helpers import staged_segments
from taskpoint import CheckpointManager

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from taskpoint.jax import PyTree, load_pytree_sync  # noqa: E402

LOCAL_AND_S3 = pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
#: Trials of the kill test per store: trial 0 kills after a first save, trial 1 after the second (from a warm
#: save process). make reliability runs the issue's 20.
KILL_TRIALS = 2
CAMPAIGN_TRIALS = 20
#: The save process's grace after its trainer died (it commits within it): generous for a loaded machine, where
#: it imports jax at nice +10 first.
GRACE_SECONDS = 180


def _tree(seed: int, floats: int = 1 << 20) -> dict:
    """A training state as JAX gives one: jax arrays of several dtypes, a numpy array, a typed PRNG key, Python
    and numpy scalars, a string, an empty array, a tuple with None."""
    rng = np.random.default_rng(seed)
    return {"params": {"w": jnp.asarray(rng.standard_normal(floats, dtype=np.float32)),
                       "b": jnp.arange(7, dtype=jnp.bfloat16) + seed},
            "counts": np.arange(5, dtype=np.int64) * seed,
            "rng": jax.random.key(seed), "step": seed, "lr": 0.5 / (seed + 1), "name": f"run-{seed}",
            "loss": np.float32(seed / 3), "empty": jnp.zeros((0, 3)), "pair": (jnp.ones(3) * seed, None)}


def _assert_same(loaded, expected) -> None:
    """Same structure, and each leaf of the same type, dtype, shape and value (a key by its implementation and
    data)."""
    assert jax.tree_util.tree_structure(loaded) == jax.tree_util.tree_structure(expected)
    for got, want in zip(jax.tree_util.tree_leaves(loaded), jax.tree_util.tree_leaves(expected), strict=True):
        assert type(got) is type(want) or (isinstance(got, jax.Array) and isinstance(want, jax.Array)), (got, want)
        if isinstance(want, jax.Array) and jnp.issubdtype(want.dtype, jax.dtypes.prng_key):
            assert str(jax.random.key_impl(got)) == str(jax.random.key_impl(want))
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        if isinstance(want, (jax.Array, np.ndarray, np.generic)):
            assert got.dtype == want.dtype and got.shape == want.shape
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        else:
            assert got == want


def _refuse_here(*args, **kwargs):
    raise AssertionError("the tree was written from the trainer's process")


def _layout(folder: Path) -> list[str]:
    """The files of a step's tree, each Orbax or save id named by what it is."""
    return sorted(re.sub(r"[0-9a-f]{32}", "<id>", path.relative_to(folder).as_posix())
                  for path in folder.rglob("*") if path.is_file())


# -- the step a background save writes --------------------------------------------------------------------------

@LOCAL_AND_S3
@pytest.mark.slow
def test_a_background_pytree_save_writes_the_step_a_blocking_one_writes_from_the_save_process(store, monkeypatch):
    """The save process writes the jax.pytree step (Orbax's files, each listed with its digests), not an archive;
    the trainer's own writer is broken on purpose. The numpy array is changed at once after save() returned; the
    step holds it as it was."""
    tree, expected = _tree(1), _tree(1)
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, async_save=True) as m:
        m.save(PyTree(tree), 1, blocking=True)
        with monkeypatch.context() as patched:
            for writer in ("store_folder", "write_folder"):  # the blocking save's, and a staged one's here
                patched.setattr(f"taskpoint.jax._kind.{writer}", _refuse_here)
            m.save(PyTree(tree), 2)
            tree["counts"] += 100  # the segment is the save process's now: this changes nothing saved
            m.wait_until_finished()
        blocking, background = m.describe(1), m.describe(2)
        assert background.kind == blocking.kind == "jax.pytree"
        assert (background.payload_kind, background.codec) == (blocking.payload_kind, blocking.codec)
        for step in (1, 2):
            _assert_same(load_pytree_sync(m, step=step), expected)
        assert m.verify(2).healthy
        sidecars = [json.loads((Path(m.restore(step)) / "taskpoint-pytree.json").read_text()) for step in (1, 2)]
        assert sidecars[0] == sidecars[1]  # the same leaves, kinds and structure
        saver = m._background.saver.pid
    assert staged_segments(os.getpid(), saver) == []  # freed once written (or kept for a next save until close)
    if store.kind == "local":
        # Orbax's data files vary in number from one write to the next; every other file is there in both
        steps = [next(Path(store.url("ckpts"), f"ckpt-{step}").glob("pytree-*[0-9a-f]")) for step in (1, 2)]
        layouts = [[name for name in _layout(folder) if "/d/" not in name] for folder in steps]
        assert layouts[0] == layouts[1]


def _compressors(folder: Path) -> set[str]:
    """The codecs (as JSON) of the arrays Orbax stored in a tree's folder, read from their metadata by tensorstore
    (``null``: stored uncompressed)."""
    import tensorstore as ts

    keys = [str(i) for i, leaf in enumerate(json.loads((folder / "taskpoint-pytree.json").read_text())["leaves"])
            if "dtype" in leaf and all(leaf["data_shape"])]
    base = {"driver": "ocdbt", "base": (folder / "orbax").as_uri()}
    return {json.dumps(ts.open({"driver": "zarr", "kvstore": base, "path": key}).result().spec().to_json()["metadata"]
                       .get("compressor")) for key in keys}


def test_both_saves_store_a_trees_arrays_uncompressed_and_a_step_stored_compressed_before_restores(tmp_path,
                                                                                                     monkeypatch):
    """Orbax compresses by default and holds each array's compressed copy while it writes it (issue 43): a step's
    arrays are stored as they are, by a blocking save and by the save process; a step whose arrays an older taskpoint
    let Orbax compress restores beside them."""
    with CheckpointManager(tmp_path / "ckpts", async_save=True) as m:
        with monkeypatch.context() as patched:
            patched.setattr("taskpoint.jax._pytree.ARRAYS_COMPRESSED", True)  # what an older taskpoint wrote
            m.save(PyTree(_tree(1)), 1, blocking=True)
        m.save(PyTree(_tree(2)), 2, blocking=True)
        m.save(PyTree(_tree(3)), 3)
        m.wait_until_finished()
        assert m._background.staging.ready is not None, "step 3 was not staged"
        folders = [next((tmp_path / "ckpts" / f"ckpt-{step}").glob("pytree-*[0-9a-f]")) for step in (1, 2, 3)]
        assert [_compressors(folder) for folder in folders] == [{json.dumps({"id": "zstd", "level": 1})},
                                                                {"null"}, {"null"}]
        for step in (1, 2, 3):
            _assert_same(load_pytree_sync(m, step=step), _tree(step))


def test_a_tree_without_arrays_is_staged_in_an_empty_segment(tmp_path):
    tree = {"step": 3, "name": "x", "empty": jnp.zeros((0,)), "none": None}
    with CheckpointManager(tmp_path / "ckpts", async_save=True) as m:
        m.save(PyTree(tree), 1)
        m.wait_until_finished()
        assert m.describe(1).kind == "jax.pytree"
        _assert_same(load_pytree_sync(m), tree)
        saver = m._background.saver.pid
    assert staged_segments(os.getpid(), saver) == []


def test_a_tree_larger_than_max_staging_bytes_is_saved_blocking_and_says_so(tmp_path, caplog):
    tree = _tree(2, floats=1 << 16)
    with caplog.at_level(logging.INFO, logger="taskpoint"), \
            CheckpointManager(tmp_path / "ckpts", max_staging_bytes=1 << 16) as m:
        m.save(PyTree(tree), 1, blocking=False)
        assert m.steps() == [1]  # committed before save() returned
        assert m.describe(1).kind == "jax.pytree"
        _assert_same(load_pytree_sync(m, step=1), _tree(2, floats=1 << 16))
    assert any("exceed max_staging_bytes" in record.getMessage() for record in caplog.records)


# -- SIGKILL of the trainer right after save() returned ----------------------------------------------------------

_TRAINER = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [sys.argv[4], sys.argv[4] + "/.."]  # this module, and the helpers it imports
    from test_staged_pytrees import _tree
    from taskpoint import CheckpointManager
    from taskpoint.jax import PyTree

    uri, options, step = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    m = CheckpointManager(uri, storage_options=options, async_save=True, preemption=False)
    if step > 1:
        m.save(PyTree(_tree(step - 1)), step - 1)
        m.wait_until_finished()
    tree = _tree(step)
    m.save(PyTree(tree), step)
    print(m._background.saver.pid, flush=True)
    while True:  # training: the arrays change at once
        tree["counts"] *= 3
        tree["params"]["w"] = tree["params"]["w"] * 1.5
""")


def _kill_trainer_after_return(store, trial: int) -> None:
    uri = store.url(f"ckpts-{trial}")
    step = 1 + trial % 2  # even trials: a first save; odd: the second, from a warm save process
    delay = random.Random(trial).uniform(0, 0.05)  # the moment of the kill: 0-50 ms after the return
    trainer, helper = kill_trainer_after_return(
        _TRAINER, [uri, json.dumps(store.fs_options), str(step), str(Path(__file__).parent)], GRACE_SECONDS, delay)
    with CheckpointManager(uri, storage_options=store.storage_options) as m:
        assert m.latest_step() == step
        assert m.describe(step).kind == "jax.pytree"
        _assert_same(load_pytree_sync(m, step=step), _tree(step))
        assert m.verify(step).healthy
    assert staged_segments(trainer, helper) == []


@pytest.mark.slow
@pytest.mark.timeout(900)
@LOCAL_AND_S3
@pytest.mark.parametrize("trial", [pytest.param(n, id=f"trial{n}") for n in range(KILL_TRIALS)])
def test_a_trainer_killed_0_to_50_ms_after_a_staged_pytree_save_returned_loses_nothing(store, trial):
    _kill_trainer_after_return(store, trial)


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.campaign(f"{CAMPAIGN_TRIALS} trials per store (make test: {KILL_TRIALS})")
@LOCAL_AND_S3
@pytest.mark.parametrize("trial", [pytest.param(n, id=f"trial{n}") for n in range(CAMPAIGN_TRIALS)])
def test_a_trainer_killed_0_to_50_ms_after_a_staged_pytree_save_returned_loses_nothing_campaign(store, trial):
    """Issue 43's 20 trials per store for a PyTree, one a test (as the state dict's, in test_staged_saves.py)."""
    _kill_trainer_after_return(store, trial)


# -- SIGKILL of the save process in the middle of its write ------------------------------------------------------

def _saved(step: int) -> PyTree:
    """What the trainers save as ``step``."""
    return PyTree(_tree(step))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_save_process_killed_in_the_middle_of_a_pytree_write_commits_nothing_and_its_segment_is_freed(s3_server):
    """The upload of step 2's files is held by the proxy; the trainer is SIGKILLed, then its save process while it
    writes: step 2 is not committed, step 1 restores, and the next manager's save process frees the segment."""
    uri = f"s3://taskpoint-tests/held-staged-tree-{os.getpid()}-{time.monotonic_ns()}/ckpts"
    kill_save_process_mid_write("test_staged_pytrees:_saved", s3_server, uri, "pytree-",
                                lambda m: _assert_same(load_pytree_sync(m), _tree(1)))
