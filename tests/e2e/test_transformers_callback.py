"""taskpoint.transformers with the real Hugging Face Trainer: a tiny GPT-2 built from a config (nothing from the
hub), on local disk and the S3 server.

Each checkpoint the Trainer writes must become its step, with the very files the Trainer wrote; ``resume()``
must bring back the newest step that verifies; a process SIGKILLed at a random moment must resume from its
newest committed step and end with the weights of an uninterrupted run, bit for bit (one CPU thread; the
Trainer restores its RNG states and skips the batches it had trained); a SIGTERM must end the process with
status 143 after committing the step it stopped at. The killed processes run examples/hf_train_resume.py.

The kill-and-resume cycle of issue 40 saves every step and keeps two, so every save sweeps the chunk store; it
SIGKILLs the example, often the moment a sweep's lock appears, and resumes in a fresh process, which must finish
within a bound far below the lease grace (a dead sweeper costs its first save about 10 s) with the same weights.
Every wait on a process has a bound; one that does not end prints its threads' stacks (faulthandler) and fails.
"""

from __future__ import annotations

import importlib.util
import os
import queue
import random
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from _zygote import TRANSFORMERS, spawn

os.environ["HF_HUB_OFFLINE"] = "1"  # before transformers is imported: never a download

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "hf_train_resume.py"
MAX_STEPS, SAVE_STEPS = 10, 2
TIMEOUT = 120


@pytest.fixture(scope="module")
def example() -> Iterator[ModuleType]:
    """examples/hf_train_resume.py as a module: the tests train in-process with the example's own model,
    data and arguments (on one thread, as the example does; the thread count is put back afterwards)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    spec = importlib.util.spec_from_file_location("hf_train_resume", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    threads = torch.get_num_threads()
    yield module
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def reference(example: ModuleType, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The weights after MAX_STEPS uninterrupted steps (no callback)."""
    trainer = example.build_trainer(str(tmp_path_factory.mktemp("reference")), max_steps=MAX_STEPS,
                                    save_steps=SAVE_STEPS, callbacks=[])
    trainer.train()
    assert trainer.state.global_step == MAX_STEPS
    return {k: v.clone() for k, v in trainer.model.state_dict().items()}


def same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    assert "model.safetensors" in names and "trainer_state.json" in names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def same_weights(state: dict[str, Any], reference: dict[str, Any]) -> None:
    import torch

    assert state.keys() == reference.keys()
    for name, tensor in reference.items():
        assert torch.equal(state[name], tensor), name


def manager(store: Any) -> Any:
    import taskpoint

    return taskpoint.CheckpointManager(store.base, storage_options=store.storage_options, preemption=False)


# -- in this process ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_each_trainer_checkpoint_becomes_its_step_with_the_same_files(
        example: ModuleType, store: Any, tmp_path: Path) -> None:
    from taskpoint.transformers import CheckpointCallback, resume

    callback = CheckpointCallback(store.base, storage_options=store.storage_options)
    trainer = example.build_trainer(str(tmp_path / "out"), max_steps=6, save_steps=SAVE_STEPS, callbacks=[callback])
    trainer.train()
    assert callback.manager is None  # on_train_end waited for the last upload and closed the manager
    with manager(store) as mgr:
        assert mgr.steps() == [2, 4, 6]
        assert mgr.metadata(6) == {"global_step": 6, "epoch": trainer.state.epoch, "checkpoint": "checkpoint-6"}

    restored = resume(store.base, tmp_path / "elsewhere", storage_options=store.storage_options)
    assert restored == str(tmp_path / "elsewhere" / "checkpoint-6")
    same_files(Path(restored), tmp_path / "out" / "checkpoint-6")
    assert [p.name for p in (tmp_path / "elsewhere").iterdir()] == ["checkpoint-6"]  # no staging folder left


@pytest.mark.parametrize(("keep", "save_total_limit", "kept"), [(None, 2, [6, 8]), (3, 1, [4, 6, 8]),
                                                                 (None, None, [2, 4, 6, 8])])
def test_keep_follows_save_total_limit_unless_given(
        example: ModuleType, tmp_path: Path, keep: int | None, save_total_limit: int | None, kept: list[int]) -> None:
    import taskpoint
    from taskpoint.transformers import CheckpointCallback

    callback = CheckpointCallback(tmp_path / "steps", keep=keep, blocking=True)
    trainer = example.build_trainer(str(tmp_path / "out"), max_steps=8, save_steps=SAVE_STEPS, callbacks=[callback],
                                    save_total_limit=save_total_limit)
    trainer.train()
    assert taskpoint.CheckpointManager(tmp_path / "steps", preemption=False).steps() == kept


def test_resume_returns_none_when_nothing_was_saved(example: ModuleType, tmp_path: Path) -> None:
    from taskpoint.transformers import resume

    assert resume(tmp_path / "steps", tmp_path / "out") is None


def test_resume_skips_a_step_that_does_not_verify(example: ModuleType, tmp_path: Path) -> None:
    from taskpoint.transformers import CheckpointCallback, resume

    trainer = example.build_trainer(str(tmp_path / "out"), max_steps=4, save_steps=SAVE_STEPS,
                                    callbacks=[CheckpointCallback(tmp_path / "steps")])
    trainer.train()
    manifest = tmp_path / "steps" / "ckpt-4" / "taskpoint.json"
    data = bytearray(manifest.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit: the manifest fails its own check
    manifest.write_bytes(bytes(data))

    restored = resume(tmp_path / "steps", tmp_path / "elsewhere")
    assert restored == str(tmp_path / "elsewhere" / "checkpoint-2")
    same_files(Path(restored), tmp_path / "out" / "checkpoint-2")


# -- real processes, real signals ----------------------------------------------------------------------------


class Example:
    """examples/hf_train_resume.py in a real process (with ``-X faulthandler``; forked from one that imported
    transformers: tests/_zygote.py), its output (stderr too) read by a thread into ``seen``, so that no wait on it
    is unbounded."""

    def __init__(self, store: Any, workdir: Path, *args: str, save_steps: int = SAVE_STEPS) -> None:
        import json

        (workdir / "tmp").mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
        env.update(PYTHONPATH=os.pathsep.join([str(REPO / "src"), env.get("PYTHONPATH", "")]), HF_HUB_OFFLINE="1",
                   TMPDIR=str(workdir / "tmp"))
        command = [str(EXAMPLE), "--directory", store.base, "--output-dir", str(workdir / "out"), "--max-steps",
                   str(MAX_STEPS), "--save-steps", str(save_steps), "--out", str(workdir / "result.json"), *args]
        if store.storage_options:
            command += ["--storage-options", json.dumps(store.storage_options)]
        self.started = time.monotonic()
        self.proc = spawn(TRANSFORMERS, command, env, cwd=workdir, faulthandler=True)
        self.seen: list[str] = []
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader = threading.Thread(target=self._read, daemon=True, name="example-output")
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def output(self) -> str:
        return "".join(self.seen)

    def next_line(self, deadline: float) -> str | None:
        """The next line of output (also kept in ``seen``), None once the output ended; fails past ``deadline``."""
        try:
            line = self._lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            self.dump_and_fail("still running past its bound")
        if line is not None:
            self.seen.append(line)
        return line

    def read_until(self, line: str) -> None:
        """Read the output until a line equal to ``line`` (fails if the output ends first, or after TIMEOUT)."""
        deadline = time.monotonic() + TIMEOUT
        while (out := self.next_line(deadline)) is not None:
            if out.rstrip("\n") == line:
                return
        pytest.fail(f"the example ended (status {self.proc.wait(TIMEOUT)}) before printing {line!r}:\n{self.output()}")

    def finish(self, timeout: float = TIMEOUT) -> int:
        """Wait up to ``timeout`` s for the process to end and read all its output; its status. A process that
        does not end is made to print its threads' stacks (SIGABRT, faulthandler) and the test fails with them."""
        deadline = time.monotonic() + timeout
        while self.next_line(deadline) is not None:
            pass
        return self.proc.wait(timeout=max(1.0, deadline - time.monotonic()))

    def dump_and_fail(self, why: str) -> None:
        self.proc.send_signal(signal.SIGABRT)  # faulthandler prints every thread's stack, then the process ends
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)
        self._reader.join(timeout=30)
        while (line := self._lines.get_nowait() if not self._lines.empty() else None) is not None:
            self.seen.append(line)
        pytest.fail(f"{why}: the example's output and stacks:\n{self.output()}")


def last_step(seen: list[str]) -> int:
    return max(int(line.split()[1]) for line in seen if line.startswith("step "))


def continue_in_process(example: ModuleType, store: Any, tmp_path: Path, expect_step: int) -> Any:
    """``resume()`` into a fresh output folder and train on to MAX_STEPS with the callback; the trainer."""
    from transformers import TrainerCallback

    from taskpoint.transformers import CheckpointCallback, resume

    started: list[int] = []

    class StartStep(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            started.append(state.global_step)

    output = tmp_path / "resumed"
    checkpoint = resume(store.base, output, storage_options=store.storage_options)
    assert checkpoint == str(output / f"checkpoint-{expect_step}")
    trainer = example.build_trainer(str(output), max_steps=MAX_STEPS, save_steps=SAVE_STEPS, callbacks=[
        CheckpointCallback(store.base, storage_options=store.storage_options), StartStep()])
    trainer.train(resume_from_checkpoint=checkpoint)
    assert started == [expect_step]  # the Trainer continued from the restored step, not from 0
    assert trainer.state.global_step == MAX_STEPS
    return trainer


def sigkill_at_random_then_resume(example: ModuleType, reference: dict[str, Any], store: Any, tmp_path: Path,
                                  trial: int) -> None:
    pause = random.Random(trial).uniform(0.0, 1.4)  # about the length of the training at --step-delay 0.1
    killed = Example(store, tmp_path / "killed", "--step-delay", "0.1")
    killed.read_until("training from step 0")
    time.sleep(pause)
    killed.proc.send_signal(signal.SIGKILL)
    status = killed.finish()
    seen = killed.seen
    context = f"trial {trial}: SIGKILL {pause:.2f} s into training, status {status}:\n{''.join(seen)}"

    with manager(store) as mgr:
        steps = mgr.steps()
    print(f"trial {trial}: SIGKILL {pause:.2f} s into training, after step {last_step([*seen, 'step 0'])}; "
          f"committed steps {steps}")
    if not steps:  # killed before the first commit: nothing to resume, a fresh start is right
        assert status == -signal.SIGKILL, context
        from taskpoint.transformers import resume

        assert resume(store.base, tmp_path / "resumed", storage_options=store.storage_options) is None
        return
    newest = steps[-1]
    assert newest % SAVE_STEPS == 0 and newest <= MAX_STEPS, context
    # The newest committed step holds exactly the files the Trainer of the killed process wrote.
    from taskpoint.transformers import resume

    restored = resume(store.base, tmp_path / "check", storage_options=store.storage_options)
    assert restored is not None, context
    same_files(Path(restored), tmp_path / "killed" / "out" / f"checkpoint-{newest}")
    if newest == MAX_STEPS:  # killed after its last commit: the restored weights are the final ones
        from safetensors.torch import load_file

        weights = load_file(Path(restored) / "model.safetensors")  # without lm_head.weight: tied to the embedding
        same_weights(weights, {name: reference[name] for name in weights})
        return
    trainer = continue_in_process(example, store, tmp_path, newest)
    same_weights(trainer.model.state_dict(), reference)
    with manager(store) as mgr:
        assert mgr.latest_step() == MAX_STEPS


# Two trials in make test (pauses 1.18 s and 0.87 s: late, in a background save, and midway), forty in the campaign.
@pytest.mark.parametrize(("store", "trial"), [("local", 0), ("s3", 5)], indirect=["store"])
def test_sigkill_at_a_random_moment_resumes_with_equal_weights_and_step(
        example: ModuleType, reference: dict[str, Any], store: Any, tmp_path: Path, trial: int) -> None:
    sigkill_at_random_then_resume(example, reference, store, tmp_path, trial)


@pytest.mark.campaign("20 more SIGKILLs at random moments")
@pytest.mark.parametrize("trial", range(10, 30))
@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_sigkill_campaign(example: ModuleType, reference: dict[str, Any], store: Any, tmp_path: Path,
                          trial: int) -> None:
    sigkill_at_random_then_resume(example, reference, store, tmp_path, trial)


@pytest.mark.parametrize("store", ["s3"], indirect=True)
def test_sigterm_commits_the_step_it_stopped_at_exits_143_and_the_example_resumes_from_it(
        example: ModuleType, reference: dict[str, Any], store: Any, tmp_path: Path) -> None:
    import json

    # Saves every 3 steps; the SIGTERM lands in the delay after step 4, so the Trainer saves step 5 only
    # because the callback asks it to (a notice that lands before a due save stops at that save).
    first = Example(store, tmp_path / "first", "--step-delay", "0.3", save_steps=3)
    first.read_until("step 4")
    first.proc.send_signal(signal.SIGTERM)
    status = first.finish()
    seen, context = first.seen, first.output()
    assert status == 143, context
    stopped = last_step(seen)  # the step on which the Trainer saved and stopped
    assert stopped == 5, context
    assert not (tmp_path / "first" / "result.json").exists()
    with manager(store) as mgr:
        assert mgr.latest_step() == stopped, context
        assert mgr.metadata(stopped)["global_step"] == stopped
    from taskpoint.transformers import resume

    restored = resume(store.base, tmp_path / "check", storage_options=store.storage_options)
    assert restored is not None
    same_files(Path(restored), tmp_path / "first" / "out" / f"checkpoint-{stopped}")

    second = Example(store, tmp_path / "second", save_steps=3)
    assert second.finish() == 0, second.output()
    seen = second.seen
    assert f"training from step {stopped}\n" in seen, "".join(seen)
    assert last_step(seen) == MAX_STEPS and f"step {stopped}\n" not in seen  # no step trained twice
    result = json.loads((tmp_path / "second" / "result.json").read_text())
    assert result["global_step"] == MAX_STEPS and result["resumed_from"] == f"checkpoint-{stopped}"
    model = example.build_trainer(str(tmp_path / "unused"), max_steps=1, save_steps=1, callbacks=[]).model
    model.load_state_dict(reference)
    assert result["sha256"] == example.weights_sha256(model)
    with manager(store) as mgr:
        assert mgr.latest_step() == MAX_STEPS


# -- the kill-and-resume cycle of issue 40: every step saved, two kept, a SIGKILL that may land in a sweep -------

#: The cycle keeps this many steps (``save_total_limit``): every save from step LIMIT + 1 on deletes a step and
#: sweeps the chunk store, so a SIGKILL can land in the middle of a sweep and leave its ``gc-`` lock behind.
LIMIT = 2
#: The longest the resumed process may take, from its start to its exit: generous on a busy machine, and far
#: below the lease grace (900 s) that a save waited for a dead sweeper before issue 40.
RESUME_BOUND = 300.0
#: How often the test looks at the store for a sweep's lock, in a trial that kills during a sweep (seconds).
LOCK_POLL = 0.002


def sweep_locks(fs: Any, store: Any) -> list[str]:
    """The names of the sweep locks (``leases/gc-*``) in the store now."""
    try:
        names = fs.ls(f"{store.base}/leases", detail=False, refresh=True)
    except FileNotFoundError:
        return []
    return [name.rsplit("/", 1)[-1] for name in names if name.rsplit("/", 1)[-1].startswith("gc-")]


def kill_in_a_sweep(killed: Example, store: Any, after: int) -> str:
    """SIGKILL the example as soon as the store holds a sweep lock, once it printed ``step {after}``; what the
    test did, for the report. Fails when the example ends first (each save from step LIMIT + 1 on sweeps)."""
    import fsspec

    fs, _ = fsspec.core.url_to_fs(store.base, **store.fs_options)
    killed.read_until(f"step {after}")
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline and killed.proc.poll() is None:
        if sweep_locks(fs, store):
            killed.proc.send_signal(signal.SIGKILL)
            return f"killed at the first sweep lock seen after step {after}"
        time.sleep(LOCK_POLL)
    killed.finish()
    pytest.fail(f"the example saved every step up to {MAX_STEPS} and no sweep lock was seen after step {after}:\n"
                f"{killed.output()}")


def kill_and_resume_cycle(example: ModuleType, reference: dict[str, Any], store: Any, tmp_path: Path,
                          trial: int) -> dict[str, Any]:
    """One cycle: the example saves every step (deduplicated, LIMIT kept) and is SIGKILLed at a seeded moment:
    even trials as soon as a sweep's lock appears after a random step, odd ones a random time into training. A
    fresh process then resumes with the example (``resume()``, then the callback) and must end within
    RESUME_BOUND at MAX_STEPS with the weights of the uninterrupted run, having trained no step twice (unless the
    killed run had committed MAX_STEPS: then that step holds those weights); every kept step must restore.
    Returns the trial's figures."""
    import json

    import fsspec

    import taskpoint

    rng = random.Random(trial)
    args = ("--step-delay", "0.1", "--save-total-limit", str(LIMIT), "--log-level", "INFO")
    killed = Example(store, tmp_path / "killed", *args, save_steps=1)
    if trial % 2 == 0:
        how = kill_in_a_sweep(killed, store, rng.randint(LIMIT + 1, MAX_STEPS - 2))
    else:
        pause = rng.uniform(0.0, 2.0)  # about the length of the training, saving every step
        killed.read_until("training from step 0")
        time.sleep(pause)
        killed.proc.send_signal(signal.SIGKILL)
        how = f"killed {pause:.2f} s into training"
    status = killed.finish()
    fs, _ = fsspec.core.url_to_fs(store.base, **store.fs_options)
    left = sweep_locks(fs, store)  # a lock left behind: the SIGKILL landed in the middle of a sweep
    with manager(store) as mgr:
        steps = mgr.steps()
    start = steps[-1] if steps else 0
    context = (f"trial {trial}: {how}, status {status}, sweep locks left {left}, committed steps {steps}:\n"
               f"{killed.output()}")
    assert status in (-signal.SIGKILL, 0), context

    took, waits = None, []
    if start < MAX_STEPS:
        resumed = Example(store, tmp_path / "resumed", *args, save_steps=1)
        resumed_status = resumed.finish(RESUME_BOUND)
        took = time.monotonic() - resumed.started
        context += f"\nthe resumed process (status {resumed_status}, {took:.1f} s):\n{resumed.output()}"
        assert resumed_status == 0, context
        assert f"training from step {start}\n" in resumed.seen, context
        assert start == 0 or f"step {start}\n" not in resumed.seen, context  # no step trained twice
        result = json.loads((tmp_path / "resumed" / "result.json").read_text())
        assert result["global_step"] == MAX_STEPS, context
        model = example.build_trainer(str(tmp_path / "unused"), max_steps=1, save_steps=1, callbacks=[]).model
        model.load_state_dict(reference)
        assert result["sha256"] == example.weights_sha256(model), context
        waits = [float(line.split("after waiting ")[1].split(" s")[0]) for line in resumed.seen
                 if "goes on after waiting" in line]
        if left:  # its first save met the dead sweep's lock: it said so and took it for dead
            assert any("for dead" in line and left[0] in line for line in resumed.seen), context
    # else the run had committed its last step: nothing to resume (the Trainer, resumed at max_steps, would train
    # one step more); the last step's weights are checked below

    with taskpoint.CheckpointManager(store.base, storage_options=store.storage_options, preemption=False) as mgr:
        kept = mgr.steps()
        if start < MAX_STEPS:  # the resumed run saved: its retention left the LIMIT newest
            assert kept == list(range(MAX_STEPS - LIMIT + 1, MAX_STEPS + 1)), context
        assert kept[-1] == MAX_STEPS, context
        for step in kept:  # every kept step restores (each chunk it names is there and verifies)
            folder = mgr.restore(step, into=tmp_path / "kept" / str(step))
            assert json.loads((folder / "trainer_state.json").read_text())["global_step"] == step, context
    last = tmp_path / "kept" / str(MAX_STEPS)
    if start < MAX_STEPS:
        same_files(last, tmp_path / "resumed" / "out" / f"checkpoint-{MAX_STEPS}")
    else:
        from safetensors.torch import load_file

        weights = load_file(last / "model.safetensors")  # without lm_head.weight: tied to the embedding
        same_weights(weights, {name: reference[name] for name in weights})
    figures = {"trial": trial, "store": store.kind, "how": how, "in_sweep": bool(left), "resumed_from": start,
               "resume_seconds": None if took is None else round(took, 1), "sweep_wait": max(waits, default=0.0)}
    print(f"hf cycle: {json.dumps(figures)}")
    return figures


# One trial in make test, on moto, killing the moment a sweep's lock appears (its report says whether the lock was
# left behind: the SIGKILL landed inside the sweep); the same on local disk in make reliability, with the cycle below.
@pytest.mark.parametrize(("store", "trial"), [
    pytest.param("local", 0, marks=pytest.mark.campaign("the HF sweep kill on local disk too (make test: on moto)")),
    ("s3", 2)], indirect=["store"])
def test_sigkill_in_a_sweep_of_a_run_saving_every_step_resumes_in_a_fresh_process(
        example: ModuleType, reference: dict[str, Any], store: Any, tmp_path: Path, trial: int) -> None:
    kill_and_resume_cycle(example, reference, store, tmp_path, trial)


@pytest.mark.campaign("the HF kill-and-resume cycle 20 times in a row (issue 40)")
@pytest.mark.parametrize("trial", range(100, 120))
@pytest.mark.parametrize("store", ["s3", "local"], indirect=True)
def test_kill_and_resume_cycle_campaign(example: ModuleType, reference: dict[str, Any], store: Any, tmp_path: Path,
                                        trial: int) -> None:
    kill_and_resume_cycle(example, reference, store, tmp_path, trial)
