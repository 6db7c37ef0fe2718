"""The fork server (tests/_zygote.py) runs ``-c CODE`` and ``-m MODULE`` as python itself does: the same
``sys.argv``, ``sys.path``, ``__main__`` and output, and for an uncaught exception the same status and traceback
line, side by side with a real ``python -c`` and ``python -m``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import _zygote as zygote

#: What the server imports ahead here: cheap.
MODULES = ("json",)
#: What the child prints of itself.
SHOW = "import os, sys; print(sys.argv, sys.path, __name__, sorted(globals()), os.getcwd(), sep='\\n')"


def both(argv: list[str], cwd: Path, tmp_path: Path) -> tuple[subprocess.CompletedProcess[str], ...]:
    """``python argv...`` run alone and forked, with a PYTHONPATH other than the server's, in ``cwd``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path / "extra"), *sys.path[1:3]])}
    alone = subprocess.run([sys.executable, *argv], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)
    forked = zygote.run(MODULES, argv, env, cwd=cwd, timeout=120)
    return alone, forked


def test_dash_c_has_the_argv_path_and_main_of_python_dash_c(tmp_path: Path) -> None:
    alone, forked = both(["-c", SHOW, "an argument", "-x"], tmp_path, tmp_path)
    assert alone.returncode == 0 and alone.stdout.startswith("['-c', 'an argument', '-x']\n['', "), alone
    assert (forked.returncode, forked.stdout, forked.stderr) == (alone.returncode, alone.stdout, alone.stderr)


def test_dash_m_has_the_argv_path_and_main_of_python_dash_m(tmp_path: Path) -> None:
    (tmp_path / "shown.py").write_text(SHOW + "\nprint(__spec__.name, __file__)\n")
    alone, forked = both(["-m", "shown", "an argument"], tmp_path, tmp_path)
    assert alone.returncode == 0, alone
    assert alone.stdout.startswith(f"['{tmp_path / 'shown.py'}', 'an argument']\n['{tmp_path}', "), alone.stdout
    assert (forked.returncode, forked.stdout, forked.stderr) == (alone.returncode, alone.stdout, alone.stderr)


def test_an_exception_in_dash_c_ends_with_status_1_and_the_traceback_python_prints(tmp_path: Path) -> None:
    alone, forked = both(["-c", "import sys\nprint('before', flush=True)\nraise ValueError('the reason')"],
                         tmp_path, tmp_path)
    assert alone.returncode == 1 and 'File "<string>", line 3' in alone.stderr, alone
    assert (forked.returncode, forked.stdout, forked.stderr) == (alone.returncode, alone.stdout, alone.stderr)


def test_a_child_of_the_stores_server_reads_fsspecs_configuration_from_its_own_environment(tmp_path: Path) -> None:
    """fsspec reads ``FSSPEC_*`` as it is imported: the server imported it long before, with another environment."""
    code = "import json, fsspec.config; print(json.dumps(fsspec.config.conf, sort_keys=True))"
    env = {**os.environ, "FSSPEC_S3": '{"anon": true}', "FSSPEC_S3_ENDPOINT_URL": "http://127.0.0.1:9",
           "FSSPEC_CONFIG_DIR": str(tmp_path)}
    (tmp_path / "conf.json").write_text('{"gcs": {"project": "from-a-file"}}')
    alone = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    forked = zygote.run(zygote.STORES, ["-c", code], env, cwd=tmp_path, timeout=300)
    assert alone.returncode == 0 and '"endpoint_url": "http://127.0.0.1:9"' in alone.stdout, alone
    assert '"project": "from-a-file"' in alone.stdout, alone
    assert (forked.returncode, forked.stdout, forked.stderr) == (alone.returncode, alone.stdout, alone.stderr)
