"""A background save returns without waiting for the save process's acknowledgement (issue 43): with the save
process stopped (SIGSTOP), ``save(blocking=False)`` still returns; the trainer is then SIGKILLed and the save process
resumed, and it reads the request its pipe holds, writes and commits the step, and frees the segment."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from helpers import ORPHAN_EXIT_SLACK, pid_alive, process_gone
from taskpoint import CheckpointManager

torch = pytest.importorskip("torch")
from taskpoint.torch import load_state_dict_sync  # noqa: E402
from test_staged_saves import GRACE_SECONDS, TIMEOUT, _assert_same, _segments, _state  # noqa: E402

_TRAINER = textwrap.dedent("""
    import json, sys
    sys.path[:0] = [sys.argv[3], sys.argv[3] + "/.."]  # test_staged_saves, and the helpers it imports
    from test_staged_saves import _state
    from taskpoint import CheckpointManager
    from taskpoint.torch import StateDict

    m = CheckpointManager(sys.argv[1], storage_options=json.loads(sys.argv[2]), async_save=True, preemption=False)
    m.save(StateDict(_state(1)), 1)
    m.wait_until_finished()  # the save process has written a staged step: warm
    print(m._background.saver.pid, flush=True)
    sys.stdin.readline()  # the test has stopped the save process
    state = _state(2)
    m.save(StateDict(state), 2)
    print("returned", flush=True)
    while True:  # training: the tensors change at once
        state["model"]["weight"].mul_(1.5)
        state["half"].add_(1)
""")


def _line(stream, within: float) -> str:
    """The next line of ``stream``, or "" when none comes within ``within`` seconds."""
    ready, _, _ = select.select([stream], [], [], within)
    return stream.readline() if ready else ""


@pytest.mark.slow
@pytest.mark.parametrize("store", ["local", "s3"], indirect=True)
def test_a_staged_save_returns_while_its_save_process_is_stopped_and_the_step_survives_the_trainer(store):
    uri = store.url("ckpts")
    trainer = subprocess.Popen([sys.executable, "-c", _TRAINER, uri, json.dumps(store.fs_options),
                                str(Path(__file__).parent)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                               text=True, env={**os.environ, "TASKPOINT_GRACE_SECONDS": str(GRACE_SECONDS)})
    helper = None
    try:
        helper = int(_line(trainer.stdout, TIMEOUT) or "0")
        assert helper, "the trainer did not make its first save"
        os.kill(helper, signal.SIGSTOP)
        trainer.stdin.write("save\n")
        trainer.stdin.flush()
        assert _line(trainer.stdout, TIMEOUT) == "returned\n", "save() waited for the stopped save process"
        trainer.kill()
        assert trainer.wait(TIMEOUT) == -signal.SIGKILL
        assert _segments(helper), "the segment is the save process's before it has read the request"
    finally:
        trainer.kill()
        trainer.wait(TIMEOUT)
        if helper:
            os.kill(helper, signal.SIGCONT)
    # resumed with its parent dead: its watchdog waits for the request in the pipe, which it serves and commits
    assert process_gone(helper, GRACE_SECONDS + ORPHAN_EXIT_SLACK), "the save process outlived its grace"
    with CheckpointManager(uri, storage_options=store.storage_options) as m:
        assert m.latest_step() == 2
        _assert_same(load_state_dict_sync(m, 2, mmap=True), _state(2))
        assert m.describe(2).kind == "torch.state_dict"
    assert _segments(trainer.pid, helper) == []
    assert not pid_alive(helper)
