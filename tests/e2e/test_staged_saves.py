"""Background saves of torch state dicts staged in shared memory (issue 43): the step they write, who writes it,
what survives a SIGKILL of the trainer or of the save process, the staging bound, and segments left behind."""

from __future__ import annotations

import json
import logging
import os
import random
import subprocess
import sys
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from _staged_kills import kill_save_process_mid_write, kill_trainer_after_return
from helpers import own_staging_folder, wait_until
from helpers import staged_segments as _segments
from taskpoint import CheckpointManager, workspace
from taskpoint.manager import staging
from taskpoint.workspace import host_tag

torch = pytest.importorskip("torch")
from taskpoint.torch import StateDict, load_state_dict_sync  # noqa: E402

LOCAL_AND_S3 = pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
TIMEOUT = 120
#: Trials of each kill test in make test, one per path: trial 0 kills after a first save, trial 1 after the second
#: (from a warm save process); a third only drew another moment on trial 0's path. make reliability runs the issue's 20.
KILL_TRIALS = 2
CAMPAIGN_TRIALS = 20
#: The save process's grace after its trainer died (it commits within it): generous for a loaded machine.
GRACE_SECONDS = 120


def _state(seed: int, floats: int = 1 << 20) -> dict:
    """A state dict as a model and an optimizer give one: tensors of several dtypes, a view and a tied tensor
    sharing storage, nested numbers and strings."""
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(floats // 1024, 1024, generator=generator)
    return {"model": {"weight": weight, "tied": weight, "rows": weight[2:5],
                      "bias": torch.arange(7, dtype=torch.int64)},
            "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(300, generator=generator)}},
                          "param_groups": [{"lr": 0.1, "params": [0], "name": "all"}]},
            "half": torch.ones(5, dtype=torch.float16), "epoch": seed}


def _assert_same(loaded, expected) -> None:
    if isinstance(expected, torch.Tensor):
        assert isinstance(loaded, torch.Tensor) and loaded.dtype == expected.dtype and torch.equal(loaded, expected)
    elif isinstance(expected, dict):
        assert set(loaded) == set(expected)
        for key in expected:
            _assert_same(loaded[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert type(loaded) is type(expected) and len(loaded) == len(expected)
        for a, b in zip(loaded, expected, strict=True):
            _assert_same(a, b)
    else:
        assert loaded == expected


def _refuse_here(*args, **kwargs):
    raise AssertionError("the state dict was written from the trainer's process")


# -- the step a background save writes --------------------------------------------------------------------------

@LOCAL_AND_S3
@pytest.mark.slow
def test_a_background_state_dict_save_writes_the_step_a_blocking_one_writes_from_the_save_process(
        store, monkeypatch):
    """The save process writes the torch.state_dict step (BLAKE3 pieces), not a payload; the trainer's own writer
    is broken on purpose. The tensors are changed at once after save() returned; the step holds them as they were,
    storage shared as it was, and loads with mmap=True as a blocking step does."""
    monkeypatch.setattr("taskpoint.torch._state_kind.write_state", _refuse_here)
    state, expected = _state(1), _state(1)
    with CheckpointManager(store.url("ckpts"), storage_options=store.storage_options, async_save=True) as m:
        m.save(StateDict(state), 1)
        for tensor in (state["model"]["weight"], state["optimizer"]["state"][0]["exp_avg"], state["half"]):
            tensor.add_(1)  # the segment is the save process's now: this changes nothing saved
        m.wait_until_finished()
        described = m.describe(1)
        assert described.kind == "torch.state_dict" and described.details["piece_hash"] == "blake3"
        for mmap in (True, False):
            loaded = load_state_dict_sync(m, 1, mmap=mmap)
            _assert_same(loaded, expected)
            model = loaded["model"]
            assert model["tied"].untyped_storage().data_ptr() == model["weight"].untyped_storage().data_ptr()
        assert m.verify(1).healthy
        saver = m._background.saver.pid
        ready = m._background.staging.ready  # written, and kept for the next save
        assert ready is not None and _segments(os.getpid(), saver) == [ready.path]
    assert _segments(os.getpid(), saver) == []  # freed at close


def test_a_state_staging_cannot_copy_exactly_is_snapshotted_as_before(tmp_path):
    """A tensor that requires grad (a Parameter given by hand) is not staged; the save is today's payload."""
    state = {"w": torch.nn.Parameter(torch.ones(4)), "n": 1}
    with CheckpointManager(tmp_path / "ckpts") as m:
        m.save(StateDict(state), 1, blocking=False)
        m.wait_until_finished()
        assert m.describe(1).kind == "payload"
        assert torch.equal(load_state_dict_sync(m, 1)["w"], torch.ones(4))


def test_an_async_save_manager_starts_its_save_process_when_it_is_made(tmp_path):
    with CheckpointManager(tmp_path / "ckpts", async_save=True) as m:
        assert wait_until(lambda: m._background.saver is not None)  # no save yet
        assert m._background.saver.alive()
    with CheckpointManager(tmp_path / "other") as m:  # one that saves in the background only when asked
        assert m._background.saver is None


# -- the staging bound ------------------------------------------------------------------------------------------

def test_a_state_larger_than_max_staging_bytes_is_saved_blocking_and_says_so(tmp_path, caplog):
    state = _state(2, floats=1 << 16)
    with caplog.at_level(logging.INFO, logger="taskpoint"), \
            CheckpointManager(tmp_path / "ckpts", max_staging_bytes=1 << 16) as m:
        m.save(StateDict(state), 1, blocking=False)
        assert m.steps() == [1]  # committed before save() returned
        assert m.describe(1).kind == "torch.state_dict"
        _assert_same(load_state_dict_sync(m, 1), _state(2, floats=1 << 16))
    assert any("exceed max_staging_bytes" in record.getMessage() for record in caplog.records)


def test_a_reservation_past_the_bound_waits_for_earlier_segments_to_be_freed_and_logs_the_wait(caplog):
    budget = staging.StagingBudget(100)
    assert budget.reserve(80, 1)
    order: list[str] = []
    waiter = threading.Thread(target=lambda: budget.reserve(50, 2) and order.append("reserved"))
    with caplog.at_level(logging.INFO, logger="taskpoint"):
        waiter.start()
        order.append("released")
        budget.release(80)
        waiter.join(TIMEOUT)
    assert not waiter.is_alive() and order == ["released", "reserved"] and budget.held == 50
    assert not budget.reserve(101, 3) and budget.held == 50  # larger than the bound: refused, nothing held
    with pytest.raises(ValueError, match="max_staging_bytes"):
        staging.StagingBudget(0)


def test_the_default_bound_is_half_the_available_memory():
    available = staging._available_memory()
    assert 0 < staging.default_staging_bytes() <= available * staging.DEFAULT_STAGING_SHARE


def _pss(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as rollup:
        return next(int(line.split()[1]) * 1024 for line in rollup if line.startswith("Pss:"))


#: Consecutive saves of the leak test in make test (the bench's async section runs 100), and the growth of the
#: two processes' PSS allowed between the 5th and the last: far below one state per save (8 MiB each).
LEAK_SAVES = 30
LEAK_ALLOWANCE = 48 << 20


@pytest.mark.slow
@pytest.mark.timeout(900)  # each save waits for the save process at nice +10: minutes in all on a busy machine
def test_consecutive_staged_saves_leave_the_memory_of_both_processes_flat(tmp_path):
    state = {"w": torch.zeros(2 << 20), "n": 0}  # 8 MiB
    with CheckpointManager(tmp_path / "ckpts", async_save=True, keep=2) as m:
        sizes = []
        for step in range(1, LEAK_SAVES + 1):
            state["w"].add_(1)
            state["n"] = step
            m.save(StateDict(state), step)
            m.wait_until_finished()
            if step in (5, LEAK_SAVES):
                sizes.append(_pss(os.getpid()) + _pss(m._background.saver.pid))
        assert sizes[1] - sizes[0] < LEAK_ALLOWANCE, f"PSS grew by {(sizes[1] - sizes[0]) >> 20} MiB"
        saver, ready = m._background.saver.pid, m._background.staging.ready
        assert ready is not None and _segments(os.getpid(), saver) == [ready.path]  # the one ready segment
        assert m._background.staging.budget.held == ready.size
        loaded = load_state_dict_sync(m, mmap=True)
        assert loaded["n"] == LEAK_SAVES and torch.equal(loaded["w"], torch.full((2 << 20,), float(LEAK_SAVES)))
    assert _segments(os.getpid(), saver) == []
    assert m._background.staging.budget.held == 0


# -- segments left behind ---------------------------------------------------------------------------------------

def test_segments_of_dead_owners_are_freed_and_those_of_live_ones_kept(tmp_path):
    with own_staging_folder() as folder:
        _dead_owners_freed_live_ones_kept(tmp_path, folder)


def _dead_owners_freed_live_ones_kept(tmp_path: Path, folder: Path) -> None:
    finished = subprocess.Popen([sys.executable, "-c", "pass"])
    finished.wait(TIMEOUT)  # a pid with no process behind it any more
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    key = uuid.uuid4().hex[:8]
    start = workspace.process_start(sleeper.pid)
    paths = {
        "dead": f"{host_tag()}-{finished.pid}-0-{key}01",
        "alive": f"{host_tag()}-{sleeper.pid}-{start}-{key}02",
        "reused pid": f"{host_tag()}-{sleeper.pid}-{start + 1}-{key}03",  # same pid, another process's start
        "other host": f"00000000-{finished.pid}-0-{key}04",
    }
    made = {what: folder / f"{staging.SEGMENT_PREFIX}{name}" for what, name in paths.items()}
    try:
        for path in made.values():
            path.write_bytes(b"s" * 4096)
        with CheckpointManager(tmp_path / "ckpts", async_save=True) as m:  # its save process's start sweeps
            assert wait_until(lambda: m._background.saver is not None)
        assert not made["dead"].exists() and not made["reused pid"].exists()
        assert made["alive"].exists() and made["other host"].exists()
    finally:
        sleeper.kill()
        sleeper.wait(TIMEOUT)
        for path in made.values():
            path.unlink(missing_ok=True)


# -- SIGKILL of the trainer 0-50 ms after save() returned --------------------------------------------------------

_TRAINER = textwrap.dedent("""
    import json, sys, time
    sys.path[:0] = [sys.argv[4], sys.argv[4] + "/.."]  # this module, and the helpers it imports
    from test_staged_saves import _state
    from taskpoint import CheckpointManager
    from taskpoint.torch import StateDict

    uri, options, step = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    m = CheckpointManager(uri, storage_options=options, async_save=True, preemption=False)
    if step > 1:
        m.save(StateDict(_state(step - 1)), step - 1)
        m.wait_until_finished()
    state = _state(step)
    m.save(StateDict(state), step)
    print(m._background.saver.pid, flush=True)
    while True:  # training: the tensors change at once
        state["model"]["weight"].mul_(1.5)
        state["half"].add_(1)
""")


def _kill_trainer_after_return(store, trial: int) -> None:
    uri = store.url(f"ckpts-{trial}")
    step = 1 + trial % 2  # even trials: a first save; odd: the second, from a warm save process
    delay = random.Random(trial).uniform(0, 0.05)  # the moment of the kill: 0-50 ms after the return
    trainer, helper = kill_trainer_after_return(
        _TRAINER, [uri, json.dumps(store.fs_options), str(step), str(Path(__file__).parent)], GRACE_SECONDS, delay)
    with CheckpointManager(uri, storage_options=store.storage_options) as m:
        assert m.latest_step() == step
        _assert_same(load_state_dict_sync(m, step, mmap=True), _state(step))
        assert m.describe(step).kind == "torch.state_dict"
    assert _segments(trainer, helper) == []


@pytest.mark.slow
@LOCAL_AND_S3
@pytest.mark.parametrize("trial", [pytest.param(n, id=f"trial{n}") for n in range(KILL_TRIALS)])
def test_a_trainer_killed_0_to_50_ms_after_a_staged_save_returned_loses_nothing(store, trial):
    _kill_trainer_after_return(store, trial)


@pytest.mark.slow
@pytest.mark.campaign(f"{CAMPAIGN_TRIALS} trials per store (make test: {KILL_TRIALS})")
@LOCAL_AND_S3
@pytest.mark.parametrize("trial", [pytest.param(n, id=f"trial{n}") for n in range(CAMPAIGN_TRIALS)])
def test_a_trainer_killed_0_to_50_ms_after_a_staged_save_returned_loses_nothing_campaign(store, trial):
    """One trial a test, each under its own timeout: the 20 of one store in one test sat at its 300 s under load."""
    _kill_trainer_after_return(store, trial)


# -- SIGKILL of the save process in the middle of its write ------------------------------------------------------

def _saved(step: int) -> StateDict:
    """What the trainers save as ``step``."""
    return StateDict(_state(step))


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_save_process_killed_in_the_middle_of_its_write_commits_nothing_and_its_segment_is_freed(s3_server):
    """The upload of step 2's file is held by the proxy; the trainer is SIGKILLed, then its save process while it
    writes: step 2 is not committed, step 1 restores, and the next manager's save process frees the segment."""
    uri = f"s3://taskpoint-tests/held-staged-{os.getpid()}-{time.monotonic_ns()}/ckpts"
    kill_save_process_mid_write("test_staged_saves:_saved", s3_server, uri, "state-",
                                lambda m: _assert_same(load_state_dict_sync(m, mmap=True), _state(1)))
