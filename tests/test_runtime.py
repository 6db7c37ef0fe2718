"""@taskpoint.task, ctx(), attempt lineage, reruns after a kill, and processes launched by `taskpoint run`."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import anyio
import pytest

import _zygote as zygote
import taskpoint
from taskpoint import ctx, task


def _attempt_dirs(root: Path, run: str, action: str) -> list[str]:
    return sorted(os.listdir(root / run / action), key=lambda n: (not n.isdigit(), int(n) if n.isdigit() else n))


def test_ctx_is_none_outside_a_task(monkeypatch):
    for name in ("TASKPOINT_ROOT", "TASKPOINT_RUN_NAME", "TASKPOINT_CHECKPOINT_PATH"):
        monkeypatch.delenv(name, raising=False)
    assert ctx() is None


def test_each_attempt_gets_a_fresh_context_and_resumes_from_the_last_save(tmp_path):
    seen = []

    @task(retries=3, root=str(tmp_path), run_name="r1")
    def train(steps: int) -> int:
        c = ctx()
        assert c is not None and c.checkpoint is not None
        prev = c.checkpoint.load_sync()
        start = int(prev.read_bytes()) if prev else 0
        seen.append((c.attempt, c.max_attempts, start, c.run_name, c.action_name))
        for step in range(start, steps):
            c.checkpoint.save_sync(str(step).encode())
            if c.attempt < 3 and step == 4 * c.attempt:
                raise RuntimeError("preempted")
        return steps

    assert train(10) == 10
    assert seen == [(1, 4, 0, "r1", "train"), (2, 4, 4, "r1", "train"), (3, 4, 8, "r1", "train")]
    assert _attempt_dirs(tmp_path, "r1", "train") == ["1", "2", "3"]
    assert (tmp_path / "r1" / "train" / "2" / "checkpoint").read_bytes() == b"8"


def test_last_failure_propagates_the_original_exception_naming_the_attempt(tmp_path):
    class Boom(Exception):
        pass

    calls = []

    @task(retries=2, root=str(tmp_path))
    def always_fails() -> None:
        calls.append(ctx().attempt)
        raise Boom("no luck")

    with pytest.raises(Boom, match="no luck") as info:
        always_fails()
    assert calls == [1, 2, 3]
    assert any("attempt 3 of 3" in note for note in info.value.__notes__)


def test_exception_outside_retry_on_is_not_retried(tmp_path):
    calls = []

    @task(retries=5, retry_on=(ConnectionError,), root=str(tmp_path))
    def fails_with_value_error() -> None:
        calls.append(1)
        raise ValueError("a bug, not a flake")

    with pytest.raises(ValueError):
        fails_with_value_error()
    assert calls == [1]


def test_attempt_that_died_before_saving_does_not_lose_earlier_progress(tmp_path):
    sources = []

    @task(retries=3, root=str(tmp_path), run_name="lineage")
    def work() -> str:
        c = ctx()
        sources.append(c.checkpoint.remote_source)
        if c.attempt == 1:
            c.checkpoint.save_sync(b"progress of attempt 1")
            raise RuntimeError("after saving")
        if c.attempt == 2:
            raise RuntimeError("before its first save")
        return c.checkpoint.load_sync().read_bytes().decode()

    assert work() == "progress of attempt 1"
    assert sources[0] is None
    assert sources[1].endswith("/lineage/work/1/checkpoint")
    assert sources[2].endswith("/lineage/work/1/checkpoint")  # not attempt 2, which holds nothing


def test_new_run_and_other_action_never_resume_from_another(tmp_path):
    @task(retries=0, root=str(tmp_path))
    def first() -> None:
        ctx().checkpoint.save_sync(b"first's state")

    @task(retries=0, root=str(tmp_path))
    def second() -> str | None:
        return ctx().checkpoint.remote_source

    first()
    assert second() is None

    @task(retries=0, root=str(tmp_path))
    def again() -> str | None:
        c = ctx()
        src = c.checkpoint.remote_source
        c.checkpoint.save_sync(b"x")
        return src

    assert again() is None
    assert again() is None  # a second call without run_name is a new run


def test_async_task_on_asyncio_and_trio(tmp_path):
    @task(retries=2, root=str(tmp_path))
    async def job() -> bytes:
        c = ctx()
        prev = await c.checkpoint.load()
        if c.attempt == 1:
            await c.checkpoint.save(b"async state")
            raise RuntimeError("retry me")
        return prev.read_bytes()

    assert asyncio.run(job()) == b"async state"
    assert anyio.run(job, backend="trio") == b"async state"


def test_context_reaches_threads_and_child_tasks(tmp_path):
    @task(retries=0, root=str(tmp_path))
    def outer() -> dict[str, str]:
        me = ctx()
        got: dict[str, str] = {}

        def look(name: str) -> None:
            c = ctx()
            got[name] = c.action_name if c is me else "wrong"

        t = threading.Thread(target=look, args=("thread",))
        t.start()
        t.join()
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            pool.submit(look, "pool").result()

        async def main() -> None:
            await asyncio.gather(asyncio.to_thread(look, "to_thread"), asyncio.create_task(_alook(look)))

        asyncio.run(main())

        async def trio_main() -> None:
            async with anyio.create_task_group() as tg:
                tg.start_soon(_alook, look, "trio")

        anyio.run(trio_main, backend="trio")
        return got

    assert outer() == {k: "outer" for k in ("thread", "pool", "to_thread", "asyncio", "trio")}


async def _alook(look, name: str = "asyncio") -> None:
    look(name)


def test_nested_task_calls_get_their_own_actions(tmp_path):
    @task(retries=0)
    def child() -> tuple[str, str]:
        c = ctx()
        c.checkpoint.save_sync(b"child")
        return c.run_name, c.action_name

    @task(retries=0, root=str(tmp_path), run_name="nest")
    def parent() -> list[tuple[str, str]]:
        results = [child(), child()]
        assert ctx().action_name == "parent"
        return results

    assert parent() == [("nest", "parent.child"), ("nest", "parent.child-2")]
    assert (tmp_path / "nest" / "parent.child-2" / "1" / "checkpoint").read_bytes() == b"child"


def test_remote_root_layout(store):
    @task(retries=1, root=store.base, run_name="remote", storage_options=store.storage_options)
    def job() -> int:
        c = ctx()
        if c.attempt == 1:
            c.checkpoint.save_sync(b"one")
            raise RuntimeError("again")
        return int(c.checkpoint.load_sync().read_bytes() == b"one") + c.attempt

    assert job() == 3
    fs = store.fs()
    fs.invalidate_cache()
    listing = fs.ls(fs._strip_protocol(store.url("remote", "job")), detail=False)
    assert sorted(p.rsplit("/", 1)[-1] for p in listing) == ["1", "2"]
    assert fs.cat_file(fs._strip_protocol(store.url("remote", "job", "1", "checkpoint"))) == b"one"


@pytest.mark.parametrize("kwargs, error", [({"retries": -1}, ValueError), ({"retries": "3"}, ValueError),
                                           ({"retry_on": (int,)}, TypeError), ({"name": "  "}, ValueError)])
def test_bad_decorator_arguments_raise_clear_errors(kwargs, error):
    with pytest.raises(error):
        task(**kwargs)(lambda: None)


def test_decorating_a_non_callable_raises_type_error():
    with pytest.raises(TypeError, match="decorates functions"):
        task(retries=1)(42)


# -- a process killed and started again with the same run name ----------------------------------------------

_KILLABLE = textwrap.dedent(
    """
    import os, sys, taskpoint
    @taskpoint.task(retries=1)
    def count_to(n):
        c = taskpoint.ctx()
        prev = c.checkpoint.load_sync()
        start = int(prev.read_bytes()) if prev else 0
        print(f"attempt={c.attempt} start={start}", flush=True)
        for i in range(start, n):
            c.checkpoint.save_sync(str(i + 1).encode())
            if os.environ.get("KILL_AT") == str(i + 1):
                print("saved", i + 1, flush=True)
                os.kill(os.getpid(), 9)
        return n
    print("result", count_to(int(sys.argv[1])), flush=True)
    """
)


@pytest.mark.e2e("starts a python process")
def test_rerun_after_sigkill_continues_numbering_and_resumes(tmp_path):
    env = {**os.environ, "TASKPOINT_ROOT": str(tmp_path), "TASKPOINT_RUN_NAME": "killed-run"}
    first = subprocess.run([sys.executable, "-c", _KILLABLE, "20"], env={**env, "KILL_AT": "7"},
                           capture_output=True, text=True)
    assert first.returncode == -signal.SIGKILL
    assert "attempt=1 start=0" in first.stdout
    second = subprocess.run([sys.executable, "-c", _KILLABLE, "20"], env=env, capture_output=True, text=True)
    assert second.returncode == 0, second.stderr
    assert "attempt=2 start=7" in second.stdout
    assert "result 20" in second.stdout
    assert _attempt_dirs(tmp_path, "killed-run", "count_to") == ["1", "2"]


def test_rerun_gets_its_own_retry_budget(tmp_path, monkeypatch):
    monkeypatch.setenv("TASKPOINT_RUN_NAME", "budget")
    attempts = []

    @task(retries=1, root=str(tmp_path))
    def flaky() -> None:
        attempts.append(ctx().attempt)
        raise RuntimeError("down")

    with pytest.raises(RuntimeError):
        flaky()
    with pytest.raises(RuntimeError):
        flaky()  # the same run again: numbering continues, with two attempts of its own
    assert attempts == [1, 2, 3, 4]


# -- orchestrator-launched processes --------------------------------------------------------------------------

_CHILD = textwrap.dedent(
    """
    import json, taskpoint
    c = taskpoint.ctx()
    prev = c.checkpoint.load_sync()
    c.checkpoint.save_sync(b"saved by attempt %d" % c.attempt)
    print(json.dumps({"attempt": c.attempt, "run": c.run_name, "action": c.action_name,
                      "src": c.checkpoint.remote_source, "dest": c.checkpoint.remote_destination,
                      "prev": prev.read_text() if prev else None}))
    """
)


def _taskpoint_run(args: list[str], env: dict[str, str] | None = None) -> dict:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TASKPOINT_", "TORCHELASTIC", "SLURM_",
                                                                      "FLYTE_"))}
    out = zygote.run(zygote.STORES, ["-m", "taskpoint.cli", "run", *args, "--", sys.executable, "-c", _CHILD],
                     {**base, **(env or {})}, os.getcwd(), timeout=120)  # the CLI forked (tests/_zygote.py)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.e2e("runs the CLI as a process")
def test_taskpoint_run_passes_flyte_style_locations(tmp_path):
    first = _taskpoint_run(["--checkpoint-path", str(tmp_path / "1" / "ckpt")])
    assert first["src"] is None and first["prev"] is None
    second = _taskpoint_run(["--checkpoint-path", str(tmp_path / "2" / "ckpt"),
                             "--prev-checkpoint", f" '{tmp_path / '1' / 'ckpt'}' "])
    assert second["prev"] == "saved by attempt 1"


@pytest.mark.e2e("runs the CLI as a process")
def test_root_mode_takes_attempts_from_storage_and_restart_counters(tmp_path):
    args = ["--root", str(tmp_path), "--run-name", "job7", "--action-name", "train"]
    a1 = _taskpoint_run(args)
    a2 = _taskpoint_run(args)
    assert (a1["attempt"], a2["attempt"]) == (1, 2)
    assert a2["prev"] == "saved by attempt 1"
    a5 = _taskpoint_run(args, env={"TORCHELASTIC_RESTART_COUNT": "4"})
    assert a5["attempt"] == 5 and a5["prev"] == "saved by attempt 2"
    a9 = _taskpoint_run([*args, "--attempt", "9"], env={"SLURM_RESTART_COUNT": "1"})
    assert a9["attempt"] == 9 and a9["src"].endswith("/job7/train/5/checkpoint")
    assert _taskpoint_run(args, env={"SLURM_RESTART_COUNT": "9"})["attempt"] == 10


@pytest.mark.e2e("starts a python process")
def test_environment_variables_work_without_taskpoint_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    env.update(TASKPOINT_ROOT=str(tmp_path), TASKPOINT_RUN_NAME="plain", TASKPOINT_ACTION_NAME="step",
               TASKPOINT_ATTEMPT="1")
    out = subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["dest"].endswith("/plain/step/1/checkpoint")


def test_root_and_run_name_alone_do_not_make_a_context(monkeypatch, tmp_path):
    """Those two are how a decorated task's rerun is named; only an action name makes it an orchestrated process."""
    monkeypatch.setenv("TASKPOINT_ROOT", str(tmp_path))
    monkeypatch.setenv("TASKPOINT_RUN_NAME", "r")
    monkeypatch.delenv("TASKPOINT_ACTION_NAME", raising=False)
    monkeypatch.delenv("TASKPOINT_CHECKPOINT_PATH", raising=False)
    assert ctx() is None
    assert not any(tmp_path.iterdir())


@pytest.mark.e2e("runs the CLI as a process")
def test_taskpoint_run_without_locations_or_command_is_a_usage_error(tmp_path):
    for args in (["run", "--", "true"], ["run", "--checkpoint-path", str(tmp_path)], ["run", "--prev-checkpoint", "x",
                                                                                       "--", "true"]):
        out = subprocess.run([sys.executable, "-m", "taskpoint.cli", *args], capture_output=True, text=True,
                             env={k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")})
        assert out.returncode == 2 and "taskpoint run" in out.stderr


@pytest.mark.e2e("starts the S3 server")
def test_orchestrator_prev_uri_pointing_at_current_attempt_is_repaired(s3_server, tmp_path):
    location = s3_server.new_location()
    base = location.url("myrun", "train")
    opts = json.dumps(s3_server.storage_options)
    env = {"TASKPOINT_STORAGE_OPTIONS": opts, "TASKPOINT_RUN_NAME": "myrun", "TASKPOINT_ACTION_NAME": "train",
           "FLYTE_ATTEMPT_NUMBER": "1"}
    _taskpoint_run(["--checkpoint-path", f"{base}/1/ckpt"], env={**env, "FLYTE_ATTEMPT_NUMBER": "0"})
    # The executor's bug: the retry is told that its previous checkpoint is its own (attempt 2) folder.
    second = _taskpoint_run(["--checkpoint-path", f"{base}/2/ckpt", "--prev-checkpoint", f"{base}/2/ckpt"],
                            env=env)
    assert second["src"] == f"{base}/1/ckpt"
    assert second["prev"] == "saved by attempt 1"


def test_public_names_are_exported():
    for name in ("task", "ctx", "TaskContext", "latest_checkpoint", "repair_prev_checkpoint_uri", "Checkpoint",
                 "BaseCheckpoint", "CheckpointError", "CheckpointCorruptError", "UnsafeArchiveError",
                 "StorageError"):
        assert hasattr(taskpoint, name), name


def test_checkpoints_manager_is_shared_by_attempts_and_takes_task_options(tmp_path):
    @task(retries=1, root=str(tmp_path), run_name="steps", checkpoints={"keep": 2})
    def train() -> list[int]:
        c = ctx()
        mgr = c.checkpoints
        start = (mgr.latest_step() or 0) + 1
        for step in range(start, start + 3):
            mgr.save(f"state {step}".encode(), step)
        if c.attempt == 1:
            raise RuntimeError("preempted after step 3")
        return mgr.steps()

    assert train() == [5, 6]  # attempt 2 resumed at step 4 from attempt 1's steps; keep=2 pruned the rest


def test_checkpoints_option_of_the_wrong_shape_is_refused():
    with pytest.raises(TypeError, match="checkpoints"):
        task(checkpoints=["keep"])(lambda: None)
    with pytest.raises(ValueError, match="directory"):
        task(checkpoints={"directory": "x"})(lambda: None)
