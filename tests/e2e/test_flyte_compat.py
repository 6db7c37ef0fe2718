"""Checkpoints written by the real flyte package load with taskpoint, and the other way round.

flyte's pins clash with the test environment, so it lives in its own venv (``make test`` builds
``.venv-flyte``); the flyte side runs there as a subprocess over local paths.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from helpers import make_tree
from taskpoint import Checkpoint

ROOT = Path(__file__).resolve().parents[2]
FLYTE_PYTHON = Path(os.environ.get("TASKPOINT_FLYTE_PYTHON", ROOT / ".venv-flyte" / "bin" / "python"))
SCRIPT = Path(__file__).parents[1] / "compat" / "flyte_side.py"

if not FLYTE_PYTHON.exists():
    pytest.skip(f"no flyte venv at {FLYTE_PYTHON}; `make test` creates it", allow_module_level=True)


def _flyte(*args: str) -> str:
    out = subprocess.run([str(FLYTE_PYTHON), str(SCRIPT), *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def _tree_as_flyte_describes(root: Path) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ["link", os.readlink(p)]
            elif p.is_dir():
                out[rel] = ["dir"]
            else:
                out[rel] = ["file", p.read_bytes().hex()]
    return out


def test_bytes_saved_by_flyte_load_in_taskpoint(tmp_path):
    _flyte("save", str(tmp_path / "ckpt"), "bytes", b"from flyte \x00\xff".hex())
    cp = Checkpoint(tmp_path / "next", tmp_path / "ckpt")
    assert cp.load_sync().read_bytes() == b"from flyte \x00\xff"


def test_file_saved_by_flyte_loads_in_taskpoint(tmp_path):
    src = tmp_path / "model.bin"
    src.write_bytes(os.urandom(50_000))
    _flyte("save", str(tmp_path / "ckpt"), "path", str(src))
    cp = Checkpoint(tmp_path / "next", tmp_path / "ckpt")
    assert cp.load_sync().read_bytes() == src.read_bytes()


def test_directory_saved_by_flyte_loads_in_taskpoint(tmp_path):
    src = make_tree(tmp_path / "src")
    _flyte("save", str(tmp_path / "ckpt"), "path", str(src))
    cp = Checkpoint(tmp_path / "next", tmp_path / "ckpt")
    loaded = cp.load_sync()
    assert loaded == cp.path
    assert _tree_as_flyte_describes(loaded) == _tree_as_flyte_describes(src)


def test_bytes_saved_by_taskpoint_load_in_flyte(tmp_path):
    Checkpoint(tmp_path / "ckpt").save_sync(b"from taskpoint")
    got = json.loads(_flyte("load", str(tmp_path / "ckpt")))
    assert got == {"result": "payload", "name": "payload", "data": b"from taskpoint".hex()}


def test_file_saved_by_taskpoint_loads_in_flyte(tmp_path):
    src = tmp_path / "weights.bin"
    src.write_bytes(os.urandom(70_000))
    Checkpoint(tmp_path / "ckpt").save_sync(src)
    got = json.loads(_flyte("load", str(tmp_path / "ckpt")))
    assert got["result"] == "payload" and got["data"] == src.read_bytes().hex()


@pytest.mark.parametrize("codec", ["gzip", "none"])
def test_directory_saved_by_taskpoint_loads_in_flyte(tmp_path, codec):
    src = make_tree(tmp_path / "src")
    Checkpoint(tmp_path / "ckpt", codec=codec).save_sync(src)
    got = json.loads(_flyte("load", str(tmp_path / "ckpt")))
    assert got["result"] == "dir"
    assert got["tree"] == _tree_as_flyte_describes(src)
