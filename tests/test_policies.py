"""When to save and what to keep: should_save on an injected monotonic clock, keep-best by a metric of the
metadata, and the protected steps that retention (and delete without force) never removes."""

from __future__ import annotations

import datetime
import json
import math
import os
import random
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path
from types import SimpleNamespace

import fsspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import _location_fixture
from helpers import wait_until
from taskpoint import CheckpointError, CheckpointManager, KeepBest, preemption
from taskpoint.manager.schedule import SaveSchedule

#: Hypothesis examples of the random sequences: make test, and the campaign of make reliability.
EXAMPLES, CAMPAIGN_EXAMPLES = 2_000, 20_000


class FakeClock:
    """A monotonic clock that moves only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def manager(directory: str | Path, **options) -> CheckpointManager:
    return CheckpointManager(directory, preemption=False, **options)


# -- arguments ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("args", "error", "words"), [
    (("",), TypeError, "metric"),
    ((7,), TypeError, "metric"),
    (("loss", "lowest"), ValueError, "'min' or 'max'"),
    (("loss", "min", 0), ValueError, "k must be at least 1"),
    (("loss", "min", 1.5), TypeError, "k must be an int"),
    (("loss", "min", None), TypeError, "k must be an int"),
    (("loss", "min", True), TypeError, "k must be an int"),
])
def test_keep_best_refuses_what_it_cannot_mean(args, error, words):
    with pytest.raises(error, match=words):
        KeepBest(*args)


@pytest.mark.parametrize(("options", "error", "words"), [
    ({"keep_best": "val_loss"}, TypeError, "keep_best must be a taskpoint.KeepBest"),
    ({"save_interval": 0}, ValueError, "more than 0 seconds"),
    ({"save_interval": datetime.timedelta(0)}, ValueError, "more than 0 seconds"),
    ({"save_interval": float("nan")}, ValueError, "more than 0 seconds"),
    ({"save_interval": "10m"}, TypeError, "timedelta or a number of seconds"),
    ({"save_interval_steps": 0}, ValueError, "save_interval_steps must be at least 1"),
    ({"save_interval_steps": 2.0}, TypeError, "save_interval_steps must be an int"),
])
def test_the_manager_refuses_policies_it_cannot_mean_before_touching_storage(tmp_path, options, error, words):
    with pytest.raises(error, match=words):
        manager(tmp_path / "ckpts", **options)
    assert not (tmp_path / "ckpts").exists()


# -- should_save -------------------------------------------------------------------------------------------


def test_should_save_every_nth_step_and_never_a_step_already_saved(tmp_path):
    with manager(tmp_path / "ckpts", save_interval_steps=5) as mgr:
        assert [step for step in range(1, 16) if mgr.should_save(step)] == [5, 10, 15]
        assert mgr.should_save(0)  # as Orbax's fixed interval: step 0 is a multiple
        mgr.save(b"ten", 10)
        assert not mgr.should_save(10) and not mgr.should_save(5)  # saved here, or older
        assert mgr.should_save(15)
    with manager(tmp_path / "ckpts", save_interval_steps=5) as resumed:
        resumed.restore()
        assert not resumed.should_save(10)  # the step it resumed from exists
        assert resumed.should_save(15)
    with pytest.raises(TypeError, match="step must be an int"):
        resumed.should_save("15")


@pytest.mark.parametrize("seed", range(5))
def test_each_save_lands_on_the_first_step_at_or_after_its_mark_when_step_times_vary(seed):
    """Steps take 0.2x to 5x the interval, on a fake monotonic clock: the schedule says save on exactly the
    first step whose start is at or after each mark, the mark being one interval after the last save."""
    rng = random.Random(seed)
    clock = FakeClock()
    interval = 60.0
    schedule = SaveSchedule(None, datetime.timedelta(seconds=interval), clock)
    last, saved_at, expected = clock.now, [], []
    for step in range(1, 400):
        if clock.now - last >= interval:  # the rule, computed here on its own
            expected.append(step)
        if schedule.due(step):
            saved_at.append(step)
            schedule.saved(step, clock.now)
            last = clock.now
        clock.now += interval * rng.uniform(0.2, 5.0)
    assert saved_at == expected and len(saved_at) > 50


def test_the_interval_counts_from_the_last_save_and_a_notice_always_says_save(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("taskpoint.manager.schedule.time", SimpleNamespace(monotonic=clock))
    with CheckpointManager(tmp_path / "ckpts", save_interval=30, save_interval_steps=100) as mgr:
        assert not mgr.should_save(1)
        clock.now += 29.9
        assert not mgr.should_save(2)
        clock.now += 0.1
        assert mgr.should_save(3) and mgr.should_save(4)  # due until a save happens
        mgr.save(b"4", 4)
        assert not mgr.should_save(5)
        clock.now += 20
        assert not mgr.should_save(6)
        clock.now += 10
        assert mgr.should_save(7)
        assert mgr.should_save(100)  # the step rule too
        try:
            preemption.notify()
            assert mgr.should_save(8)  # a pending notice: save now
            assert mgr.should_save(4)  # even a step at or before the last save (the emergency step decides)
        finally:
            preemption.clear()
        assert not mgr.should_save(4)


def test_a_failed_save_does_not_move_the_mark(tmp_path, monkeypatch):
    clock = FakeClock()
    monkeypatch.setattr("taskpoint.manager.schedule.time", SimpleNamespace(monotonic=clock))
    with manager(tmp_path / "ckpts", save_interval=30) as mgr:
        clock.now += 31
        with pytest.raises(FileNotFoundError):
            mgr.save(tmp_path / "missing", 1)
        assert mgr.should_save(1)


# -- metadata that keep-best reads -------------------------------------------------------------------------


def test_a_nan_or_infinite_metric_is_saved_and_comes_back_as_passed(tmp_path):
    with manager(tmp_path / "ckpts") as mgr:
        mgr.save(b"x", 1, metadata={"loss": float("nan"), "grad": float("inf"), "best": -float("inf")})
        back = mgr.metadata(1)
        assert math.isnan(back["loss"]) and back["grad"] == float("inf") and back["best"] == -float("inf")


# -- keep-best ---------------------------------------------------------------------------------------------


def test_keep_best_keeps_the_k_best_and_the_newest_and_says_which_is_best(tmp_path):
    losses = [0.9, 0.4, None, float("nan"), 0.4, 0.7, "0.1", True, 0.8]
    with manager(tmp_path / "ckpts", keep_best=KeepBest("val_loss", k=2), grace_seconds=0) as mgr:
        assert mgr.best_step() is None
        for step, loss in enumerate(losses):
            metadata = {} if loss is None else {"val_loss": loss}
            mgr.save(f"state {step}".encode(), step, metadata=metadata)
        # 0.4 at steps 1 and 4: both among the two best (ties: the newer first); NaN, a string, a bool never are
        assert mgr.steps() == [1, 4, 8]  # the two best, and the newest (protected)
        assert mgr.best_step() == 4
        assert repr(mgr).endswith("keep_best=KeepBest(metric='val_loss', mode='min', k=2))")
    with manager(tmp_path / "max", keep_best=KeepBest("acc", mode="max"), keep=1, keep_every=3,
                 grace_seconds=0) as mgr:
        for step, acc in enumerate([0.5, 0.9, 0.1, 0.2, 0.3, 0.95, 0.1, 0.2]):
            mgr.save(b"x", step, metadata={"acc": acc})
        assert mgr.steps() == [0, 3, 5, 6, 7]  # best 5, every 3rd, the newest
        assert mgr.best_step() == 5
    with manager(tmp_path / "max", keep=1) as plain:
        assert plain.best_step() is None  # no keep_best, no best


def test_keep_best_reads_the_metrics_of_steps_another_manager_saved(tmp_path):
    with manager(tmp_path / "ckpts") as first:
        for step, loss in enumerate([0.3, 0.1, 0.2]):
            first.save(b"x", step, metadata={"loss": loss})
    with manager(tmp_path / "ckpts", keep_best=KeepBest("loss"), grace_seconds=0) as second:
        assert second.best_step() == 1
        second.save(b"x", 3, metadata={"loss": 0.5})
        assert second.steps() == [1, 3]


# -- protected steps ---------------------------------------------------------------------------------------


def test_delete_refuses_the_newest_step_that_verifies_unless_forced(tmp_path):
    with manager(tmp_path / "ckpts") as mgr:
        for step in (1, 2):
            mgr.save(b"x", step)
        with pytest.raises(CheckpointError, match=r"step 2 .* is protected: it is the newest committed step that "
                                                  r"verifies .* Pass force=True"):
            mgr.delete(2)
        assert list(mgr.protected_steps()) == [2]
        mgr.delete(1)
        mgr.delete(2, force=True)
        assert mgr.steps() == []


def test_the_newest_step_whose_manifest_is_damaged_is_not_the_one_protected(tmp_path):
    with manager(tmp_path / "ckpts", keep=1) as mgr:
        mgr.save(b"one", 1)
        mgr.save(b"two", 2)
    (tmp_path / "ckpts" / "ckpt-2" / "taskpoint.json").write_text("{damaged")
    with manager(tmp_path / "ckpts", keep=1) as mgr:
        assert list(mgr.protected_steps()) == []  # step 1 was deleted by keep=1: step 2 is all there is
        mgr.delete(2)  # damaged: not protected
    with manager(tmp_path / "other", keep=2) as mgr:
        for step in (1, 2):
            mgr.save(b"x", step)
    (tmp_path / "other" / "ckpt-2" / "taskpoint.json").write_text("{damaged")
    with manager(tmp_path / "other", keep=1, grace_seconds=0) as mgr:
        assert list(mgr.protected_steps()) == [1]  # the newest that verifies
        with pytest.raises(CheckpointError, match="newest committed step that verifies"):
            mgr.delete(1)


def test_the_step_a_manager_restored_from_stays_until_it_commits_a_newer_one(tmp_path):
    with manager(tmp_path / "ckpts") as mgr:
        for step in (1, 2, 3):
            mgr.save(f"s{step}".encode(), step)
    with manager(tmp_path / "ckpts", keep=1, grace_seconds=0) as mgr:
        assert mgr.restore(1).read_bytes() == b"s1"  # e.g. steps 2 and 3 were bad for the run
        assert mgr.protected_steps() == {
            1: "this manager restored from it and has not committed a newer step since",
            3: "it is the newest committed step that verifies (a run must have a step to resume from)"}
        with pytest.raises(CheckpointError, match=r"step 1 .* protected: this manager restored from it"):
            mgr.delete(1)
        mgr.delete(2)
        mgr.save(b"s4", 4, overwrite=True)  # retention: keep 1, so 1 and 3 go now
        assert mgr.steps() == [4]


@pytest.mark.e2e("starts a python process")
def test_retention_keeps_a_step_another_process_is_restoring(tmp_path):
    """A real process restores step 1 and is held mid-restore (after its lease is written, before it reads; the
    hold is the test's, patched into the child): the lease in the step's folder keeps the step from this
    process's retention and delete, and goes with the restore."""
    root = tmp_path / "ckpts"
    gate, entered = tmp_path / "gate", tmp_path / "entered"
    with manager(root, keep=1, grace_seconds=30) as mgr:
        mgr.save(os.urandom(1 << 20), 1)
    script = textwrap.dedent(f"""
        import os, time
        from taskpoint import CheckpointManager
        from taskpoint.manager import restore

        read = restore.StepReader._read_held

        def held(self, *args, **kwargs):
            open({str(entered)!r}, "w").close()
            while not os.path.exists({str(gate)!r}):
                time.sleep(0.02)
            return read(self, *args, **kwargs)

        restore.StepReader._read_held = held
        with CheckpointManager({str(root)!r}, grace_seconds=30, preemption=False) as m:
            print(len(m.restore(1).read_bytes()), flush=True)
    """)
    reader = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert wait_until(entered.exists, timeout=60)
        assert [p.name for p in (root / "ckpt-1").glob("restore-*.json")]
        with manager(root, keep=1, grace_seconds=30) as mgr:
            mgr.save(b"two", 2)
            assert mgr.steps() == [1, 2]  # retention left step 1: another process is reading it
            assert mgr.protected_steps()[1].startswith("another process is restoring or committing it")
            with pytest.raises(CheckpointError, match="another process is restoring"):
                mgr.delete(1)
            gate.touch()
            assert reader.wait(60) == 0 and reader.stdout.read().strip() == str(1 << 20)
            assert not list((root / "ckpt-1").glob("restore-*.json"))  # its lease is gone with it
            mgr.save(b"three", 3)
            assert mgr.steps() == [3]
    finally:
        gate.touch()
        reader.kill()
        reader.wait()


@pytest.fixture(params=["local", "s3"], ids=["local", "s3"])
def local_or_s3(request: pytest.FixtureRequest):
    """A fresh location on local disk and on the S3 server."""
    yield from _location_fixture(request)


@pytest.mark.parametrize("writer_kind", ["plain", "tiered"])
@pytest.mark.e2e("starts a python process")
def test_retention_and_delete_keep_a_step_another_process_is_overwriting(local_or_s3, tmp_path, writer_kind):
    """A real process overwrites step 1 and is held with its save in flight (before it stores the new payload;
    with a local tier, before its promotion copies it; the hold is the test's, patched into the child): its lease
    in the step's folder keeps the step from this process's retention, and ``delete`` refuses naming the rule;
    the overwrite then commits, and its lease goes."""
    url, options = local_or_s3.url("ckpts"), local_or_s3.storage_options
    gate, entered = tmp_path / "gate", tmp_path / "entered"
    with manager(url, storage_options=options, keep=1, grace_seconds=30) as mgr:
        mgr.save(b"first", 1)
    module, local_dir = {"plain": ("taskpoint.manager.kinds.payload", None),
                         "tiered": ("taskpoint.manager.promotion", str(tmp_path / "writer-local"))}[writer_kind]
    script = textwrap.dedent(f"""
        import json, os, time
        from taskpoint import CheckpointManager
        import {module} as kind

        store = kind.store_payload

        def held(*args, **kwargs):
            open({str(entered)!r}, "w").close()
            end = time.monotonic() + 120
            while not os.path.exists({str(gate)!r}) and time.monotonic() < end:
                time.sleep(0.02)
            return store(*args, **kwargs)

        kind.store_payload = held
        with CheckpointManager({url!r}, storage_options=json.loads({json.dumps(options)!r}), grace_seconds=30,
                               preemption=False, background_process=False, local_dir={local_dir!r}) as m:
            m.save(b"second", 1, overwrite=True)
        print("committed", flush=True)
    """)
    writer = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert wait_until(entered.exists, timeout=60)
        fs, path = fsspec.core.url_to_fs(url, **local_or_s3.fs_options)
        assert [name for name in fs.ls(f"{path}/ckpt-1", detail=False) if "commit-" in name]
        with manager(url, storage_options=options, keep=1, grace_seconds=30) as mgr:
            mgr.save(b"two", 2)
            assert mgr.steps() == [1, 2]  # retention left step 1: another process's save of it is in flight
            assert mgr.protected_steps()[1].startswith("another process is restoring or committing it")
            with pytest.raises(CheckpointError, match=r"step 1 .* protected: another process is restoring or "
                                                      r"committing it"):
                mgr.delete(1)
            gate.touch()
            assert writer.wait(120) == 0 and writer.stdout.read().strip() == "committed"
            assert mgr.restore(1).read_bytes() == b"second"
            fs.invalidate_cache()
            assert not [name for name in fs.ls(f"{path}/ckpt-1", detail=False) if "commit-" in name]
            mgr.save(b"three", 3)
            assert mgr.steps() == [3]
    finally:
        gate.touch()
        writer.kill()
        writer.wait()


# -- random sequences: kept = the union of the rules, protected never deleted, every kept step restores -----


OPS = st.lists(st.one_of(
    st.tuples(st.just("save"), st.one_of(st.none(), st.just(float("nan")),
                                         st.floats(0, 1, allow_nan=False).map(lambda v: round(v, 1))),
              st.one_of(st.none(), st.integers(0, 30))),  # None: the next step; else overwrite an older one
    st.tuples(st.just("restore"), st.integers(0, 30)),
    st.tuples(st.just("delete"), st.integers(0, 30), st.booleans()),
    st.tuples(st.just("reopen")),
), max_size=14)
POLICIES = st.tuples(st.one_of(st.none(), st.integers(1, 4)), st.one_of(st.none(), st.integers(2, 4)),
                     st.one_of(st.none(), st.tuples(st.sampled_from(["min", "max"]), st.integers(1, 3))))


def _kept_by_rules(committed: dict[int, float | None], keep, keep_every, best, protected: set[int]) -> set[int]:
    """What retention keeps, computed here from the rules' words, independently of taskpoint's code."""
    if keep is None and best is None:
        return set(committed)
    steps = sorted(committed)
    kept = set(steps[-keep:]) if keep else set()
    if keep_every:
        kept |= {step for step in steps if step % keep_every == 0}
    if best is not None:
        mode, k = best
        valued = [step for step in steps if committed[step] is not None and not math.isnan(committed[step])]
        valued.sort(key=lambda step: (committed[step] if mode == "min" else -committed[step], -step))
        kept |= set(valued[:k])
    return kept | (protected & set(committed))


def _run_sequence(policy, ops) -> None:
    keep, keep_every, best = policy
    options = {"keep": keep, "keep_every": keep_every, "grace_seconds": 0,
               "keep_best": None if best is None else KeepBest("loss", mode=best[0], k=best[1])}
    url = f"memory://policies-{uuid.uuid4().hex}"
    mgr = manager(url, **options)
    model: dict[int, float | None] = {}  # committed step -> its metric
    restored: int | None = None  # this manager's, until it commits a newer step
    step = 0
    try:
        for op in ops:
            if op[0] == "save":
                if op[2] is None or not model:
                    step = target = max(model, default=step) + 1
                else:
                    target = sorted(model)[op[2] % len(model)]
                metadata = {} if op[1] is None else {"loss": op[1]}
                mgr.save(f"state {target}".encode(), target, metadata=metadata, overwrite=True)
                model[target] = op[1]
                if restored is not None and target > restored:
                    restored = None
                protected = {max(model)} | ({restored} if restored is not None else set())
                assert protected <= set(mgr.steps())
                model = {s: v for s, v in model.items()
                         if s in _kept_by_rules(model, keep, keep_every, best, protected)}
            elif op[0] == "restore" and model:
                target = sorted(model)[op[1] % len(model)]
                assert mgr.restore(target).read_bytes() == f"state {target}".encode()
                restored = target
            elif op[0] == "delete" and model:
                target, force = sorted(model)[op[1] % len(model)], op[2]
                if not force and target in {max(model), restored}:
                    with pytest.raises(CheckpointError, match="is protected"):
                        mgr.delete(target)
                else:
                    mgr.delete(target, force=force)
                    del model[target]
                    restored = None if restored == target else restored
            elif op[0] == "reopen":  # a new attempt: nothing of the old manager's memory carries over
                mgr.close()
                mgr = manager(url, **options)
                restored = None
            assert mgr.steps() == sorted(model)
        for each in model:  # every kept step restores
            assert mgr.restore(each).read_bytes() == f"state {each}".encode()
        if best is not None:
            assert mgr.best_step() == next(iter(sorted(
                (s for s in model if model[s] is not None and not math.isnan(model[s])),
                key=lambda s: (model[s] if best[0] == "min" else -model[s], -s))), None)
    finally:
        mgr.close()
        memory = fsspec.filesystem("memory")
        if memory.exists(url):
            memory.rm(url, recursive=True)


def _sequences(examples: int):
    return settings(max_examples=examples, deadline=None, suppress_health_check=[HealthCheck.too_slow])(
        given(policy=POLICIES, ops=OPS)(_run_sequence))


@pytest.mark.e2e("starts a save process")
@pytest.mark.slow
def test_random_sequences_keep_exactly_the_union_of_the_rules_and_never_a_protected_step():
    """Random save (metrics, NaN and missing among them; new steps and overwrites of older ones), restore,
    delete (forced or not) and reopen, under random keep / keep_every / keep_best: after every operation the
    steps are exactly the union of the rules plus the protected steps, a protected step's delete raises, and
    at the end every kept step restores and best_step() is the rule's."""
    _sequences(EXAMPLES)()


@pytest.mark.campaign(f"{CAMPAIGN_EXAMPLES:,} random sequences (make test: {EXAMPLES:,})")
def test_random_sequences_at_campaign_size():
    _sequences(CAMPAIGN_EXAMPLES)()


# -- the command line --------------------------------------------------------------------------------------


def _taskpoint(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "taskpoint", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.e2e("runs the CLI as a process")
def test_ls_marks_the_protected_steps_and_the_best_and_rm_needs_force_for_a_protected_one(tmp_path):
    root = tmp_path / "ckpts"
    with manager(root) as mgr:
        for step, (loss, acc) in enumerate([(0.5, 0.7), (0.2, 0.9), (0.9, 0.1), (float("nan"), 0.0)]):
            mgr.save(b"x", step, metadata={"val_loss": loss, "acc": acc})
    (root / "ckpt-0" / f"restore-{'a' * 32}.json").write_text("{}")  # another process restoring step 0
    out = _taskpoint("ls", str(root), "--best", "val_loss")
    lines = {line.split()[0]: line for line in out.stdout.splitlines() if line.strip()[:1].isdigit()}
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[1].split()[-1] == "MARK"
    assert lines["0"].endswith("protected: restore lease")
    assert lines["1"].endswith("best (val_loss=0.2)")  # NaN at step 3 is never the best
    assert lines["2"].endswith("  -")
    assert lines["3"].endswith("protected: newest that verifies")
    rows = {row["step"]: row for row in json.loads(_taskpoint("ls", str(root), "--json", "--best", "acc",
                                                              "--mode", "max").stdout)["steps"]}
    assert [step for step, row in rows.items() if row["best"]] == [1]
    assert rows[0]["restore_leases"] == [f"restore-{'a' * 32}.json"] and rows[0]["leftovers"] == []
    assert {step: row["protected"] for step, row in rows.items()} == {
        0: "restore lease", 1: None, 2: None, 3: "newest that verifies"}
    refused = _taskpoint("rm", str(root), "--step", "3")
    assert refused.returncode == 1 and "is protected: it is the newest committed step that verifies" in refused.stderr
    assert _taskpoint("rm", str(root), "--step", "3", "--force").returncode == 0
    with manager(root) as mgr:
        assert mgr.steps() == [0, 1, 2]
