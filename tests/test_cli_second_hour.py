"""Issue 40, item 5: what a new user meets in the second hour, through the ``taskpoint`` command as tests/test_cli.py
runs it (its ``main``, in this process), on local disk and on the S3 server (moto)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import LazyModule, read_object, requires, write_object
from taskpoint import Checkpoint, CheckpointManager, checkpoints_in
from test_cli import tp, where  # noqa: F401  (the fixture: local disk and the S3 server)

torch = LazyModule("torch")


def _steps(base: str, options: dict, numbers: range, metadata: dict | None = None) -> str:
    uri = f"{base}/ckpts"
    with CheckpointManager(uri, storage_options=options, keep=None, preemption=False) as manager:
        for step in numbers:
            manager.save(f"step {step}".encode(), step, metadata=metadata)
    return uri


def test_every_uri_the_cli_prints_for_a_step_is_one_it_takes(capsys, where, tmp_path):  # noqa: F811
    """``show`` prints ``uri: ckpts/ckpt-180``: ls, show, verify, pull, cat and rm take that URI as the step."""
    base, opts, options = where
    steps = _steps(base, options, range(100, 200, 40))
    code, out, err = tp(capsys, "show", steps, *opts)
    printed = re.search(r"^uri: (\S+)$", out, re.M)[1]
    assert code == 0 and printed == f"{steps}/ckpt-180", out + err
    code, out, _ = tp(capsys, "ls", steps, "--json", *opts)
    assert [row["uri"] for row in json.loads(out)["steps"]] == [f"{steps}/ckpt-{n}" for n in (100, 140, 180)]

    code, out, err = tp(capsys, "verify", f"{steps}/ckpt-140", *opts)
    assert (code, out) == (0, "step 140: healthy (8 B, blake3 pieces match its manifest)\n"), err
    code, out, err = tp(capsys, "show", f"{steps}/ckpt-140", *opts)
    assert code == 0 and "step: 140" in out and f"uri: {steps}/ckpt-140" in out, err
    code, out, err = tp(capsys, "ls", f"{steps}/ckpt-140", *opts)
    assert code == 0 and re.search(r"^ 140  committed ", out, re.M) and not re.search(r"^ 1[08]0 ", out, re.M), out
    code, out, err = tp(capsys, "pull", f"{steps}/ckpt-100", tmp_path / "pulled", *opts)
    assert code == 0 and (tmp_path / "pulled" / "payload").read_bytes() == b"step 100", err
    # The URI names the step: a --step that says otherwise is refused, naming both.
    code, _, err = tp(capsys, "show", f"{steps}/ckpt-140", "--step", 100, *opts)
    assert code == 1 and f"is step 140 of {steps}, and --step says 100" in err
    code, out, err = tp(capsys, "rm", f"{steps}/ckpt-100", *opts)
    assert (code, out) == (0, f"deleted step 100 of {steps}\n"), err
    code, _, err = tp(capsys, "rm", steps, *opts)
    assert code == 1 and "--step N, or the step's folder" in err
    with CheckpointManager(steps, storage_options=options, preemption=False) as manager:
        assert manager.steps() == [140, 180]


def test_a_missing_step_says_which_steps_exist_in_every_command_and_call(capsys, where, tmp_path):  # noqa: F811
    """"step 999 does not exist in ckpts" goes on with the count of the steps there and which: all of them when
    few, else the newest three and the oldest; the same words from the Python calls."""
    base, opts, options = where
    few = _steps(base, options, range(100, 200, 40))
    for args in (["show", few, "--step", 999], ["verify", few, "--step", 999], ["rm", few, "--step", 999],
                 ["pull", few, tmp_path / "never-written", "--step", 999], ["cat", few, "x", "--step", 999]):
        code, _, err = tp(capsys, *args, *opts)
        assert (code, err) == (3, f"taskpoint {args[0]}: step 999 does not exist in {few}; its 3 steps: "
                                  "100, 140, 180\n"), args

    many = f"{base}/many"
    with CheckpointManager(many, storage_options=options, keep=None, preemption=False) as manager:
        for step in range(1, 11):
            manager.save(b"x", step)
        said = "step 999 does not exist in " + many + "; its 10 steps: newest 10, 9, 8, ..., oldest 1"
        for call in (lambda: manager.restore(999), lambda: manager.metadata(999), lambda: manager.open(999, "x"),
                     lambda: manager.describe(999), lambda: manager.verify(999), lambda: manager.delete(999)):
            with pytest.raises(FileNotFoundError) as info:
                call()
            assert str(info.value) == said
    with CheckpointManager(f"{base}/empty", storage_options=options, preemption=False) as manager, \
            pytest.raises(FileNotFoundError, match=r"^step 3 does not exist in .*; it holds no step$"):
        manager.restore(3)


def test_ls_columns_line_up_with_long_values(capsys, tmp_path):
    """Each column of ``ls`` starts at the same place on every line, however long a value is."""
    steps = _steps(str(tmp_path), {}, range(8, 1_000_008, 500_000),
                   metadata={"a_metadata_key_longer_than_its_column": 1, "loss": 0.5})
    code, out, _ = tp(capsys, "ls", steps)
    header, *rows = [line for line in out.splitlines()[1:] if not line.startswith("sizes compared")]
    assert code == 0 and len(rows) == 2 and header.startswith("  STEP  STATE "), out
    starts = {name: header.index(name) for name in ("STATE", "KIND", "SAVED (UTC)", "METADATA", "MARK")}
    for row in rows:
        assert row[starts["STATE"]:].startswith("committed "), out
        assert row[starts["KIND"]:].startswith("bytes "), out
        assert re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d ", row[starts["SAVED (UTC)"]:]), out
        assert row[starts["METADATA"]:].startswith("a_metadata_key_longer_than_its_column,loss "), out
        assert row[starts["MARK"] - 2:starts["MARK"]] == "  " and row[starts["MARK"]] != " ", out
    # Numbers align right: each step and size ends where its header does.
    ends = {name: header.index(name) + len(name) for name in ("STEP", "SIZE")}
    for row, step, size in zip(rows, ("8", "500008"), ("6 B", "11 B"), strict=True):
        assert row[:ends["STEP"]].endswith(step) and row[:ends["SIZE"]].endswith(" " + size), out


def test_transfers_report_units_that_fit_and_no_rate_for_a_small_one(capsys, tmp_path):
    small, big = tmp_path / "small.bin", tmp_path / "big.bin"
    small.write_bytes(b"x" * 100)
    big.write_bytes(bytes(3 << 20))
    code, out, _ = tp(capsys, "push", small, tmp_path / "small")
    assert code == 0 and re.fullmatch(rf"pushed {re.escape(str(small))} -> {re.escape(str(tmp_path))}/small "
                                      r"\(file, 100 B in \d+ ms\)\n", out), out
    code, out, _ = tp(capsys, "pull", tmp_path / "small", tmp_path / "out")
    assert code == 0 and "MB/s" not in out and re.search(r"\(file, 100 B in \d+ ms\)\n$", out), out
    code, out, _ = tp(capsys, "push", big, tmp_path / "big")
    assert code == 0 and re.search(r"\(file, 3\.0 MiB in [\d.]+ m?s, [\d.]+ (KiB|MiB|GiB)/s\)\n$", out), out


@requires("torch")
def test_pull_of_a_state_dict_writes_state_dict_pt(capsys, where, tmp_path):  # noqa: F811
    """A state dict pulled from a manager step or from a checkpoint object lands as state_dict.pt (what
    ``torch.load`` is given), not as ``payload``."""
    from taskpoint.torch import STATE_FILE, StateDict

    base, opts, options = where
    state = {"w": torch.arange(6.0)}
    with CheckpointManager(f"{base}/sd", storage_options=options, preemption=False) as manager:
        manager.save(StateDict(state), 5)
    with Checkpoint(f"{base}/one", storage_options=options) as cp:
        cp.save_sync(StateDict(state))
    for uri, into in ((f"{base}/sd", tmp_path / "step"), (f"{base}/one", tmp_path / "object")):
        code, out, err = tp(capsys, "pull", uri, into, *opts)
        assert code == 0 and sorted(p.name for p in into.iterdir()) == [STATE_FILE], out + err
        assert torch.equal(torch.load(into / STATE_FILE, weights_only=True)["w"], state["w"])
        assert "torch.state_dict, 1." in out and "/s)" not in out, out


def test_the_time_a_load_reports_leaves_out_importing_the_kinds_extra(tmp_path, monkeypatch):
    """A load that imports the extra of its payload's kind (torch, for a state dict: seconds) reports the transfer's
    time without it. A fake clock (the one mock here: a real import's seconds cannot be told apart from a slow
    machine's without asserting a wall-clock time) jumps 100 s inside the kind's lookup."""
    import taskpoint._log
    import taskpoint.record

    now = [1000.0]
    monkeypatch.setattr(taskpoint._log.time, "perf_counter", lambda: now[0])
    real_lookup = taskpoint.record.payload_class

    def slow_import(kind: str, uri: str):
        now[0] += 100.0
        return real_lookup(kind, uri)

    monkeypatch.setattr(taskpoint.record, "payload_class", slow_import)
    seen = []
    monkeypatch.setattr(taskpoint._log, "log_transfer", lambda stats: seen.append(stats) or stats)
    with Checkpoint(tmp_path / "cp") as cp:
        cp.save_sync(b"bytes")
    with Checkpoint(tmp_path / "next", tmp_path / "cp") as cp:
        assert cp.load_sync().read_bytes() == b"bytes"
    assert seen[-1].operation == "load" and seen[-1].total_seconds < 100.0


def test_a_url_with_one_slash_gets_the_fix_first_and_alone(capsys):
    code, _, err = tp(capsys, "ls", "s3:/bucket/x")
    assert code == 1 and err.startswith("taskpoint ls: 's3:/bucket/x' is not a valid URL: did you mean "
                                        "'s3://bucket/x'? ('s3:' must be followed by '//'"), err
    assert "Protocols fsspec" not in err and "pip install" not in err and len(err.splitlines()) == 1


@requires("lightning", "torch")
@pytest.mark.e2e("trains with Lightning")
def test_ls_and_verify_take_the_folder_the_lightning_plugin_writes(capsys, where):  # noqa: F811
    """The ``.ckpt`` files of taskpoint.lightning.CheckpointIO in one folder: ls lists each, verify checks each
    (exit 2 naming the damaged one), as they do for one ``.ckpt``."""
    from taskpoint.lightning import CheckpointIO

    base, opts, options = where
    folder = f"{base}/run/checkpoints"
    io = CheckpointIO(storage_options=options)
    names = ["epoch=0-step=6.ckpt", "epoch=0-step=9.ckpt", "last.ckpt"]
    for name in names:
        io.save_checkpoint({"global_step": int(re.sub(r"\D", "", name) or 9), "w": torch.ones(64)}, f"{folder}/{name}")
    assert checkpoints_in(folder, storage_options=options) == [f"{folder}/{name}" for name in names]

    code, out, err = tp(capsys, "ls", folder, *opts)
    assert code == 0 and out.startswith(f"{folder}: 3 checkpoint(s)\nNAME "), out + err
    assert all(re.search(rf"^{re.escape(name)} +saved +file ", out, re.M) for name in names), out
    code, out, err = tp(capsys, "verify", folder, *opts)
    assert code == 0 and out.count(": healthy (") == 3, out + err
    assert re.search(rf"\n{re.escape(folder)}: 3 checkpoint\(s\) checked in [\d.]+ s\n$", out), out

    damaged = f"{folder}/epoch=0-step=9.ckpt"
    data = bytearray(read_object(damaged, options))
    data[len(data) // 2] ^= 0x01
    write_object(damaged, options, bytes(data))
    code, out, err = tp(capsys, "verify", folder, *opts)
    assert code == 2 and out.count(": healthy (") == 2 and f"{damaged}: DAMAGED: " in out, out
    assert err == f"taskpoint verify: 1 of 3 checkpoint(s) in {folder} are damaged: epoch=0-step=9.ckpt\n"
    assert tp(capsys, "ls", f"{base}/run/nothing-here", *opts)[0] == 3


def test_a_folder_without_checkpoints_is_still_nothing(capsys, tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / "plain" / "notes.txt").write_text("not a checkpoint")
    for command in ("ls", "verify"):
        code, _, err = tp(capsys, command, Path(tmp_path / "plain"))
        assert code == 3 and "nothing taskpoint saved is at" in err
