"""``taskpoint pull URI DEST --path P`` (repeatable) and ``taskpoint cat URI PATH [--step N]``: part of a checkpoint
or step, on local disk and the S3 server, with the exit codes of the other commands (2 damaged, 3 not found)."""

from __future__ import annotations

import json

import fsspec
import pytest

from helpers import make_tree, snapshot
from taskpoint.cli import main
from taskpoint.format.index import ArchiveIndex


def tp(capfdbinary, *args: object) -> tuple[int, bytes, str]:
    """Run the command line in this process; exit code, stdout (bytes: cat writes files), stderr."""
    capfdbinary.readouterr()
    code = main([str(a) for a in args])
    out, err = capfdbinary.readouterr()
    return code, out, err.decode()


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """(base URI, -o arguments, storage options) on local disk or on the S3 server."""
    if request.param == "local":
        return str(tmp_path / "store"), [], {}
    location = request.getfixturevalue("s3_server").new_location()
    opts = [a for k, v in location.storage_options.items()
            for a in ("-o", f"{k}={v if isinstance(v, str) else json.dumps(v)}")]
    return location.base, opts, location.storage_options


def _selected(tree: dict, names: list[str]) -> dict:
    return {k: v for k, v in tree.items() if any(k == n or k.startswith(n + "/") for n in names)}


@pytest.mark.parametrize("dedup", [False, True], ids=["plain", "dedup"])
def test_pull_path_restores_only_those_entries_of_a_step_and_cat_writes_one_file(capfdbinary, where, tmp_path, dedup):
    base, opts, _ = where
    model = make_tree(tmp_path / "model", big=300_000)
    push = ["push", model, f"{base}/steps", "--step", 5, *opts] + (["--dedup"] if dedup else [])
    assert tp(capfdbinary, *push)[0] == 0
    code, out, err = tp(capfdbinary, "pull", f"{base}/steps", tmp_path / "dest", "--path", "nested/",
                        "--path", "state.json", "--no-progress", *opts)
    assert code == 0, err
    assert snapshot(tmp_path / "dest") == _selected(snapshot(model), ["nested", "state.json"])
    code, out, err = tp(capfdbinary, "cat", f"{base}/steps", "bulk.bin", *opts)
    assert code == 0 and out == (model / "bulk.bin").read_bytes(), err
    code, out, err = tp(capfdbinary, "cat", f"{base}/steps", "nested/run.sh", "--step", 5, *opts)
    assert code == 0 and out == (model / "nested" / "run.sh").read_bytes(), err
    code, _, err = tp(capfdbinary, "cat", f"{base}/steps", "no/such.bin", *opts)
    assert code == 3 and "'no/such.bin'" in err
    code, _, err = tp(capfdbinary, "pull", f"{base}/steps", tmp_path / "d2", "--path", "gone/", *opts)
    assert code == 3 and "'gone'" in err and not (tmp_path / "d2" / "state.json").exists()


def test_pull_path_and_cat_of_a_single_checkpoint(capfdbinary, where, tmp_path):
    base, opts, _ = where
    model = make_tree(tmp_path / "model", big=300_000)
    assert tp(capfdbinary, "push", model, f"{base}/ckpt", *opts)[0] == 0
    code, _, err = tp(capfdbinary, "pull", f"{base}/ckpt", tmp_path / "dest", "--path", "weights.bin", *opts)
    assert code == 0, err
    assert snapshot(tmp_path / "dest") == _selected(snapshot(model), ["weights.bin"])
    code, out, err = tp(capfdbinary, "cat", f"{base}/ckpt", "nested/deeper/notes.txt", *opts)
    assert code == 0 and out == b"deep", err


def test_cat_of_a_damaged_member_exits_2(capfdbinary, tmp_path):
    model = make_tree(tmp_path / "model", big=9_000_000)
    assert tp(capfdbinary, "push", model, tmp_path / "ckpt")[0] == 0
    record = json.loads((tmp_path / "ckpt.taskpoint.json").read_text())
    span = ArchiveIndex.from_json(record["objects"][0]["index"]).span(0)
    fs = fsspec.filesystem("file")
    data = bytearray(fs.cat_file(str(tmp_path / "ckpt")))
    data[span.stored + span.stored_length // 2] ^= 0xFF
    (tmp_path / "ckpt").write_bytes(bytes(data))
    code, _, err = tp(capfdbinary, "cat", tmp_path / "ckpt", "bulk.bin")
    assert code == 2 and "member 0" in err
    code, out, err = tp(capfdbinary, "cat", tmp_path / "ckpt", "state.json")
    assert code == 0 and out == (model / "state.json").read_bytes(), err
