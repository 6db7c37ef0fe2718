"""Runs inside a venv with the real ``flyte`` package: Flyte 2 tasks that checkpoint through
``taskpoint.ctx().checkpoint`` and through ``flyte.ctx().checkpoint``, run locally with one retry.

Usage: python flyte_bridge_side.py RAW_DATA_DIR  -> prints "RESULT " and one JSON object: what each scenario
saw (Flyte's own log lines go to stdout too)

Each scenario's task saves in its first attempt and raises; Flyte retries it locally (copying the checkpoint
object to the retry's source) and the second attempt loads. What the attempts saw is collected in-process
(local Flyte runs tasks in this process) and printed for tests/e2e/test_flyte_bridge.py to assert.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import sys

import taskpoint

# taskpoint must not import flyte, nor find a context, before the program imports flyte.
before = {"context": repr(taskpoint.ctx()), "flyte_imported": "flyte" in sys.modules}

import flyte  # noqa: E402

RESULTS: dict[str, list[dict[str, object]]] = {}
WARNINGS: list[str] = []


class _Collect(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        WARNINGS.append(record.getMessage())


logging.getLogger("taskpoint").addHandler(_Collect(level=logging.WARNING))

env = flyte.TaskEnvironment(name="bridge")


def _tree(root: pathlib.Path) -> dict[str, str]:
    return {str(p.relative_to(root)): p.read_text() for p in sorted(root.rglob("*")) if p.is_file()}


def _seen(name: str, **extra: object) -> dict[str, object]:
    """What this attempt saw of both contexts."""
    ours, theirs = taskpoint.ctx(), flyte.ctx()
    assert ours is not None and ours.checkpoint is not None
    entry: dict[str, object] = {
        "attempt": ours.attempt, "flyte_attempt_number": theirs.attempt_number,
        "run_name": ours.run_name, "action_name": ours.action_name,
        "flyte_action": theirs.action.name, "flyte_run": theirs.action.run_name,
        "dest": ours.checkpoint.remote_destination, "src": ours.checkpoint.remote_source,
        "flyte_dest": theirs.checkpoint.remote_destination, "flyte_src": theirs.checkpoint.remote_source,
        "same_context": taskpoint.ctx() is ours, **extra}
    RESULTS.setdefault(name, []).append(entry)
    return entry


@env.task(retries=1)
def taskpoint_to_flyte(tag: str) -> str:
    """Saves a folder through taskpoint.ctx(); the retry loads it with flyte.ctx().checkpoint."""
    if not RESULTS.get("taskpoint_to_flyte"):
        _seen("taskpoint_to_flyte")
        work = taskpoint.ctx().checkpoint.path / "state"
        (work / "sub").mkdir(parents=True)
        (work / "step.txt").write_text(f"{tag}:100")
        (work / "sub" / "weights.txt").write_text("w" * 1000)
        taskpoint.ctx().checkpoint.save_sync(work)
        raise RuntimeError("preempted after saving")
    loaded = flyte.ctx().checkpoint.load_sync()
    _seen("taskpoint_to_flyte", loaded=_tree(loaded) if loaded is not None else None)
    return "ok"


@env.task(retries=1)
def flyte_to_taskpoint(tag: str) -> str:
    """Saves bytes through flyte.ctx().checkpoint; the retry loads them with taskpoint.ctx()."""
    if not RESULTS.get("flyte_to_taskpoint"):
        _seen("flyte_to_taskpoint")
        flyte.ctx().checkpoint.save_sync(f"{tag}:200".encode())
        raise RuntimeError("preempted after saving")
    del WARNINGS[:]
    loaded = taskpoint.ctx().checkpoint.load_sync()
    _seen("flyte_to_taskpoint", loaded=loaded.read_text() if loaded is not None else None, warnings=list(WARNINGS))
    return "ok"


@env.task(retries=1)
def taskpoint_to_taskpoint(tag: str) -> str:
    """Saves and loads through taskpoint.ctx(): the copy Flyte makes is verified against the destination's
    record, and a damaged copy is not taken for a verified one."""
    if not RESULTS.get("taskpoint_to_taskpoint"):
        _seen("taskpoint_to_taskpoint")
        taskpoint.ctx().checkpoint.save_sync(f"{tag}:300".encode())
        raise RuntimeError("preempted after saving")
    cp = taskpoint.ctx().checkpoint
    del WARNINGS[:]
    loaded = cp.load_sync()
    verified = {"loaded": loaded.read_text() if loaded is not None else None, "warnings": list(WARNINGS)}
    source = pathlib.Path(cp.remote_source)
    source.write_bytes(source.read_bytes()[:-1] + b"X")  # the same size, one byte changed
    del WARNINGS[:]
    with taskpoint.Checkpoint(cp.remote_destination, cp.remote_source, copy_of=cp.remote_destination) as again:
        damaged = again.load_sync()
        _seen("taskpoint_to_taskpoint", **verified, damaged=damaged.read_text() if damaged else None,
              damaged_warnings=list(WARNINGS))
    return "ok"


@env.task(retries=1)
async def async_taskpoint_to_flyte(tag: str) -> str:
    """An async task: await taskpoint.ctx().checkpoint.save(); the retry awaits Flyte's load."""
    if not RESULTS.get("async_taskpoint_to_flyte"):
        _seen("async_taskpoint_to_flyte")
        await taskpoint.ctx().checkpoint.save(f"{tag}:400".encode())
        raise RuntimeError("preempted after saving")
    loaded = await flyte.ctx().checkpoint.load()
    _seen("async_taskpoint_to_flyte", loaded=loaded.read_text() if loaded is not None else None)
    return "ok"


def main() -> None:
    raw = pathlib.Path(sys.argv[1])
    flyte.init()
    outside = {"context": repr(taskpoint.ctx())}
    for task in (taskpoint_to_flyte, flyte_to_taskpoint, taskpoint_to_taskpoint, async_taskpoint_to_flyte):
        name = task.name.split(".")[-1]
        if task is async_taskpoint_to_flyte:
            os.environ["FLYTE_ATTEMPT_NUMBER"] = "2"  # as Flyte's executor sets it on a cluster's third attempt
        flyte.with_runcontext(raw_data_path=str(raw / name), run_base_dir=str(raw / "meta" / name)).run(
            task, "t")
    print("RESULT " + json.dumps({"before": before, "outside": outside, "results": RESULTS, "pid": os.getpid()}))


if __name__ == "__main__":
    main()
