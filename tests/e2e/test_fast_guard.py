"""``make check`` (``pytest --fast``, tests/_fast.py and tests/conftest.py): a fast test that starts a process or
asks for a server fails, naming it, even when it swallows the refusal; what starts nothing passes; the runs on a server
and the tests marked ``e2e`` are left out. Each case runs in a child pytest with the suite's conftest as its plugin."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
#: The bound of the child pytest (it imports the conftest's servers module and fsspec, then runs a few tests).
WITHIN = 300

CASES = textwrap.dedent('''
    import os
    import subprocess
    import sys

    import pytest


    def test_starts_nothing(tmp_path):
        (tmp_path / "x").write_bytes(b"x")


    def test_asks_the_machine_its_processor():
        subprocess.run(["uname", "-p"], check=True, capture_output=True)


    def test_runs_python():
        subprocess.run([sys.executable, "-c", "pass"], check=True)


    def test_swallows_the_refusal():
        try:
            subprocess.run([sys.executable, "-c", "pass"], check=True)
        except Exception:
            pass


    def test_forks():
        pid = os.fork()
        if pid == 0:
            os._exit(0)


    def test_a_pool_of_processes():
        import multiprocessing
        with multiprocessing.get_context("spawn").Pool(1) as pool:
            pool.map(abs, [1])


    def test_asks_for_a_server(s3_server):
        pass


    def test_on_a_store(store):
        assert store.kind in ("local", "memory")


    @pytest.mark.parametrize("kind", ["local", "gcs"])
    def test_of_a_kind(kind):
        pass


    @pytest.mark.e2e
    def test_marked_e2e():
        subprocess.run([sys.executable, "-c", "pass"], check=True)
''')


def _fast_run(tmp_path: Path) -> dict[str, tuple[str, str]]:
    """Run :data:`CASES` under ``pytest --fast``; each test's outcome (passed, failed, error) and message."""
    (tmp_path / "test_cases.py").write_text(CASES, encoding="utf-8")
    report = tmp_path / "report.xml"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), *sys.path])}
    proc = subprocess.run([sys.executable, "-m", "pytest", "--fast", "-p", "conftest", "-p", "no:cacheprovider",
                           "-p", "no:randomly", "-q", f"--junitxml={report}", "test_cases.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=WITHIN)
    assert report.exists(), proc.stdout + proc.stderr
    outcomes: dict[str, tuple[str, str]] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        name = case.get("name", "?")
        problems = [*case.iter("failure"), *case.iter("error")]
        text = " ".join(f"{p.get('message', '')} {p.text or ''}" for p in problems)
        outcome = "error" if any(p.tag == "error" for p in problems) else "failed" if problems else "passed"
        outcomes[name] = (outcome, text)
    return outcomes


def test_a_fast_test_that_starts_a_process_or_asks_for_a_server_fails_naming_it_and_the_rest_pass(tmp_path):
    outcomes = _fast_run(tmp_path)
    assert outcomes.keys() == {"test_starts_nothing", "test_asks_the_machine_its_processor", "test_runs_python",
                               "test_swallows_the_refusal", "test_forks", "test_a_pool_of_processes",
                               "test_asks_for_a_server", "test_on_a_store[local]", "test_on_a_store[memory]",
                               "test_of_a_kind[local]"}, "the runs on a server and the e2e test are left out"
    for name in ("test_starts_nothing", "test_asks_the_machine_its_processor", "test_on_a_store[local]",
                 "test_on_a_store[memory]", "test_of_a_kind[local]"):
        assert outcomes[name][0] == "passed", (name, outcomes[name])
    for name, started in (("test_runs_python", "fork_exec"), ("test_swallows_the_refusal", "fork_exec"),
                          ("test_forks", "os.fork"), ("test_a_pool_of_processes", "fork_exec")):
        outcome, text = outcomes[name]
        assert outcome == "failed", (name, outcomes[name])
        assert started in text and "belongs in tests/e2e/" in text, (name, text)
    outcome, text = outcomes["test_asks_for_a_server"]
    assert outcome == "error" and "s3_server refused" in text, text
