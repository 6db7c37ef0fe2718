"""The fork server of the framework workers (tests/_zygote.py) gives each run what a process of its own has: its
exit status (a signal's as ``-signal``), its output (stderr with it or apart), its environment, path and working
directory, the interpreter's own shutdown, fresh numpy random numbers, and a pid the test signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import _zygote as zygote
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
    assert child.stdout.readline() == "running\n"
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


def test_a_child_has_the_path_and_folder_python_gives_the_script(tmp_path: Path) -> None:
    """``sys.path`` as a new ``python script`` has it (the script's folder, the child's PYTHONPATH, the
    interpreter's), with a PYTHONPATH other than the server's; the working directory asked for."""
    (tmp_path / "elsewhere").mkdir()
    script = tmp_path / "script.py"
    script.write_text("import os, sys\nprint(sys.path, os.getcwd())\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "extra"), *sys.path[1:3]])}
    alone = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path / "elsewhere", capture_output=True,
                           text=True, timeout=120)
    forked = zygote.run(MODULES, [str(script)], env, cwd=tmp_path / "elsewhere", timeout=120)
    assert (forked.returncode, forked.stdout, forked.stderr) == (alone.returncode, alone.stdout, alone.stderr)
    assert alone.returncode == 0 and str(tmp_path / "extra") in alone.stdout


def test_stderr_apart_and_a_run_past_its_bound_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "script.py"
    script.write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\n")
    done = zygote.run(MODULES, [str(script)], dict(os.environ), cwd=tmp_path, timeout=120)
    assert (done.returncode, done.stdout, done.stderr) == (0, "out\n", "err\n")
    script.write_text("import time\ntime.sleep(600)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(MODULES, [str(script)], dict(os.environ), cwd=tmp_path, timeout=1)


def test_a_worker_forks_from_the_shared_server_and_one_that_failed_to_start_is_named(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under pytest-xdist the controlling process's servers (start_shared) serve every worker: the child's parent
    is the server listening in the shared folder. A set whose modules are not installed gets no server; a server
    that failed to import its modules fails the spawn with the import's error, not at the bound."""
    shared = (("json",), ("json", "json.taskpoint_no_such_module"), ("taskpoint_no_such_module",))
    monkeypatch.setattr(zygote, "SHARED", shared)
    monkeypatch.setenv(zygote.SHARED_ENV, "")  # restored after the test (a pytest-xdist worker has the real one)
    servers = zygote.start_shared()
    try:
        folder = os.environ[zygote.SHARED_ENV]
        assert len(servers) == 2
        script = tmp_path / "script.py"
        script.write_text("import os\nprint(os.getppid())\n")
        child = spawn(shared[0], [str(script)], dict(os.environ), apart=True)
        output, _ = child.communicate(timeout=120)
        assert child.returncode == 0, output
        parent = Path(f"/proc/{int(output)}/cmdline").read_bytes().split(b"\0")
        assert parent[1].endswith(b"_zygote.py") and parent[2] == os.path.join(folder, "0.socket").encode()
        with pytest.raises(AssertionError, match=r"No module named 'json\.taskpoint_no_such_module'"):
            spawn(shared[1], [str(script)], dict(os.environ))
    finally:
        zygote.end_shared(servers)
