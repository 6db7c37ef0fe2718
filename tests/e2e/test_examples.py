"""The plain examples run as a user would run them, with failures forced, and end as an uninterrupted run."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

from helpers import wait_until

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _run(script: str, *args: str, cwd: Path, env: dict[str, str] | None = None) -> str:
    base = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    out = subprocess.run([sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env={**base, **(env or {})},
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def test_quickstart_survives_random_failures_on_the_local_default_root(tmp_path):
    out = _run("quickstart.py", "--seed", "7", cwd=tmp_path)
    assert re.findall(r"attempt (\d)/4", out) == ["1", "2", "3"]
    resumed = [int(s) for s in re.findall(r"resumed at step (\d+)", out)]
    assert len(resumed) == 2 and 0 < resumed[0] <= resumed[1]
    assert "result: 328350 (expected 328350) OK" in out
    assert (tmp_path / ".taskpoint").is_dir()
    # The model folder came back byte for byte, with the figures of each load and of the saves.
    assert len(re.findall(r"\(loaded 6\.0 MiB in \d+ ms, \d+ MB/s; weights intact\)", out)) == 2
    assert len(re.findall(r"saves? of 6\.0 MiB, \d+ ms each \(\d+ MB/s\)", out)) == 3
    # Then taskpoint ls shows the run's three attempts, each with its checkpoint, and the last checkpoint.
    [run] = [p for p in (tmp_path / ".taskpoint").iterdir()]
    # ...typed as this shell can run it: `taskpoint` when PATH finds it, else the script's path (issue 27).
    command = re.search(rf"\n\$ (\S+) ls {re.escape(str(run))}\n", out)[1]
    assert command == "taskpoint" or (Path(command).name == "taskpoint" and Path(command).is_file()), command
    assert re.search(r"\n  train  attempts 1\(6\.0 MiB\) 2\(6\.0 MiB\) 3\(6\.0 MiB\)\n", out)
    assert re.search(rf"\n{re.escape(str(run))}/train/3/checkpoint  saved  directory  6\.0 MiB  saved ", out)


def test_quickstart_with_root_from_environment(tmp_path):
    out = _run("quickstart.py", "--seed", "3", cwd=tmp_path, env={"TASKPOINT_ROOT": str(tmp_path / "elsewhere")})
    assert "OK" in out
    assert (tmp_path / "elsewhere").is_dir() and not (tmp_path / ".taskpoint").exists()


def test_generic_example_resumes_at_saved_index_and_matches_uninterrupted_run(tmp_path):
    clean = _run("generic_data_checkpoint.py", "--items", "40", cwd=tmp_path)
    assert re.findall(r"attempt (\d): resumed at item (\d+)", clean) == [("1", "0")]
    failed = _run("generic_data_checkpoint.py", "--items", "40", "--fail-at", "11", "--fail-at", "29", cwd=tmp_path)
    assert re.findall(r"attempt (\d): resumed at item (\d+)", failed) == [("1", "0"), ("2", "11"), ("3", "29")]
    assert clean.splitlines()[-1] == failed.splitlines()[-1]


def _readme_block(section: str) -> str:
    """The first python block of the README's ``section``."""
    text = (EXAMPLES.parent / "README.md").read_text(encoding="utf-8").split(f"\n## {section}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", text, re.DOTALL)[1]


def test_readme_retried_task_killed_and_started_again_with_its_run_name_resumes(tmp_path):
    """Issue 40: the README's retried task, saved as train.py, SIGKILLed after a save and started again as the README
    says (the same TASKPOINT_RUN_NAME) resumes at the step it saved; started without the name it is a new run. The
    example in examples/ (which getting-started includes) is the README's block, word for word."""
    code = _readme_block("In a retried task")
    assert (EXAMPLES / "retried_task.py").read_text(encoding="utf-8") == code
    (tmp_path / "train.py").write_text(code, encoding="utf-8")
    base = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    base["PYTHONPATH"] = str(EXAMPLES.parent / "src")
    named = {**base, "TASKPOINT_RUN_NAME": "job-7"}

    first = subprocess.Popen([sys.executable, "train.py"], cwd=tmp_path, env=named, stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(iter(first.stdout.readline, "")), daemon=True)
    reader.start()
    try:
        assert wait_until(lambda: "saved 100\n" in lines, 120), lines
        first.send_signal(signal.SIGKILL)
    finally:
        first.kill()
        first.wait(timeout=60)
        reader.join(timeout=60)
    assert first.returncode == -signal.SIGKILL and lines[0] == "resuming at 0\n", lines
    saved = [int(line.split()[1]) for line in lines if line.startswith("saved ")]
    assert saved and saved[-1] < 1000, lines

    again = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=named, capture_output=True, text=True,
                           timeout=300)
    assert again.returncode == 0, again.stdout + again.stderr
    resumed = int(re.match(r"resuming at (\d+)\n", again.stdout)[1])
    # The last save printed, or one more that committed just before the kill and had no time to print.
    assert resumed in (saved[-1], saved[-1] + 100), (saved, again.stdout)
    assert again.stdout.endswith("saved 1000\n0.001\n"), again.stdout

    unnamed = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=base, capture_output=True, text=True,
                             timeout=300)
    assert unnamed.returncode == 0 and unnamed.stdout.startswith("resuming at 0\n"), unnamed.stdout + unnamed.stderr
