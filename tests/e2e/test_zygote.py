"""The fork server of the framework workers (tests/_zygote.py) gives each run what a process of its own has: its
exit status (a signal's as ``-signal``), its output, its environment and working directory, the interpreter's
own shutdown, fresh numpy random numbers, and a pid the test signals."""

from __future__ import annotations

import os
import signal
import textwrap
from pathlib import Path

import pytest

from _zygote import Forked, spawn
from helpers import wait_until

#: What the server imports ahead in these tests: cheap, and numpy for its generator.
MODULES = ("json", "numpy.random")


def run(tmp_path: Path, body: str, env: dict[str, str] | None = None) -> Forked:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(body))
    return spawn(MODULES, [str(script), "an argument"], {**os.environ, **(env or {})})


def test_a_child_ends_with_its_status_and_output_after_its_atexit_handlers(tmp_path: Path) -> None:
    child = run(tmp_path, """
        import atexit, os, sys
        atexit.register(lambda: print("atexit ran", flush=True))
        print(sys.argv, __name__, os.environ["ZYGOTE_TEST"], os.getcwd(), flush=True)
        print("to stderr", file=sys.stderr, flush=True)
        sys.exit(7)
    """, env={"ZYGOTE_TEST": "the variable"})
    output, _ = child.communicate(timeout=120)
    assert child.returncode == 7
    assert f"['{tmp_path / 'script.py'}', 'an argument'] __main__ the variable {os.getcwd()}" in output
    assert "to stderr" in output and output.rstrip().endswith("atexit ran")


def test_an_exception_ends_the_child_with_status_1_and_its_traceback(tmp_path: Path) -> None:
    child = run(tmp_path, "raise ValueError('the reason')\n")
    output, _ = child.communicate(timeout=120)
    assert child.returncode == 1 and "ValueError: the reason" in output


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_signal_from_the_test_ends_the_child_with_minus_that_signal(tmp_path: Path, sig: signal.Signals) -> None:
    child = run(tmp_path, "import time\nprint('running', flush=True)\ntime.sleep(600)\n")
    assert child.stdout.readline() == b"running\n"
    assert child.poll() is None
    os.kill(child.pid, sig)
    assert child.wait(120) == -sig
    child.stdout.close()


def test_each_child_draws_its_own_numpy_random_numbers(tmp_path: Path) -> None:
    draws = []
    for _ in range(2):
        child = run(tmp_path, "import numpy\nprint(numpy.random.random())\n")
        output, _ = child.communicate(timeout=120)
        assert child.returncode == 0, output
        draws.append(output)
    assert draws[0] != draws[1]


def test_a_child_is_the_servers_not_the_tests(tmp_path: Path) -> None:
    child = run(tmp_path, "import os\nprint(os.getppid(), flush=True)\nimport time\ntime.sleep(600)\n")
    parent = int(child.stdout.readline())
    assert parent != os.getpid() and Path(f"/proc/{parent}/cmdline").read_bytes().split(b"\0")[1].endswith(
        b"_zygote.py")
    child.kill()
    assert child.wait(120) == -signal.SIGKILL
    assert wait_until(lambda: not Path(f"/proc/{child.pid}").exists())  # reaped by the server, no zombie
    child.stdout.close()
