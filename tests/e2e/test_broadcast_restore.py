"""``restore(broadcast=True)``: 4 gloo ranks started by the real ``torchrun`` restore one step with one read of it.

The steps are saved straight to the S3 server; each phase's ranks restore one through a proxy of their own
(tests/_fault_proxy.py, passing everything), which counts the response bytes it serves: what the store was asked
to send. With ``broadcast=True`` that is one copy of the step (plus the manifests each rank reads), for a payload
step and for a ``StateDict`` step loaded by ``load_state_dict_sync``; without it, each rank reads the whole step.
Every rank's bytes (or tensors) are hashed and compared with what was saved; a byte flipped in the stored payload
fails every rank with CheckpointCorruptError naming the payload; a rank that never takes part ends the others'
waits, bounded by ``commit_timeout``, with an error naming each waiting rank. The workers are
tests/_broadcast_worker.py; every wait is bounded, nothing asserts how long anything took.
"""

from __future__ import annotations

import contextlib
import hashlib
import os

import fsspec
import numpy as np
import pytest

import taskpoint
from _broadcast_job import JOB_WITHIN, TORCHRUN, WORLD, digests, phase, torchrun
from _fault_proxy import fault_proxy
from _once import shared_once
from helpers import LazyModule, requires

torch = LazyModule("torch")
tp_torch = LazyModule("taskpoint.torch")
tp_jax = LazyModule("taskpoint.jax")
worker = LazyModule("_broadcast_worker")
#: Bytes of the payload step: three 16 MiB blocks of the exchange (the last short), read by three ranks.
SIZE = (32 << 20) + 12345
#: Whether the job also loads a PyTree step (taskpoint.jax's extra installed).
JAX = not requires("jax", "orbax.checkpoint").args[0]
#: The PyTree step's tree: 4 MiB of float32 in one array, and a small one.
TREE = {"w": np.arange(1 << 20, dtype=np.float32).reshape(1024, 1024), "b": np.arange(7, dtype=np.int32)}
pytestmark = [pytest.mark.slow, pytest.mark.skipif(not TORCHRUN.exists(), reason="no torchrun beside python"),
              requires("torch")]


@pytest.fixture(scope="module")
def job(s3_server, tmp_path_factory):
    """One torchrun job of 4 ranks (their start costs more than the restores) over three steps saved straight to
    the S3 server: a payload step, restored with broadcast and without, and in place with it; a ``StateDict``
    step, loaded with broadcast; and a payload step with a byte of its stored payload flipped, restored with
    broadcast, then once more with rank 3 never taking part and the others' collectives bounded by a 5 s
    ``commit_timeout``. Each phase but the last goes through a byte-counting proxy of its own. What was saved,
    the outcomes and the bytes each proxy served; once per session (:func:`_once.shared_once`), as a worker that
    takes over some of these tests would run the job again."""
    return shared_once(tmp_path_factory, "broadcast-restore-job", lambda: run_job(s3_server), JOB_WITHIN + 120)


def run_job(s3_server):
    base = s3_server.new_location().base
    data = os.urandom(SIZE)
    state = {"weight": torch.randn(1536, 1024), "bias": torch.arange(2_000_000, dtype=torch.float64)}
    with taskpoint.CheckpointManager(f"{base}/bytes", storage_options=s3_server.storage_options) as manager:
        manager.save(data, 1)
    with taskpoint.CheckpointManager(f"{base}/state", storage_options=s3_server.storage_options) as manager:
        manager.save(tp_torch.StateDict(state), 1)
        state_size = manager.describe(1).size
    if JAX:
        with taskpoint.CheckpointManager(f"{base}/tree", storage_options=s3_server.storage_options) as manager:
            manager.save(tp_jax.PyTree(TREE), 1)
    with taskpoint.CheckpointManager(f"{base}/damaged", storage_options=s3_server.storage_options) as manager:
        manager.save(data, 1)
        payload = manager.describe(1).payload
    fs = fsspec.filesystem("s3", **s3_server.storage_options)
    stored = f"{base}/damaged/ckpt-1/{payload}".removeprefix("s3://")
    damaged = bytearray(data)
    damaged[SIZE - 100] ^= 0x01  # in the last block: read by rank 2, received by the others
    fs.pipe_file(stored, bytes(damaged))
    names = ("broadcast", "each", "in_place", "state_dict", "flipped", "pytree")
    with contextlib.ExitStack() as stack:
        proxy = {name: stack.enter_context(fault_proxy(s3_server.endpoint)) for name in names}
        outcomes = torchrun([
            phase("broadcast", proxy["broadcast"], s3_server, f"{base}/bytes", "restore", True),
            phase("each", proxy["each"], s3_server, f"{base}/bytes", "restore", False),
            phase("in_place", proxy["in_place"], s3_server, f"{base}/bytes", "in_place", True),
            phase("state_dict", proxy["state_dict"], s3_server, f"{base}/state", "state_dict", True),
            *([phase("pytree", proxy["pytree"], s3_server, f"{base}/tree", "pytree", True)] if JAX else []),
            phase("flipped", proxy["flipped"], s3_server, f"{base}/damaged", "restore", True),
            {**phase("absent", None, s3_server, f"{base}/damaged", "restore", True), "absent": WORLD - 1,
             "commit_timeout": 5},
        ], ranks={"absent": WORLD - 1})
        served = {name: proxy[name].stats()["served"] for name in names}
    saved = {"bytes": hashlib.sha256(data).hexdigest(), "state": worker.tensors_digest(state),
             "state_size": state_size, "payload": payload, "tree": worker.arrays_digest(TREE),
             "tree_size": int(fs.du(f"{base}/tree/ckpt-1".removeprefix("s3://"))) if JAX else 0}
    return saved, outcomes, served


def test_four_ranks_read_a_step_once_with_broadcast_and_each_whole_without(job):
    saved, outcomes, served = job
    assert digests(outcomes["broadcast"]) == dict.fromkeys(range(WORLD), saved["bytes"])
    assert digests(outcomes["each"]) == dict.fromkeys(range(WORLD), saved["bytes"])
    assert SIZE <= served["broadcast"] <= 1.2 * SIZE, served
    assert served["each"] >= WORLD * SIZE, served


def test_restore_in_place_with_broadcast_reads_the_step_once_and_hands_each_rank_the_checked_copy(job):
    saved, outcomes, served = job
    assert digests(outcomes["in_place"]) == dict.fromkeys(range(WORLD), saved["bytes"])
    assert SIZE <= served["in_place"] <= 1.2 * SIZE, served  # its copy, made once, is what the block reads


def test_four_ranks_load_a_state_dict_read_once_each_piece_checked(job):
    saved, outcomes, served = job
    assert digests(outcomes["state_dict"]) == dict.fromkeys(range(WORLD), saved["state"])
    assert saved["state_size"] <= served["state_dict"] <= 1.2 * saved["state_size"], served


@requires("jax", "orbax.checkpoint")
def test_four_ranks_load_a_pytree_read_once_each_checking_its_copy_before_orbax_reads_it(job):
    saved, outcomes, served = job
    assert digests(outcomes["pytree"]) == dict.fromkeys(range(WORLD), saved["tree"])
    assert served["pytree"] <= 1.2 * saved["tree_size"], served  # every file of the step, once


def test_a_byte_flipped_on_the_store_fails_every_rank_of_a_broadcast_restore_naming_the_payload(job):
    saved, outcomes, served = job
    for rank, got in outcomes["flipped"].items():
        assert got.get("error") == "CheckpointCorruptError", (rank, got)
        assert saved["payload"] in got["message"] and "step 1" in got["message"], (rank, got)
    assert served["flipped"] <= 1.2 * SIZE  # the damaged step, too, was read once


def test_a_rank_that_never_takes_part_ends_the_others_wait_with_an_error_naming_them(job):
    _, outcomes, _ = job
    assert sorted(outcomes["absent"]) == [0, 1, 2]
    for rank, got in outcomes["absent"].items():
        assert got.get("error") in ("TimeoutError", "CheckpointError"), (rank, got)
        assert f"rank {rank} of {WORLD} gave up waiting for the objects of step 1" in got["message"], (rank, got)


def test_without_a_process_group_broadcast_reads_the_step_itself(tmp_path, caplog):
    data = os.urandom(1 << 20)
    with taskpoint.CheckpointManager(tmp_path / "steps") as manager:
        manager.save(data, 3)
        with caplog.at_level("INFO", logger="taskpoint"):
            assert manager.restore(broadcast=True).read_bytes() == data
            with manager.restore_in_place(3, broadcast=True) as folder:
                assert folder.read_bytes() == data
    assert "without a torch.distributed process group" in caplog.text
