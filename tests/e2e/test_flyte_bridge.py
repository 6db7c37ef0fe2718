"""Inside a real Flyte 2 task (flyte 2.12.1, run locally with one retry), ``taskpoint.ctx().checkpoint`` is a
taskpoint Checkpoint on Flyte's own locations: what it saves, Flyte's ``flyte.ctx().checkpoint`` loads on the
retry, and the other way round; a retry's copy is verified against the record beside the destination.

flyte's pins clash with the test environment, so it lives in its own venv (``make test`` builds
``.venv-flyte`` with taskpoint's dependencies); the tasks run there in one subprocess, on this checkout's
``src``, and print what each attempt saw.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# make test passes the venv's python relative to the checkout (.venv-flyte/bin/python); the tasks run elsewhere.
FLYTE_PYTHON = ROOT / os.environ.get("TASKPOINT_FLYTE_PYTHON", ".venv-flyte/bin/python")
SCRIPT = Path(__file__).parents[1] / "compat" / "flyte_bridge_side.py"

if not FLYTE_PYTHON.exists():
    pytest.skip(f"no flyte venv at {FLYTE_PYTHON}; `make test` creates it", allow_module_level=True)


@pytest.fixture(scope="module")
def seen(tmp_path_factory) -> dict:
    raw = tmp_path_factory.mktemp("flyte-raw")
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "HOME": str(raw)}
    env.pop("FLYTE_ATTEMPT_NUMBER", None)
    out = subprocess.run([str(FLYTE_PYTHON), str(SCRIPT), str(raw)], capture_output=True, text=True, timeout=120,
                         env=env, cwd=raw)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    (line,) = [x for x in out.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(line[len("RESULT "):])


def _attempts(seen: dict, name: str) -> tuple[dict, dict]:
    first, retry = seen["results"][name]
    return first, retry


def test_taskpoint_does_not_import_flyte_and_has_no_context_outside_a_task(seen):
    assert seen["before"] == {"context": "None", "flyte_imported": False}
    assert seen["outside"] == {"context": "None"}  # flyte imported and initialised, no task running


def test_the_context_is_on_flytes_own_locations_with_flytes_attempt(seen):
    for name in ("taskpoint_to_flyte", "flyte_to_taskpoint", "taskpoint_to_taskpoint"):
        for attempt in _attempts(seen, name):
            assert attempt["dest"] == attempt["flyte_dest"] and attempt["src"] == attempt["flyte_src"]
            assert (attempt["run_name"], attempt["action_name"]) == (attempt["flyte_run"], attempt["flyte_action"])
            assert attempt["same_context"]  # every ctx() of an attempt is the same context
            assert (attempt["flyte_attempt_number"], attempt["attempt"]) == (0, 1)  # local Flyte reports 0 always
    for attempt in _attempts(seen, "async_taskpoint_to_flyte"):
        assert (attempt["flyte_attempt_number"], attempt["attempt"]) == (2, 3)  # FLYTE_ATTEMPT_NUMBER + 1


def test_a_folder_saved_through_taskpoint_loads_with_flytes_checkpoint_on_the_retry(seen):
    _, retry = _attempts(seen, "taskpoint_to_flyte")
    assert retry["loaded"] == {"step.txt": "t:100", "sub/weights.txt": "w" * 1000}


def test_bytes_saved_through_flytes_checkpoint_load_through_taskpoint_on_the_retry_with_a_warning(seen):
    _, retry = _attempts(seen, "flyte_to_taskpoint")
    assert retry["loaded"] == "t:200"
    (warning,) = retry["warnings"]  # Flyte writes no record: loaded unverified, and said so once
    assert retry["src"] + " has no record" in warning and "loaded unverified" in warning


def test_a_retry_loads_what_taskpoint_saved_verified_across_flytes_copy(seen):
    _, retry = _attempts(seen, "taskpoint_to_taskpoint")
    assert retry["loaded"] == "t:300" and retry["warnings"] == []
    # The same copy with one byte changed no longer matches the destination's record: unverified, and said so.
    assert retry["damaged"] == "t:30X"
    (warning,) = retry["damaged_warnings"]
    assert f"It is a copy of {retry['dest']}, and no record there lists it either" in warning


def test_an_async_task_saves_through_taskpoint_and_flyte_loads_it(seen):
    _, retry = _attempts(seen, "async_taskpoint_to_flyte")
    assert retry["loaded"] == "t:400"
