"""taskpoint.torch: PyTorch DCP through taskpoint's Writer and Reader, on the real S3 server.

The resharding test runs real gloo jobs on CPU (one process per rank, forked from one that imported DCP:
tests/_zygote.py; torchrun's variables, one process group per job, see tests/_dcp_worker.py); the others save
and load in this process (DCP without a process group).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import blake3
import pytest

import _zygote as zygote
import taskpoint
from _fault_proxy import FaultProxy
from helpers import LazyModule, requires
from taskpoint import RetryPolicy
from taskpoint.errors import CheckpointCorruptError, StorageNotFound, StorageUnavailable

# Imported when a test first uses them: collecting this module imports no torch.
torch = LazyModule("torch")
dcp = LazyModule("torch.distributed.checkpoint")
dcp_api = LazyModule("torch.distributed.checkpoint.api")
fsspec_dcp = LazyModule("torch.distributed.checkpoint._fsspec_filesystem")
tp_torch = LazyModule("taskpoint.torch")
worker = LazyModule("_dcp_worker")

WORKER = Path(__file__).parents[1] / "_dcp_worker.py"
pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning"), requires("torch")]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_ranks(world_size: int, actions: list[list[str]], options: dict[str, Any]) -> list[zygote.Forked]:
    """Start one gloo job of ``world_size`` real processes running ``actions`` (torchrun's variables), forked
    from a server that imported torch and DCP, which every rank imports first (tests/_zygote.py)."""
    port = _free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "STORAGE_OPTIONS": json.dumps(options), "GLOO_TIMEOUT": "60"}
        procs.append(zygote.spawn(zygote.DCP, [str(WORKER), json.dumps(actions)], env))
    return procs


def finish_ranks(procs: list[zygote.Forked], expect: dict[int, int] | None = None) -> None:
    """Wait for a job; every rank must exit 0, or with the status ``expect`` gives for it."""
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    wanted = expect or {}
    failed = [(rank, out) for rank, (p, out) in enumerate(zip(procs, outputs, strict=True))
              if p.returncode != wanted.get(rank, 0)]
    assert not failed, "\n".join(f"rank {rank} failed:\n{out[-3000:]}" for rank, out in failed)


def failures(exc: BaseException) -> list[BaseException]:
    """The errors each rank raised inside DCP's CheckpointException."""
    return [error for error, _ in exc.failures.values()]


@pytest.mark.slow
def test_dtensor_model_saved_on_4_ranks_loads_bit_identical_on_2_and_back(s3_store: Any) -> None:
    options = s3_store.storage_options
    four, two, back = s3_store.url("four"), s3_store.url("two"), s3_store.url("async")
    # Two jobs at once, each one process group: the 2-rank job waits for the 4-rank job's commits, and the 4-rank
    # job then waits for the 2-rank job's (process start-up is the cost; a third job would pay it again).
    job4 = start_ranks(4, [["save", four], ["async_save", back], ["wait_for", two], ["load", two]], options)
    job2 = start_ranks(2, [["wait_for", back], ["load", four], ["load", back], ["save", two]], options)
    finish_ranks(job2)
    finish_ranks(job4)
    fs = s3_store.fs()
    names = sorted(p.rsplit("/", 1)[-1] for p in fs.ls(four, detail=False, refresh=True))
    assert names[0] == ".metadata" and "taskpoint.dcp.json" in names
    assert {n.split("_")[2] for n in names if n.endswith(".distcp")} == {"0", "1", "2", "3"}  # every rank's files


@pytest.mark.slow
def test_a_rank_killed_mid_upload_commits_nothing_and_the_previous_checkpoint_loads(s3_store: Any) -> None:
    options = s3_store.storage_options
    previous, failing = s3_store.url("previous"), s3_store.url("killed")
    finish_ranks(start_ranks(4, [["save", previous], ["save_dies", failing]], options),
                 expect={0: 3, 1: 3, 2: -signal.SIGKILL, 3: 3})
    fs = s3_store.fs()
    assert not fs.exists(f"{failing}/.metadata") and not fs.exists(f"{failing}/taskpoint.dcp.json")
    assert isinstance(load_error(failing, options), FileNotFoundError)
    # The previous checkpoint, saved on 4 ranks, loads whole into one process (DCP reshards 4 -> 1).
    expected = worker.build_model(worker.SEED).state_dict()
    target = {"model": {k: torch.zeros_like(v) for k, v in expected.items()}, "extra": {"step": 0, "note": ""}}
    dcp.load(target, storage_reader=tp_torch.Reader(previous, storage_options=options))
    assert all(torch.equal(target["model"][k], v) for k, v in expected.items())
    assert target["extra"] == {"step": 7, "note": "taskpoint"}


# -- one process: damage, misuse, failures -------------------------------------------------------------------


def small_state(seed: int = 0) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(256, 128, generator=generator), "b": torch.randn(300, generator=generator),
            "ids": torch.arange(1000, dtype=torch.int64), "extra": {"step": 3}}


def empty_state() -> dict[str, Any]:
    return {"w": torch.zeros(256, 128), "b": torch.zeros(300), "ids": torch.zeros(1000, dtype=torch.int64),
            "extra": {"step": 0}}


def saved(s3_store: Any, name: str) -> tuple[str, dict[str, Any]]:
    uri, state = s3_store.url(name), small_state()
    dcp.save(state, storage_writer=tp_torch.Writer(uri, storage_options=s3_store.storage_options))
    return uri, state


def data_file_holding(fs: Any, uri: str, tensor: Any) -> tuple[str, bytes, int]:
    """The stored file holding ``tensor``'s bytes, its content, and where the tensor's data starts in it."""
    raw = tensor.numpy().tobytes()
    for path in fs.ls(uri, detail=False, refresh=True):
        if path.endswith(".distcp"):
            content = fs.cat_file(path)
            at = content.find(raw[:256])
            if at >= 0:
                return path, content, at
    raise AssertionError("no data file holds the tensor")


def load_error(uri: str, options: dict[str, Any]) -> BaseException:
    with pytest.raises(dcp_api.CheckpointException) as caught:
        dcp.load(empty_state(), storage_reader=tp_torch.Reader(uri, storage_options=options))
    (error,) = failures(caught.value)
    return error


def test_flipped_byte_raises_corrupt_naming_the_file_while_dcps_fsspec_reader_loads_wrong_data(
        s3_store: Any) -> None:
    uri, state = saved(s3_store, "flip")
    fs = s3_store.fs()
    path, content, at = data_file_holding(fs, uri, state["w"])
    damaged = bytearray(content)
    damaged[at + 1001] ^= 0x10
    fs.pipe_file(path, bytes(damaged))

    error = load_error(uri, s3_store.storage_options)
    assert isinstance(error, CheckpointCorruptError)
    assert path.rsplit("/", 1)[-1] in str(error) and "blake3" in str(error)

    # DCP's own fsspec reader: no error, and a tensor that is not the one saved.
    target = empty_state()
    dcp.load(target, storage_reader=fsspec_dcp.FsspecReader(uri, **s3_store.storage_options))
    assert not torch.equal(target["w"], state["w"])
    assert torch.equal(target["b"], state["b"])  # the rest loads: the damage goes unnoticed


def test_truncated_and_missing_files_are_corrupt_naming_them(s3_store: Any) -> None:
    uri, state = saved(s3_store, "trunc")
    fs = s3_store.fs()
    path, content, _ = data_file_holding(fs, uri, state["w"])
    fs.pipe_file(path, content[:-100])
    error = load_error(uri, s3_store.storage_options)
    assert isinstance(error, CheckpointCorruptError) and path.rsplit("/", 1)[-1] in str(error)
    assert "truncated" in str(error)

    fs.rm_file(path)
    error = load_error(uri, s3_store.storage_options)
    assert isinstance(error, CheckpointCorruptError) and "is missing" in str(error)
    assert path.rsplit("/", 1)[-1] in str(error)


def test_damaged_metadata_or_manifest_is_corrupt(s3_store: Any) -> None:
    uri, _ = saved(s3_store, "meta")
    fs = s3_store.fs()
    metadata = fs.cat_file(f"{uri}/.metadata")
    fs.pipe_file(f"{uri}/.metadata", metadata[:-1] + bytes([metadata[-1] ^ 1]))
    error = load_error(uri, s3_store.storage_options)
    assert isinstance(error, CheckpointCorruptError) and ".metadata" in str(error)

    fs.pipe_file(f"{uri}/.metadata", metadata)
    manifest = fs.cat_file(f"{uri}/taskpoint.dcp.json")
    fs.pipe_file(f"{uri}/taskpoint.dcp.json", manifest.replace(b'"size": ', b'"size": 1', 1))
    error = load_error(uri, s3_store.storage_options)
    assert isinstance(error, CheckpointCorruptError) and "fails its check" in str(error)

    fs.rm_file(f"{uri}/taskpoint.dcp.json")
    error = load_error(uri, s3_store.storage_options)
    assert isinstance(error, CheckpointCorruptError) and "no taskpoint manifest" in str(error)


def test_no_metadata_is_not_found_and_a_missing_bucket_is_storage_not_found(s3_store: Any) -> None:
    options = s3_store.storage_options
    error = load_error(s3_store.url("never-saved"), options)
    assert isinstance(error, FileNotFoundError) and "no committed checkpoint" in str(error)
    error = load_error("s3://no-such-bucket-taskpoint/x", options)
    assert isinstance(error, StorageNotFound)


def test_wrong_arguments_are_clear_errors(s3_store: Any, tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="checkpoint URI must be a str"):
        tp_torch.Writer(123)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="storage_options must be a dict"):
        tp_torch.Reader(s3_store.url("x"), storage_options="key=1")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="URI is empty"):
        tp_torch.Writer("")
    with pytest.raises(ValueError, match="threads must be a positive int"):
        tp_torch.Reader(str(tmp_path), threads=0)
    with pytest.raises(TypeError, match="retry must be"):
        tp_torch.Writer(str(tmp_path), retry=3)  # type: ignore[arg-type]


def test_a_committed_checkpoint_is_refused_unless_overwrite(tmp_path: Path) -> None:
    uri = str(tmp_path / "ckpt")
    dcp.save(small_state(0), storage_writer=tp_torch.Writer(uri))
    with pytest.raises(dcp_api.CheckpointException) as caught:
        dcp.save(small_state(1), storage_writer=tp_torch.Writer(uri))
    assert isinstance(failures(caught.value)[0], FileExistsError)

    writer = tp_torch.Writer(uri, overwrite=True)
    dcp.save(small_state(1), storage_writer=writer)
    # The manifest lists every stored file but itself, .metadata included, with its true size and BLAKE3 pieces
    # (one per 16 MiB; these files are smaller), and as sha256 the sha256 of the piece digests.
    listed = json.loads((Path(uri) / "taskpoint.dcp.json").read_bytes())["files"]
    pieces = {p.name: [blake3.blake3(p.read_bytes()).hexdigest()] for p in Path(uri).iterdir()}
    stored = {p.name: {"size": p.stat().st_size, "piece_size": 16 << 20, "piece_hash": "blake3",
                       "pieces": pieces[p.name],
                       "sha256": hashlib.sha256(bytes.fromhex(pieces[p.name][0])).hexdigest()}
              for p in Path(uri).iterdir() if p.name != "taskpoint.dcp.json"}
    assert listed == stored and ".metadata" in listed
    assert writer.committed is not None and set(writer.committed.files) == set(stored)
    target = empty_state()
    dcp.load(target, storage_reader=tp_torch.Reader(uri))
    assert torch.equal(target["w"], small_state(1)["w"])
    files = sorted(p.name for p in Path(uri).iterdir())
    assert len({name.split("-")[-1] for name in files if name.endswith(".distcp")}) == 1  # the old save's went


class FailAfter(FaultProxy):
    """Lets the first ``passing`` requests through, then answers every request with a 500."""

    def __init__(self, upstream: str, passing: int) -> None:
        super().__init__(upstream, rate=0.0, kinds=("500",))
        self.passing = passing
        self._seen = 0

    def _decide(self, method: str, path: str) -> str | None:
        self._seen += 1
        self.rate = 0.0 if self._seen <= self.passing else 1.0
        return super()._decide(method, path)


def test_storage_failing_midway_commits_nothing_and_the_previous_checkpoint_loads(s3_server: Any,
                                                                                   s3_store: Any) -> None:
    previous, state = saved(s3_store, "previous")
    failing = s3_store.url("failing")
    with FailAfter(s3_server.endpoint, passing=4) as proxy:
        options = {**copy.deepcopy(s3_store.storage_options), "endpoint_url": proxy.url,
                   "config_kwargs": {"retries": {"total_max_attempts": 1}}}
        quick = RetryPolicy(attempts=2, initial_delay=0.01, max_delay=0.02)
        with pytest.raises(dcp_api.CheckpointException) as caught:
            dcp.save(small_state(5), storage_writer=tp_torch.Writer(failing, storage_options=options,
                                                                           retry=quick, threads=4))
        assert proxy.stats()["passed"] == 4 and proxy.stats()["500"] > 0
    assert any(isinstance(e, StorageUnavailable) for e in failures(caught.value))
    fs = s3_store.fs()
    fs.invalidate_cache()
    landed = fs.ls(failing, detail=False, refresh=True)
    assert landed and all(p.endswith(".distcp") for p in landed)  # midway: some files went up, no commit
    error = load_error(failing, s3_store.storage_options)
    assert isinstance(error, FileNotFoundError)
    target = empty_state()
    dcp.load(target, storage_reader=tp_torch.Reader(previous, storage_options=s3_store.storage_options))
    assert all(torch.equal(target[k], state[k]) for k in ("w", "b", "ids")) and target["extra"] == {"step": 3}


def test_async_save_in_one_process(tmp_path: Path) -> None:
    uri = str(tmp_path / "async")
    state = small_state(2)
    dcp.async_save(state, storage_writer=tp_torch.Writer(uri)).result(timeout=60)
    target = empty_state()
    dcp.load(target, storage_reader=tp_torch.Reader(uri))
    assert torch.equal(target["w"], state["w"]) and target["extra"] == {"step": 3}


def test_import_without_torch_says_which_extra(tmp_path: Path) -> None:
    blocker = tmp_path / "torch"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('No module named torch (blocked for the test)')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", "import taskpoint.torch"], env=env, capture_output=True, text=True)
    assert done.returncode != 0 and 'pip install "taskpoint[torch]"' in done.stderr


def test_every_store_round_trips_and_verifies(store: Any) -> None:
    """local, memory, s3, gcs and azure: a save, a verified load, and a flipped byte caught."""
    uri, state = store.url("ckpt"), small_state(4)
    dcp.save(state, storage_writer=tp_torch.Writer(uri, storage_options=store.storage_options))
    target = empty_state()
    dcp.load(target, storage_reader=tp_torch.Reader(uri, storage_options=store.storage_options))
    assert all(torch.equal(target[k], state[k]) for k in ("w", "b", "ids")) and target["extra"] == {"step": 3}
    fs = store.fs()
    path, content, at = data_file_holding(fs, uri, state["w"])
    fs.pipe_file(path, content[:at] + bytes([content[at] ^ 1]) + content[at + 1:])
    error = load_error(uri, store.storage_options)
    assert isinstance(error, CheckpointCorruptError) and path.rsplit("/", 1)[-1] in str(error)


# -- DCP checkpoints as steps of a CheckpointManager ------------------------------------------------------------


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_dcp_checkpoints_are_manager_steps_with_retention_and_verified_loads(store: Any) -> None:
    """Writer.for_step saves into a step's folder and the manager commits it: steps(), latest_step(), metadata,
    retention (which removes every file of a dropped step) and Reader.for_step all work; restore() says to use
    dcp.load; a step that exists is refused unless overwrite=True; a flipped byte in a step is caught."""
    with taskpoint.CheckpointManager(store.url("m"), storage_options=store.storage_options, keep=2) as mgr:
        states = {step: small_state(step) for step in (1, 2, 3)}
        for step, state in states.items():
            dcp.save(state, storage_writer=tp_torch.Writer.for_step(mgr, step, metadata={"loss": step / 10}))
        assert mgr.steps() == [2, 3] and mgr.latest_step() == 3 and mgr.metadata(3) == {"loss": 0.3}
        fs = store.fs()
        assert not fs.exists(fs._strip_protocol(mgr.step_uri(1)) + "/.metadata")  # retention took its files
        target = empty_state()
        dcp.load(target, storage_reader=tp_torch.Reader.for_step(mgr))  # the newest step
        assert all(torch.equal(target[k], states[3][k]) for k in ("w", "b", "ids"))
        with pytest.raises(taskpoint.CheckpointError, match=r"dcp\.load"):
            mgr.restore(3)
        with pytest.raises(dcp_api.CheckpointException) as caught:
            dcp.save(small_state(9), storage_writer=tp_torch.Writer.for_step(mgr, 3))
        assert isinstance(failures(caught.value)[0], FileExistsError)
        dcp.save(small_state(9), storage_writer=tp_torch.Writer.for_step(mgr, 3, overwrite=True))
        assert mgr.steps() == [2, 3]
        from taskpoint.cli import main

        options = [f"-o{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in store.storage_options.items()]
        assert main(["verify", store.url("m"), *options]) == 0  # every file of every DCP step, by sha256
        path, content, at = data_file_holding(fs, mgr.step_uri(2), states[2]["w"])
        fs.pipe_file(path, content[:at] + bytes([content[at] ^ 1]) + content[at + 1:])
        with pytest.raises(dcp_api.CheckpointException) as caught:
            dcp.load(empty_state(), storage_reader=tp_torch.Reader.for_step(mgr, 2))
        assert isinstance(failures(caught.value)[0], CheckpointCorruptError)
        assert main(["verify", store.url("m"), "--step", "2", *options]) == 2  # damaged, naming the file


def test_a_dcp_step_that_never_committed_is_not_listed_and_gc_removes_its_files(tmp_path: Path) -> None:
    from taskpoint.torch import _writer

    with taskpoint.CheckpointManager(tmp_path / "m", grace_seconds=0) as mgr:
        dcp.save(small_state(1), storage_writer=tp_torch.Writer.for_step(mgr, 1))

        class DiesBeforeCommit(_writer._StepWriter):
            def commit(self, manifest: Any, metadata_blob: bytes) -> None:
                raise OSError("the coordinator died before the commit")

        with pytest.raises(dcp_api.CheckpointException):
            dcp.save(small_state(2), storage_writer=DiesBeforeCommit(mgr, 2, None, overwrite=False, threads=2))
        folder = tmp_path / "m" / "ckpt-2"
        assert any(name.endswith(".distcp") for name in os.listdir(folder))
        assert mgr.steps() == [1]
        removed = mgr.gc()
        assert any(".distcp" in uri for uri in removed)
        assert not folder.exists() or not any(name.endswith(".distcp") for name in os.listdir(folder))
        target = empty_state()
        dcp.load(target, storage_reader=tp_torch.Reader.for_step(mgr))
        assert torch.equal(target["w"], small_state(1)["w"])
