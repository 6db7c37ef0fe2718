"""The ``taskpoint`` command line, run as a user runs it, against local disk and the S3 server."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import fsspec
import pytest

from helpers import make_tree, object_exists, read_object, snapshot, wait_until, write_object
from taskpoint import Checkpoint, CheckpointManager, ctx, task
from taskpoint.cli import main
from taskpoint.workspace import STAGING_PREFIX

SECRET = "tp-CLI-SECRET-4b7e19d0"
COMMANDS = ("ls", "show", "verify", "pull", "cat", "push", "rm", "gc", "run")


def tp(capsys, *args: str) -> tuple[int, str, str]:
    """Run the command line in this process (the S3 server is a thread of it); exit code, stdout, stderr."""
    capsys.readouterr()
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def option_args(options: dict) -> list[str]:
    """``-o KEY=VALUE`` for each storage option (JSON for anything but a string)."""
    args: list[str] = []
    for key, value in options.items():
        args += ["-o", f"{key}={value if isinstance(value, str) else json.dumps(value)}"]
    return args


@pytest.fixture(params=["local", "s3"])
def where(request, tmp_path):
    """(base URI, -o arguments, storage options) on local disk or on the S3 server."""
    if request.param == "local":
        return str(tmp_path / "store"), [], {}
    location = request.getfixturevalue("s3_server").new_location()
    return location.base, option_args(location.storage_options), location.storage_options


def size_of(url: str, options: dict) -> int:
    fs, path = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()
    return int(fs.size(path))


def flip_byte(url: str, options: dict, offset: int = 100) -> None:
    data = bytearray(read_object(url, options))
    data[offset] ^= 0x01
    write_object(url, options, bytes(data))


def payload_url(base: str, step: int, options: dict) -> str:
    fs, path = fsspec.core.url_to_fs(f"{base}/ckpt-{step}", **options)
    fs.invalidate_cache()
    name = next(p.rsplit("/", 1)[1] for p in fs.ls(path, detail=False) if "/payload-" in p)
    return f"{base}/ckpt-{step}/{name}"


def test_checkpoint_object_push_ls_show_verify_pull(capsys, where, tmp_path):
    base, opts, options = where
    model = make_tree(tmp_path / "model", big=200_000)
    uri = f"{base}/run/1/checkpoint"
    code, out, err = tp(capsys, "push", model, uri, *opts)
    assert code == 0, err
    assert re.fullmatch(rf"pushed {re.escape(str(model))} -> {re.escape(uri)} \(directory, [0-9.]+ (B|KiB|MiB) in "
                        r"[0-9.]+ (ms|s)(, [0-9.]+ (B|KiB|MiB|GiB)/s)?\)\n", out), out

    code, out, _ = tp(capsys, "ls", uri, "--json", *opts)
    view = json.loads(out)
    stored = size_of(uri, options)
    assert code == 0 and (view["type"], view["state"], view["kind"], view["size"]) == ("checkpoint", "saved",
                                                                                      "directory", stored)
    assert [o["size_matches"] for o in view["objects"]] == [True] and view["record"] == f"{uri}.taskpoint.json"
    code, out, _ = tp(capsys, "ls", uri, *opts)
    assert code == 0 and out.startswith(f"{uri}  saved  directory")

    code, out, _ = tp(capsys, "show", uri, "--json", *opts)
    record = json.loads(out)
    assert code == 0 and record["objects"][0]["crc32"] and record["objects"][0]["size"] == stored

    code, out, _ = tp(capsys, "verify", uri, *opts)
    assert code == 0 and out.strip() == f"{uri}: healthy ({_human(stored)}, crc32 matches its record)"

    code, out, err = tp(capsys, "pull", uri, tmp_path / "restored", *opts)
    assert code == 0, err
    assert snapshot(tmp_path / "restored") == snapshot(model)


def _human(size: int) -> str:
    from taskpoint.cli.views import _human as human

    return human(size)


def test_manager_directory_push_ls_show_verify_pull_rm_gc(capsys, where, tmp_path):
    base, opts, options = where
    model = make_tree(tmp_path / "model")
    steps = f"{base}/steps"
    assert tp(capsys, "push", model, steps, "--step", 1, "--metadata", '{"loss": 0.5, "lr": 0.1}', *opts)[0] == 0
    assert tp(capsys, "push", tmp_path / "model" / "state.json", steps, "--step", 2, *opts)[0] == 0

    code, out, _ = tp(capsys, "ls", steps, "--json", *opts)
    view = json.loads(out)
    assert code == 0 and view["type"] == "manager"
    rows = {row["step"]: row for row in view["steps"]}
    assert sorted(rows) == [1, 2] and {r["state"] for r in rows.values()} == {"committed"}
    assert rows[1]["metadata_keys"] == ["loss", "lr"] and rows[1]["kind"] == "directory"
    assert rows[2]["kind"] == "file" and rows[2]["size"] == (model / "state.json").stat().st_size
    assert rows[1]["size"] == size_of(payload_url(steps, 1, options), options)
    code, out, _ = tp(capsys, "ls", steps, *opts)
    assert code == 0 and "2 committed step(s)" in out and "loss,lr" in out

    code, out, _ = tp(capsys, "show", steps, "--step", 1, "--json", *opts)
    assert code == 0 and json.loads(out)["metadata"] == {"loss": 0.5, "lr": 0.1}
    code, out, _ = tp(capsys, "show", steps, *opts)  # the newest step
    assert code == 0 and "step: 2" in out and "kind: file" in out

    code, out, _ = tp(capsys, "verify", steps, *opts)
    assert code == 0 and "step 1: healthy" in out and "step 2: healthy" in out and "2 step(s) healthy" in out
    assert tp(capsys, "verify", steps, "--step", 2, *opts)[0] == 0

    code, out, err = tp(capsys, "pull", steps, tmp_path / "one", "--step", 1, *opts)
    assert code == 0, err
    assert snapshot(tmp_path / "one") == snapshot(model)
    code, out, err = tp(capsys, "pull", steps, tmp_path / "newest", *opts)
    assert code == 0 and (tmp_path / "newest" / "payload").read_bytes() == (model / "state.json").read_bytes()

    code, _, err = tp(capsys, "rm", steps, "--step", 2, *opts)  # the newest step that verifies: protected
    assert code == 1 and "is protected: it is the newest committed step that verifies" in err and "force" in err
    assert tp(capsys, "rm", steps, "--step", 2, "--force", *opts)[:2] == (0, f"deleted step 2 of {steps}\n")
    with CheckpointManager(steps, storage_options=options) as manager:
        assert manager.steps() == [1]
    code, _, err = tp(capsys, "rm", steps, "--step", 2, *opts)
    assert code == 3 and err.strip() == f"taskpoint rm: step 2 does not exist in {steps}; its 1 step: 1"

    leftover = f"{steps}/ckpt-1/payload-{'ab' * 16}"
    write_object(leftover, options, b"left by a killed save")
    code, out, _ = tp(capsys, "gc", steps, "--grace", 0, "--dry-run", *opts)
    assert code == 0 and f"would remove {leftover}" in out
    assert read_object(leftover, options)  # still there
    code, out, _ = tp(capsys, "gc", steps, "--grace", 0, *opts)
    assert code == 0 and f"removed {leftover}" in out and "1 leftover(s) removed" in out
    with pytest.raises(FileNotFoundError):
        read_object(leftover, options)


def test_task_root_lists_runs_actions_attempts_and_steps(capsys, tmp_path):
    root = tmp_path / "root"

    @task(retries=2, root=str(root), run_name="job7")
    def train() -> None:
        c = ctx()
        assert c is not None and c.checkpoint is not None
        c.checkpoint.save_sync(b"state of attempt %d" % c.attempt)
        c.checkpoints.save(b"step", c.attempt)
        if c.attempt < 2:
            raise RuntimeError("preempted")

    train()
    code, out, _ = tp(capsys, "ls", root, "--json")
    view = json.loads(out)
    assert code == 0 and view["type"] == "task-root"
    [action] = view["actions"]
    assert (action["run"], action["action"], action["steps"]) == ("job7", "train", [1, 2])
    assert action["attempts"] == [{"attempt": 1, "checkpoint_size": len(b"state of attempt 1")},
                                  {"attempt": 2, "checkpoint_size": len(b"state of attempt 2")}]
    code, out, _ = tp(capsys, "ls", root)
    assert code == 0 and "job7/train  attempts 1(18 B) 2(18 B)  steps 1..2 (2)" in out


def test_exit_codes_damaged_not_found_and_errors(capsys, where, tmp_path):
    base, opts, options = where
    uri, steps = f"{base}/ckpt", f"{base}/steps"
    assert tp(capsys, "push", make_tree(tmp_path / "model", big=100_000), uri, *opts)[0] == 0
    assert tp(capsys, "push", tmp_path / "model", steps, "--step", 4, *opts)[0] == 0
    assert tp(capsys, "verify", uri, *opts)[0] == 0

    flip_byte(uri, options, offset=50_000)
    code, out, err = tp(capsys, "verify", uri, *opts)
    assert code == 2 and err.startswith(f"taskpoint verify: {uri} is damaged") and err.count("\n") == 1
    assert tp(capsys, "pull", uri, tmp_path / "out", *opts)[0] == 2
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())

    flip_byte(payload_url(steps, 4, options), options)
    code, out, err = tp(capsys, "verify", steps, *opts)
    assert code == 2 and "step 4: DAMAGED" in out and "damaged: 4" in err
    code, _, err = tp(capsys, "verify", steps, "--step", 4, *opts)
    assert code == 2 and f"step 4 in {steps} is damaged" in err

    for args in (["verify", f"{base}/nothing"], ["verify", steps, "--step", 9], ["ls", f"{base}/nothing"],
                 ["show", f"{base}/nothing"], ["pull", f"{base}/nothing", tmp_path / "o"]):
        code, _, err = tp(capsys, *args, *opts)
        assert code == 3, (args, err)
        assert err.startswith(f"taskpoint {args[0]}: ") and err.count("\n") == 1

    for args in (["verify"], ["verify", uri, "--step", "x"], ["ls", uri, "--no-such-flag"],
                 ["ls", uri, "-o", "no-equals-sign"], ["push", tmp_path / "absent", uri]):
        code, _, err = tp(capsys, *args)
        assert code == 1 and err.startswith("taskpoint") and err.count("\n") == 1, (args, err)


@pytest.mark.e2e("starts the S3 server")
def test_storage_errors_exit_1_in_one_line_and_a_traceback_only_with_debug(capsys, s3_server):
    location = s3_server.new_location()
    dead = {**location.storage_options, "endpoint_url": "http://127.0.0.1:9",
            "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}}
    code, out, err = tp(capsys, "verify", location.url("x"), *option_args(dead))
    assert code == 1 and out == "" and err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"taskpoint verify: could not read {location.url('x')}")
    code, _, err = tp(capsys, "--debug", "ls", location.url("x"), *option_args(dead))
    assert code == 1 and "Traceback (most recent call last)" in err and "StorageUnavailable" in err
    code, _, err = tp(capsys, "ls", location.url("x"), "--debug", *option_args(dead))
    assert code == 1 and "Traceback (most recent call last)" in err


def test_help_of_every_command_has_an_example(capsys):
    code, out, _ = tp(capsys, "--help")
    assert code == 0 and all(name in out for name in COMMANDS)
    for name in COMMANDS:
        code, out, _ = tp(capsys, name, "--help")
        assert code == 0 and out.startswith(f"Usage: taskpoint {name}") and "Example" in out, name
        assert f"taskpoint {name} " in out.split("Example", 1)[1], name


@pytest.mark.e2e("runs the CLI as a process")
def test_console_entry_points_version_and_import_without_click():
    env = {k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")}
    for module in ("taskpoint", "taskpoint.cli"):
        out = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True, text=True, env=env,
                             timeout=120)
        assert (out.returncode, out.stdout) == (0, "taskpoint 0.1.0\n"), out.stderr
    out = subprocess.run([sys.executable, "-c", "import sys, taskpoint; print('click' in sys.modules)"],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.e2e("starts the S3 server")
def test_a_secret_storage_option_is_never_printed(capsys, s3_server, tmp_path, monkeypatch):
    """moto takes any key: the secret is in use while every command runs, succeeds and fails."""
    location = s3_server.new_location()
    options = {**location.storage_options, "secret": SECRET}
    opts = option_args(options)
    model = make_tree(tmp_path / "model")
    uri, steps = location.url("ckpt"), location.url("steps")
    runs = [("push", model, uri), ("ls", uri), ("ls", uri, "--json"), ("show", uri), ("verify", uri),
            ("pull", uri, tmp_path / "a"), ("push", model, steps, "--step", 1), ("ls", steps, "--json"),
            ("show", steps, "--json"), ("verify", steps), ("gc", steps, "--dry-run")]
    outputs = []
    for args in runs:
        code, out, err = tp(capsys, "-v", *args, *opts)
        assert code == 0, (args, err)
        outputs.append(out + err)
    flip_byte(uri, location.storage_options, offset=300)
    dead = option_args({**options, "endpoint_url": "http://127.0.0.1:9",
                        "config_kwargs": {"connect_timeout": 1, "retries": {"max_attempts": 1}}})
    for args in (["verify", uri, *opts], ["--debug", "pull", uri, tmp_path / "b", *opts], ["--debug", "ls", uri, *dead],
                 ["ls", uri, "-o", f"secret{SECRET}"], ["ls", uri, "-o", f"key={SECRET}", "-o", "client_kwargs={"]):
        code, out, err = tp(capsys, *args)
        assert code != 0
        outputs.append(out + err)
    monkeypatch.setenv("TASKPOINT_STORAGE_OPTIONS", json.dumps({**options, "endpoint_url": "http://127.0.0.1:9",
                                                                "config_kwargs": {"connect_timeout": 1,
                                                                                  "retries": {"max_attempts": 1}}}))
    code, out, err = tp(capsys, "--debug", "verify", steps)
    assert code == 1
    outputs.append(out + err)
    for text in outputs:
        assert SECRET not in text, text
    import logging

    logger = logging.getLogger("taskpoint")
    for handler in list(logger.handlers):  # -v added stream handlers in this process
        if not isinstance(handler, logging.NullHandler):
            logger.removeHandler(handler)
    logger.setLevel(logging.NOTSET)


@pytest.mark.e2e("starts the S3 server")
def test_storage_options_from_the_environment_and_from_fsspec_config(capsys, s3_server, tmp_path, monkeypatch):
    location = s3_server.new_location()
    uri = location.url("ckpt")
    assert tp(capsys, "push", make_tree(tmp_path / "model"), uri, *option_args(location.storage_options))[0] == 0
    monkeypatch.setenv("TASKPOINT_STORAGE_OPTIONS", json.dumps(location.storage_options))
    assert tp(capsys, "verify", uri)[0] == 0
    # A --storage-option overrides the same key from the environment.
    code, _, err = tp(capsys, "verify", uri, "-o", "endpoint_url=http://127.0.0.1:9", "-o",
                      'config_kwargs={"connect_timeout": 1, "retries": {"max_attempts": 1}}')
    assert code == 1 and "127.0.0.1:9" in err
    monkeypatch.setenv("TASKPOINT_STORAGE_OPTIONS", "not json")
    code, _, err = tp(capsys, "verify", uri)
    assert code == 1 and "TASKPOINT_STORAGE_OPTIONS must be a JSON object" in err
    # fsspec's own configuration: FSSPEC_S3 (JSON), read by fsspec in a fresh process.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TASKPOINT_", "FSSPEC_"))}
    env["FSSPEC_S3"] = json.dumps(location.storage_options)
    out = subprocess.run([sys.executable, "-m", "taskpoint", "ls", uri, "--json"], capture_output=True, text=True,
                         env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["state"] == "saved"
    env.pop("FSSPEC_S3")
    env["FSSPEC_S3_ENDPOINT_URL"] = "http://127.0.0.1:9"  # and the variables are really what it used
    out = subprocess.run([sys.executable, "-m", "taskpoint", "ls", uri, "-o",
                          'config_kwargs={"connect_timeout": 1, "retries": {"max_attempts": 1}}'],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 1 and "127.0.0.1:9" in out.stderr


def test_pull_into_a_folder_is_the_api_load(capsys, tmp_path):
    (tmp_path / "blob").write_bytes(b"raw bytes")
    assert tp(capsys, "push", tmp_path / "blob", tmp_path / "ck")[0] == 0
    code, out, _ = tp(capsys, "pull", tmp_path / "ck", tmp_path / "dest")
    assert code == 0 and (tmp_path / "dest" / "payload").read_bytes() == b"raw bytes"
    assert Path(out.split(" -> ")[1].split(" (")[0]) == tmp_path / "dest" / "payload"


@pytest.mark.e2e("runs the CLI as a process")
def test_run_keeps_its_flags_and_usage_exit_code(capsys, tmp_path):
    """Its behaviour is tested in test_runtime.py (as ``python -m taskpoint.cli run``); here, parsing."""
    for args in (["run", "--bogus", "--", "true"], ["run", "--attempt", "x", "--", "true"], ["run", "--"],
                 ["run", "--prev-checkpoint", "p", "--", "true"]):
        code, _, err = tp(capsys, *args)
        assert code == 2 and err.startswith("taskpoint run"), (args, err)
    child = "import taskpoint; print(taskpoint.ctx().checkpoint.remote_destination)"
    out = subprocess.run([sys.executable, "-m", "taskpoint", "run", "--checkpoint-path", str(tmp_path / "c"),
                          sys.executable, "-c", child, "--not-an-option-of-run"],
                         capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith("TASKPOINT_")})
    assert out.returncode == 0 and out.stdout.strip() == str(tmp_path / "c"), out.stderr


def test_secrets_are_redacted_also_when_a_client_quotes_them_into_a_message(monkeypatch):
    """gcsfs puts a token it could not use into a URL (``tokeninfo?access_token=%2F...``) in its error."""
    from taskpoint.cli._app import _redact, _secret_values, _State

    secret = "/keys/tp-SECRET q+7.json"
    monkeypatch.setenv("TASKPOINT_STORAGE_OPTIONS", json.dumps({"client_kwargs": {"password": "env-SECRET-77"}}))
    state = _State()
    state.pairs = [f"token={secret}", "endpoint_url=http://127.0.0.1:9000"]
    secrets = _secret_values(state)
    from urllib.parse import quote, quote_plus

    message = (f"no access with {secret}: tokeninfo?access_token={quote(secret, safe='')}&q={quote_plus(secret)} "
               f"{json.dumps({'token': secret})} env-SECRET-77 at http://127.0.0.1:9000")
    redacted = _redact(message, secrets)
    assert "SECRET" not in redacted and redacted.count("***") == 5
    assert "http://127.0.0.1:9000" in redacted  # plain settings stay readable


def test_ls_tells_committed_damaged_and_incomplete_steps_apart(capsys, tmp_path):
    steps = tmp_path / "steps"
    for step in (1, 2, 3):
        assert tp(capsys, "push", make_tree(tmp_path / f"m{step}"), steps, "--step", step)[0] == 0
    payload = next((steps / "ckpt-2").glob("payload-*"))
    payload.write_bytes(payload.read_bytes()[:-10])  # truncated: the listing's size differs from the manifest's
    next((steps / "ckpt-3").glob("payload-*")).unlink()  # deleted outside taskpoint
    (steps / "ckpt-4").mkdir()
    (steps / "ckpt-4" / ("payload-" + "cd" * 16)).write_bytes(b"a save in progress, or killed")
    code, out, _ = tp(capsys, "ls", steps, "--json")
    rows = {row["step"]: row for row in json.loads(out)["steps"]}
    assert code == 0 and {n: r["state"] for n, r in rows.items()} == {1: "committed", 2: "damaged", 3: "damaged",
                                                                      4: "incomplete"}
    assert "holds" in rows[2]["problem"] and "missing" in rows[3]["problem"]
    assert rows[4]["leftovers"] == ["payload-" + "cd" * 16]
    code, out, _ = tp(capsys, "ls", steps)
    assert "1 committed step(s)" in out and out.count("damaged") == 2 and "incomplete" in out


def test_deduplicated_steps_push_ls_show_verify_pull_rm_gc(capsys, where, tmp_path):
    """Steps saved with dedup=True hold no payload object of their own: ls checks their chunks against the
    listing, show counts files and chunks, verify fetches and hashes every chunk, and damage names the file."""
    base, opts, options = where
    model = make_tree(tmp_path / "model", big=300_000)
    steps = f"{base}/steps"
    code, out, err = tp(capsys, "push", model, steps, "--step", 1, "--dedup", *opts)
    assert code == 0 and " of new chunks in " in out, err
    code, out, _ = tp(capsys, "push", model, steps, "--step", 2, "--dedup", *opts)
    assert code == 0 and "0 B of new chunks" in out  # every chunk is already in the store
    assert tp(capsys, "push", model, f"{base}/one", "--dedup", *opts)[0] == 1  # --dedup goes with --step

    code, out, _ = tp(capsys, "ls", steps, "--json", *opts)
    rows = {row["step"]: row for row in json.loads(out)["steps"]}
    assert code == 0 and {n: r["state"] for n, r in rows.items()} == {1: "committed", 2: "committed"}
    total = sum(p.stat().st_size for p in model.rglob("*") if p.is_file() and not p.is_symlink())
    assert rows[2]["chunks"] == 5 and rows[2]["size"] == total and rows[2]["kind"] == "directory"
    assert "2 committed step(s)" in tp(capsys, "ls", steps, *opts)[1]
    code, out, _ = tp(capsys, "show", steps, "--step", 2, "--json", *opts)
    shown = json.loads(out)
    assert code == 0 and (shown["files"], shown["folders"], shown["links"], shown["chunks"]) == (5, 3, 2, 5)
    code, out, _ = tp(capsys, "show", steps, *opts)
    assert code == 0 and "codec: chunked" in out and "\npayload:" not in out

    code, out, _ = tp(capsys, "verify", steps, *opts)
    assert code == 0 and out.count("deduplicated: 5 files in 5 chunks, each matches its sha256") == 2
    code, out, err = tp(capsys, "pull", steps, tmp_path / "back", "--step", 2, *opts)
    assert code == 0, err
    assert snapshot(tmp_path / "back") == snapshot(model)

    doc = json.loads(read_object(f"{steps}/ckpt-2/taskpoint.json", options))
    (bulk,) = [e["chunks"][0] for e in doc["tree"]["entries"] if e["path"] == "bulk.bin"]
    chunk = f"{steps}/chunks/{bulk[:2]}/{bulk}"
    intact = read_object(chunk, options)
    flip_byte(chunk, options, offset=len(intact) // 2)
    code, out, err = tp(capsys, "verify", steps, *opts)
    assert code == 2 and "step 1: DAMAGED" in out and "step 2: DAMAGED" in out and "'bulk.bin'" in out
    code, _, err = tp(capsys, "verify", steps, "--step", 2, *opts)
    assert code == 2 and f"step 2 in {steps}" in err and "'bulk.bin'" in err and err.count("\n") == 1
    assert tp(capsys, "pull", steps, tmp_path / "bad", "--step", 2, *opts)[0] == 2

    fs, path = fsspec.core.url_to_fs(chunk, **options)
    fs.rm(path)  # deleted outside taskpoint
    code, out, _ = tp(capsys, "ls", steps, "--json", *opts)
    rows = {row["step"]: row for row in json.loads(out)["steps"]}
    assert {r["state"] for r in rows.values()} == {"damaged"} and "'bulk.bin' needs chunk" in rows[2]["problem"]
    code, _, err = tp(capsys, "verify", steps, "--step", 1, *opts)
    assert code == 2 and "'bulk.bin'" in err and "missing" in err

    write_object(chunk, options, intact)  # put back: both steps verify again
    assert tp(capsys, "verify", steps, *opts)[0] == 0
    for step in (1, 2):
        assert tp(capsys, "rm", steps, "--step", step, "--force", *opts)[0] == 0
    code, out, _ = tp(capsys, "gc", steps, "--grace", 0, *opts)
    assert code == 0 and "5 leftover(s) removed" in out
    fs.invalidate_cache()
    assert [p for p in fs.find(f"{path.rsplit('/chunks/', 1)[0]}/chunks")] == []


def _note(uri: str, chunks: bool = False) -> str:
    """The line ls prints below states it judged by sizes alone."""
    judged = "sizes compared only (deduplicated steps: each chunk is stored)" if chunks else "sizes compared only"
    return f"{judged}; run `taskpoint verify {uri}` to check every byte"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_each_kind_of_step_is_listed_shown_and_verified_with_the_size_of_the_data_it_holds(capsys, where, tmp_path):
    """The issue's row: ls showed a DCP step as `fileset 1.1 KiB` (its file-set manifest) where verify said
    97.9 KiB. A payload step's size is its stored payload, a deduplicated step's the plain bytes of its files, a
    DCP step's every file its manifest lists; ls, show and verify say the same, and ls says it compared sizes."""
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    import taskpoint.torch

    base, opts, options = where
    steps = f"{base}/steps"
    model = make_tree(tmp_path / "model", big=100_000)
    assert tp(capsys, "push", model, steps, "--step", 1, *opts)[0] == 0
    assert tp(capsys, "push", model, steps, "--step", 2, "--dedup", *opts)[0] == 0
    with CheckpointManager(steps, storage_options=options, preemption=False) as manager:
        state = {"w": torch.randn(64, 256), "b": torch.randn(300), "step": 3}
        dcp.save(state, storage_writer=taskpoint.torch.Writer.for_step(manager, 3))
    fs, path = fsspec.core.url_to_fs(f"{steps}/ckpt-3", **options)
    fs.invalidate_cache()
    dcp_files = {p.rsplit("/", 1)[1]: int(fs.size(p)) for p in fs.find(path)}
    data = {name: size for name, size in dcp_files.items() if name not in ("taskpoint.json", "taskpoint.dcp.json")}
    assert sorted(data)[0] == ".metadata" and len(data) >= 2  # DCP's metadata and its data files
    expected = {1: size_of(payload_url(steps, 1, options), options),
                2: sum(p.stat().st_size for p in model.rglob("*") if p.is_file() and not p.is_symlink()),
                3: sum(data.values())}
    assert expected[3] > 64 * 256 * 4 > dcp_files["taskpoint.dcp.json"]

    code, out, _ = tp(capsys, "ls", steps, "--json", *opts)
    rows = {row["step"]: row for row in json.loads(out)["steps"]}
    assert code == 0 and {n: (r["state"], r["size"]) for n, r in rows.items()} == {
        n: ("committed", size) for n, size in expected.items()}
    assert rows[3]["files"] == len(data) and rows[3]["leftovers"] == []  # DCP's files were listed as leftovers before
    code, out, _ = tp(capsys, "ls", steps, *opts)
    lines = out.splitlines()
    for step, size in expected.items():
        (row,) = [line for line in lines if line.split()[:2] == [str(step), "committed"]]
        assert f"  {_human(size)}  " in row
    assert lines[-1] == _note(steps, chunks=True)
    for step, size in expected.items():
        code, out, _ = tp(capsys, "verify", steps, "--step", step, *opts)
        assert code == 0 and out.startswith(f"step {step}: healthy ({_human(size)}")
        code, out, _ = tp(capsys, "show", steps, "--step", step, "--json", *opts)
        assert code == 0 and json.loads(out)["size"] == size
    code, out, _ = tp(capsys, "show", steps, "--step", 3, *opts)
    assert f"\nsize: {expected[3]}\n" in out and f"\npayload_size: {dcp_files['taskpoint.dcp.json']}\n" in out

    # A DCP file deleted outside taskpoint: ls finds it by the listing, naming the file.
    shard = next(name for name in data if name.endswith(".distcp"))
    fs.rm(f"{path}/{shard}")
    code, out, _ = tp(capsys, "ls", steps, "--json", *opts)
    row = {r["step"]: r for r in json.loads(out)["steps"]}[3]
    assert code == 0 and row["state"] == "damaged" and row["problem"] == f"its file {shard} is missing"


def test_show_marks_the_object_stored_now_and_leaves_the_records_bookkeeping_to_json(capsys, where):
    """The issue's row: show listed a healthy checkpoint's live object as `confirmed=False`, explained nowhere.
    It is marked current, an older listed object says it is not stored, the flag is in --json and --help."""
    base, opts, options = where
    uri = f"{base}/ckpt"
    Checkpoint(uri, storage_options=options).save_sync(b"first save")
    code, out, _ = tp(capsys, "show", uri, *opts)
    assert code == 0 and "objects (newest first; current: the object stored now, which a load reads):" in out
    assert "\n  - current: kind=bytes, codec=raw, " in out and "size=10, sha256=-, crc32=" in out
    for hidden in ("confirmed", "size_matches", "None"):
        assert hidden not in out
    code, out, _ = tp(capsys, "ls", uri, *opts)
    assert code == 0 and out.splitlines()[1] == _note(uri)

    Checkpoint(uri, storage_options=options).save_sync(b"the second save")
    code, out, _ = tp(capsys, "show", uri, *opts)
    assert "\n  - current: kind=bytes, codec=raw, " in out and "size=15, " in out
    assert "\n  - listed, not stored now: kind=bytes, codec=raw, " in out and "size=10, " in out
    code, out, _ = tp(capsys, "show", uri, "--json", *opts)
    objects = json.loads(out)["objects"]
    assert [(o["size"], o["current"], o["size_matches"]) for o in objects] == [(15, True, True), (10, False, False)]
    assert all(isinstance(o["confirmed"], bool) for o in objects)
    code, out, _ = tp(capsys, "show", "--help")
    text = " ".join(out.split())
    assert "`current` marks the one stored now, which a load reads and verifies" in text
    assert "`confirmed`: the record's own bookkeeping" in text and "says nothing about its health" in text


def test_values_the_cli_does_not_know_print_a_dash(capsys, tmp_path):
    """Missing times, kinds and attempts print `-`, never `None` nor `- UTC`."""
    (tmp_path / "other").write_bytes(b"written by another tool")  # no record: no kind, no save time
    code, out, _ = tp(capsys, "show", tmp_path / "other")
    assert code == 0 and "\nkind: -\ncreated: -\nobjects: -\nrecord: -\n" in out
    code, out, _ = tp(capsys, "ls", tmp_path / "other")
    assert code == 0 and "  unrecorded  -  23 B  no record" in out and "UTC" not in out
    steps = tmp_path / "steps"
    assert tp(capsys, "push", make_tree(tmp_path / "model"), steps, "--step", 1)[0] == 0  # outside a task: no attempt
    code, out, _ = tp(capsys, "show", steps)
    assert code == 0 and "\nattempt: -\n" in out and "\ncrc32: -\n" in out
    code, out, _ = tp(capsys, "ls", steps)
    row = out.splitlines()[2].split()
    assert code == 0 and row[-6:] == ["-", "-", "protected:", "newest", "that", "verifies"]  # attempt, keys, mark
    for command in ("show", "ls"):
        out = tp(capsys, command, steps)[1] + tp(capsys, command, tmp_path / "other")[1]
        assert "None" not in out and "- UTC" not in out


def _step_store(url: str, options: dict):
    """The steps of ``url`` as the library's verification reads them (a manager's parts)."""
    return CheckpointManager(url, storage_options=options, preemption=False)._context.steps


def _verify_manifest(steps, step, manifest, progress):
    """The line ``taskpoint verify`` prints for the save ``manifest`` commits as ``step``."""
    from taskpoint.cli.verify import step_line
    from taskpoint.manager.kinds import KINDS
    from taskpoint.manager.verify import verify_step

    with CheckpointManager(steps.directory, storage_options=steps.root.storage_options, preemption=False) as mgr:
        return step_line(verify_step(mgr._context, KINDS, step, progress, manifest=manifest))


def _verify_steps(steps, listed, progress):
    """What ``taskpoint verify`` does with the steps a listing found: a line each, then the verdict."""
    from taskpoint.cli.verify import report
    from taskpoint.manager.kinds import KINDS
    from taskpoint.manager.verify import verify_steps

    with CheckpointManager(steps.directory, storage_options=steps.root.storage_options, preemption=False) as mgr:
        report(verify_steps(mgr._context, KINDS, listed, progress))


def _exit_code(exc: BaseException) -> int:
    from taskpoint.cli._app import _describe

    return _describe(exc)[0]


#: What another writer does to step 1 between verify's read of its manifest and its read of the bytes: retention
#: deletes it (a payload step, or a deduplicated one whose chunks a sweep then removes), or it is saved again.
MEANWHILE = ["payload-deleted-by-retention", "payload-overwritten", "dedup-deleted-by-retention-and-swept",
             "dedup-overwritten-and-swept"]


@pytest.mark.parametrize("meanwhile", MEANWHILE)
def test_verify_of_a_step_deleted_or_overwritten_after_its_manifest_was_read_exits_1_not_damaged(
        capsys, where, tmp_path, meanwhile):
    """verify read the manifest, then another writer's retention deleted the step (manifest first, then its
    payload or, by a sweep, its chunks) or a save replaced it: the missing bytes are not damage (exit 2) and
    the step is not "not found" (3); as a restore does, verify reads the manifest again and says so (exit 1)."""
    from taskpoint.errors import CheckpointCorruptError, CheckpointError

    base, _, options = where
    url, dedup = f"{base}/steps", meanwhile.startswith("dedup")
    trees = [make_tree(tmp_path / name, big=100_000 + i) for i, name in enumerate("abc")]
    with CheckpointManager(url, storage_options=options, dedup=dedup, keep=2, grace_seconds=0,
                           preemption=False) as writer:
        writer.save(trees[0], 1)
        writer.save(trees[1], 2)
        steps = _step_store(url, options)
        read_before = steps.manifest(1)
        assert read_before is not None
        if "overwritten" in meanwhile:
            writer.save(trees[2], 1, overwrite=True)
        else:
            writer.save(trees[2], 3)  # keep=2: step 1 goes
            assert writer.steps() == [2, 3]
        if dedup:  # the chunks only the first save named go (by the save's own sweep, or this gc)
            writer.gc()
            (bulk,) = [e.chunks[0] for e in read_before.content.tree.entries if e.path == "bulk.bin"]
            assert not object_exists(f"{url}/chunks/{bulk[:2]}/{bulk}", options)
    with pytest.raises(CheckpointError, match=r"step 1 .* was overwritten or deleted while it was verified") as caught:
        _verify_manifest(steps, 1, read_before, progress=False)
    assert not isinstance(caught.value, CheckpointCorruptError) and _exit_code(caught.value) == 1
    if "overwritten" in meanwhile:  # the step as it is now verifies
        assert "step 1: healthy" in _verify_manifest(steps, 1, steps.manifest(1), progress=False)


def test_verify_of_a_step_whose_bytes_were_deleted_outside_taskpoint_is_still_damaged(where, tmp_path):
    """The other side of the check above: the manifest read again is the same save, so a missing payload is
    damage (exit 2)."""
    from taskpoint.errors import CheckpointCorruptError

    base, _, options = where
    url = f"{base}/steps"
    with CheckpointManager(url, storage_options=options, preemption=False) as writer:
        writer.save(make_tree(tmp_path / "a"), 1)
    steps = _step_store(url, options)
    read_before = steps.manifest(1)
    fs, path = fsspec.core.url_to_fs(payload_url(url, 1, options), **options)
    fs.rm(path)
    with pytest.raises(CheckpointCorruptError, match=r"its payload payload-.* is missing") as caught:
        _verify_manifest(steps, 1, read_before, progress=False)
    assert _exit_code(caught.value) == 2


def test_verify_of_a_directory_whose_step_retention_deleted_after_the_listing_exits_1(capsys, where, tmp_path):
    """verify listed the committed steps, then another writer's retention deleted one before verify read its
    manifest: that step is said to be gone meanwhile (exit 1, not 3 "does not exist"), the others are checked."""
    from taskpoint.errors import CheckpointCorruptError, CheckpointError

    base, _, options = where
    url = f"{base}/steps"
    with CheckpointManager(url, storage_options=options, keep=3, preemption=False) as writer:
        for step in (1, 2, 3):
            writer.save(b"step %d" % step, step)
        steps = _step_store(url, options)
        listed = sorted(n for n, folder in steps.scan().items() if folder.committed)
        writer.save(b"step 4", 4)  # keep=3: step 1 goes
    capsys.readouterr()
    with pytest.raises(CheckpointError, match=r"1 of 3 step\(s\) .* overwritten or deleted while they were "
                                              r"verified .*: 1; verify again") as caught:
        _verify_steps(steps, listed, progress=False)
    assert not isinstance(caught.value, CheckpointCorruptError) and _exit_code(caught.value) == 1
    out = capsys.readouterr().out
    assert "step 1: not checked: overwritten or deleted while it was verified" in out
    assert "step 2: healthy" in out and "step 3: healthy" in out


@pytest.mark.e2e("runs the CLI as a process")
def test_sigterm_ends_a_pull_or_push_at_once_cleaning_up_and_keeping_the_previous_step(tmp_path):
    """A real SIGTERM to a real `taskpoint` process in the middle of a transfer: exit 143 at once (not when the
    transfer ends), a pull leaves no staging folder and nothing in DEST, a push commits nothing and the
    previous step still restores."""
    big = tmp_path / "big"
    big.mkdir()
    for i in range(3):
        (big / f"w{i}.bin").write_bytes(os.urandom(100 << 20))
    steps = tmp_path / "steps"
    with CheckpointManager(steps, codec="none") as mgr:
        mgr.save(big, 1)

    dest = tmp_path / "dest"
    proc = subprocess.Popen([sys.executable, "-m", "taskpoint", "pull", str(steps), str(dest), "--step", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert wait_until(lambda: dest.is_dir() and any(dest.iterdir()), timeout=60), "the pull never started extracting"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "terminated (SIGTERM)" in err and "pulled" not in out, (out, err)
    assert list(dest.iterdir()) == []  # the staging folder is gone, and nothing half-extracted is left

    proc = subprocess.Popen([sys.executable, "-m", "taskpoint", "push", str(big), str(steps), "--step", "2",
                             "--codec", "none"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    folder = steps / "ckpt-2"
    assert wait_until(lambda: folder.is_dir() and any(folder.iterdir()), timeout=60), "the push never started writing"
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 143 and "terminated (SIGTERM)" in err and "pushed" not in out, (out, err)
    with CheckpointManager(steps) as mgr:
        assert mgr.steps() == [1]
        assert snapshot(mgr.restore(1, into=tmp_path / "back")) == snapshot(big)


#: A writer that saves a new step in a loop with keep=2 (retention deletes a step at each save); it says "ready"
#: once it has committed 3.
_RETAINING_WRITER = """
import json, os, sys
from taskpoint import CheckpointManager
url, options, dedup = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3] == "dedup"
src = sys.argv[4]
with CheckpointManager(url, storage_options=options, keep=2, grace_seconds=0, dedup=dedup,
                       preemption=False) as writer:
    step = 0
    while True:
        step += 1
        with open(os.path.join(src, "state.bin"), "wb") as f:
            f.write(os.urandom(200_000))
        writer.save(src, step)
        if step == 3:
            print("ready", flush=True)
"""


def _verify_beside_a_retaining_writer(capsys, where, tmp_path, *, runs: int, dedup: bool) -> None:
    base, opts, options = where
    url = f"{base}/steps"
    (tmp_path / "src").mkdir()
    writer = subprocess.Popen([sys.executable, "-c", _RETAINING_WRITER, url, json.dumps(options),
                               "dedup" if dedup else "payload", str(tmp_path / "src")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert writer.stdout is not None
        assert writer.stdout.readline() == "ready\n", writer.stderr.read() if writer.stderr else ""
        codes: dict[int, int] = {}
        for i in range(runs):
            args = ["verify", url, *opts] if i % 2 else ["verify", url, "--step", str(_oldest_step(url, options)),
                                                         *opts]
            code, out, err = tp(capsys, *args)
            codes[code] = codes.get(code, 0) + 1
            # 0 healthy; 1 a step overwritten or deleted meanwhile; 3 only for --step of a step already gone
            # before verify read its manifest (never for a step the directory's listing found).
            assert code in (0, 1) or (code == 3 and "--step" in args and "does not exist" in err), (args, out, err)
            if code == 1:
                assert "overwritten or deleted while" in err and "Traceback" not in err, err
        assert writer.poll() is None, writer.stderr.read() if writer.stderr else ""
    finally:
        writer.kill()
        writer.wait(30)
    print(f"verify beside a writer with keep=2 ({'dedup' if dedup else 'payload'}): exit codes {codes}")


def _oldest_step(url: str, options: dict) -> int:
    with CheckpointManager(url, storage_options=options, preemption=False) as reader:
        steps = reader.steps()
    return steps[0] if steps else 1


@pytest.mark.parametrize("dedup", [False, True], ids=["payload", "dedup"])
@pytest.mark.e2e("starts a python process")
def test_verify_beside_a_writer_whose_retention_deletes_steps_exits_0_or_1(capsys, where, tmp_path, dedup):
    """A real writer process saves with keep=2 in a loop while verify runs again and again (the directory,
    and --step of the oldest step): never "does not exist" for a listed step, never damage, never a traceback."""
    _verify_beside_a_retaining_writer(capsys, where, tmp_path, runs=40, dedup=dedup)


@pytest.mark.slow
@pytest.mark.campaign("400 verifies beside a retaining writer (make test: 40)")
@pytest.mark.parametrize("dedup", [False, True], ids=["payload", "dedup"])
def test_verify_beside_a_writer_whose_retention_deletes_steps_many_runs(capsys, where, tmp_path, dedup):
    _verify_beside_a_retaining_writer(capsys, where, tmp_path, runs=400, dedup=dedup)


# -- SIGTERM at any moment of a pull or a push ------------------------------------------------------------------


def test_a_deferrable_handler_waits_for_the_end_of_the_outermost_uninterrupted_section():
    """A real signal inside nested sections: its handler runs when the outer one ends (a raising one raises
    there), and at once outside any section."""
    from taskpoint import signals

    seen: list[int] = []

    def note(signum: int, frame: object) -> None:
        seen.append(signum)
        if len(seen) == 2:
            raise RuntimeError("the handler's own error")

    previous = signal.signal(signal.SIGUSR1, signals.deferrable(note))
    try:
        with signals.uninterrupted():
            with signals.uninterrupted():
                signal.raise_signal(signal.SIGUSR1)
                assert seen == []
            assert seen == []  # still inside the outer section
        assert seen == [signal.SIGUSR1]
        with pytest.raises(RuntimeError, match="the handler's own error"), signals.uninterrupted():
            signal.raise_signal(signal.SIGUSR1)
        assert seen == [signal.SIGUSR1] * 2
        signal.raise_signal(signal.SIGUSR1)  # outside any section: at once
        assert seen == [signal.SIGUSR1] * 3
    finally:
        signal.signal(signal.SIGUSR1, previous)

def test_remove_leftovers_removes_the_staging_folders_that_a_signal_kept_from_their_removal(tmp_path):
    """A load's staging folder whose block a signal ended before its removal began (here: entered, never left)
    is removed by taskpoint.signals.remove_leftovers, the public call the command line makes after each command;
    a second call, and the block's own end after it, find nothing left to do."""
    from taskpoint import signals
    from taskpoint.workspace import Staging

    kept = Staging(tmp_path)
    folder = kept.__enter__()
    assert folder.is_dir()
    signals.remove_leftovers()
    assert not folder.exists()
    signals.remove_leftovers()
    kept.__exit__(None, None, None)
    assert list(tmp_path.iterdir()) == []


#: Ended by SIGTERM: 143 from taskpoint's handler, or -SIGTERM (the signal's default action) when the signal came
#: before main() installed the handler (interpreter start-up, imports) or after it returned (interpreter
#: shutdown), when there is nothing to clean up; a shell reports 143 for both.
ENDED_BY_SIGTERM = (128 + signal.SIGTERM, -signal.SIGTERM)


@contextlib.contextmanager
def both_cores_busy():
    """Two busy-loop processes for the duration of the block: a loaded machine."""
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        yield
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait(30)


def _terminated_when(args: list[str], env: dict[str, str], when) -> tuple[int, str]:
    """Run ``taskpoint ARGS``; send SIGTERM once ``when(seconds since the start)`` is true (polled every 0.2 ms),
    unless the command ended first. Its exit code and stderr."""
    proc = subprocess.Popen([sys.executable, "-m", "taskpoint", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    while proc.poll() is None and not when(time.monotonic() - start):
        time.sleep(0.0002)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    return proc.returncode, err


class _Trials:
    """SIGTERM trials against real `taskpoint pull` and `push` processes on one store, each checked at once:
    exit 143 (or 0 when the command ended first), no staging folder in DEST and either nothing or the whole
    result there; for a push, nothing committed and no half upload (a temp file, an unfinished multipart upload),
    or the whole step; and the previous step intact. ``rows`` keeps what each trial saw (for the report)."""

    def __init__(self, tmp_path: Path, base: str, options: dict, size: int) -> None:
        self.tmp, self.options = tmp_path, options
        self.env = {**os.environ, "TASKPOINT_STORAGE_OPTIONS": json.dumps(options)}
        self.src = tmp_path / "big"
        self.src.mkdir()
        for i in range(3):
            (self.src / f"w{i}.bin").write_bytes(os.urandom(size // 3))
        self.steps = f"{base}/steps"
        with CheckpointManager(self.steps, codec="none", storage_options=options, preemption=False) as mgr:
            mgr.save(self.src, 1)
        self.want = snapshot(self.src)
        self.rows: list[tuple[str, str, int, str]] = []
        self._count = 0

    def duration(self, command: str) -> float:
        """How long one whole run takes here (to spread the moments over it); asserts it succeeds."""
        start = time.monotonic()
        code, err = self._run(command, lambda elapsed: False)
        assert code == 0, err
        return time.monotonic() - start

    def at_delays(self, command: str, count: int) -> None:
        """``count`` moments from the first milliseconds to past the end of an undisturbed run."""
        end = 1.2 * self.duration(command)
        delays = [0.0, 0.001, 0.01] + [0.03 + k * (end - 0.03) / (count - 4) for k in range(count - 3)]
        for delay in delays:
            self._run(command, lambda elapsed, delay=delay: elapsed >= delay, f"{delay:.3f} s")

    def pull_when_staging_appears(self) -> None:
        """The moment of issue 21: DEST's staging folder was just made."""
        self._run("pull", lambda elapsed: self._dest_entries(), "staging folder made")

    def pull_while_publishing(self) -> None:
        """The first entry has landed in DEST, maybe not the others."""
        self._run("pull", lambda elapsed: any(not n.startswith(STAGING_PREFIX) for n in self._dest_entries()),
                  "publishing")

    def push_when_the_step_folder_fills(self) -> None:
        """Local disk: the payload's temp file was just made."""
        def writing(elapsed: float) -> bool:
            folder = Path(f"{self.steps}/ckpt-{100 + self._count}")
            return folder.is_dir() and any(folder.iterdir())

        self._run("push", writing, "writing the payload")

    def _dest_entries(self) -> list[str]:
        dest = self.tmp / f"dest{self._count}"
        return sorted(p.name for p in dest.iterdir()) if dest.is_dir() else []

    def _run(self, command: str, when, moment: str = "never") -> tuple[int, str]:
        self._count += 1
        n = self._count
        if command == "pull":
            args = ["pull", self.steps, str(self.tmp / f"dest{n}"), "--step", "1"]
        else:
            args = ["push", str(self.src), self.steps, "--step", str(100 + n), "--codec", "none"]
        code, err = _terminated_when(args, self.env, when)
        assert code == 0 or code in ENDED_BY_SIGTERM, (command, moment, code, err)
        assert "Traceback" not in err, err
        outcome = self._check_pull(n, code) if command == "pull" else self._check_push(100 + n, code)
        self.rows.append((command, moment, code, outcome))
        return code, err

    def _check_pull(self, n: int, code: int) -> str:
        entries = self._dest_entries()
        assert not [e for e in entries if e.startswith(STAGING_PREFIX)], entries  # no staging folder, ever
        if entries:
            assert snapshot(self.tmp / f"dest{n}") == self.want, entries  # never a partial result
        assert entries or code != 0
        return "whole" if entries else "nothing"

    def _check_push(self, step: int, code: int) -> str:
        with CheckpointManager(self.steps, storage_options=self.options, preemption=False) as mgr:
            listed = mgr.steps()
            assert 1 in listed
            if step in listed:
                assert snapshot(mgr.restore(step, into=self.tmp / f"back{step}")) == self.want
                return "committed"
        assert code != 0
        left = [p for p in fsspec_find(f"{self.steps}/ckpt-{step}", self.options) if p.endswith(".tmp")]
        assert left == [], left  # no half-written temp file
        from taskpoint.storage import Location

        uploads = Location(f"{self.steps}/ckpt-{step}", self.options).unfinished_uploads()
        assert uploads == [], uploads  # no upload left open (S3)
        return "nothing"

    def check_the_previous_step(self) -> None:
        with CheckpointManager(self.steps, storage_options=self.options, preemption=False) as mgr:
            assert snapshot(mgr.restore(1, into=self.tmp / "back1")) == self.want

    def report(self, title: str) -> None:
        print(f"\n{title}: command, moment, exit code, what was left")
        for row in self.rows:
            print("  ", *row)


def fsspec_find(url: str, options: dict) -> list[str]:
    fs, path = fsspec.core.url_to_fs(url, **options)
    fs.invalidate_cache()
    try:
        return list(fs.find(path))
    except FileNotFoundError:
        return []


class _SigtermAt:
    """Sends this process a real SIGTERM as a pull is about to do something (an audit event, ``sys.addaudithook``;
    the handler runs at once, inside the hook, so the operation itself does not happen): make its staging folder
    in DEST (``os.mkdir``), move the *second* entry of the verified result into DEST (``os.rename``, which
    ``os.replace`` raises: the first is in DEST already), or remove the staging folder (``shutil.rmtree``). Once
    per arming; an audit hook stays for the process's life, so it is disarmed after."""

    installed: _SigtermAt | None = None

    def __init__(self) -> None:
        self.event: str | None = None
        self.dest: Path | None = None
        self.skip = 0
        self.fired = False
        sys.addaudithook(self._hook)

    @classmethod
    def get(cls) -> _SigtermAt:
        if cls.installed is None:
            cls.installed = cls()
        return cls.installed

    def arm(self, event: str, dest: Path, skip: int = 0) -> None:
        self.event, self.dest, self.skip, self.fired = event, dest, skip, False

    def disarm(self) -> None:
        self.event = None

    def _hook(self, event: str, args: tuple) -> None:
        if self.fired or event != self.event or self.dest is None:
            return
        path = Path(os.fsdecode(args[0])) if args and isinstance(args[0], (str, bytes, os.PathLike)) else None
        if path is None:
            return
        staging = path.name.startswith(STAGING_PREFIX) and path.parent == self.dest
        publishing = event == "os.rename" and path.parent.name.startswith(STAGING_PREFIX) and \
            path.parent.parent == self.dest
        if staging or publishing:
            if self.skip:
                self.skip -= 1
                return
            self.fired = True
            self.event = None
            signal.raise_signal(signal.SIGTERM)


#: (audit event, matching events to let pass first) of each moment.
_MOMENTS = {"making-staging": ("os.mkdir", 0), "publishing": ("os.rename", 1), "removing-staging": ("shutil.rmtree", 0)}


@pytest.mark.parametrize("moment", list(_MOMENTS))
@pytest.mark.parametrize("kind", ["payload-step", "dedup-step", "checkpoint"])
def test_a_sigterm_the_moment_a_pull_reaches_each_step_of_its_staging_leaves_nothing_half_done(
        capsys, tmp_path, kind, moment):
    """Interleavings of issue 21 built on purpose with a real signal: the pull (in this process, as the command
    line runs it) gets SIGTERM as it is about to make its staging folder in DEST, to move the second entry of the
    verified result into DEST (the first is there), or to remove its staging folder. It exits 143, leaves no
    staging folder, and DEST holds nothing or the whole result, never a part."""
    model = make_tree(tmp_path / "model", big=200_000)
    steps, uri = tmp_path / "steps", tmp_path / "ckpt"
    if kind == "checkpoint":
        assert tp(capsys, "push", model, uri)[0] == 0
        args = ["pull", uri]
    else:
        assert tp(capsys, "push", model, steps, "--step", 1, *(["--dedup"] if kind == "dedup-step" else []))[0] == 0
        args = ["pull", steps]
    dest = tmp_path / "dest"
    trap = _SigtermAt.get()
    trap.arm(*_MOMENTS[moment][:1], dest, _MOMENTS[moment][1])
    try:
        code, out, err = tp(capsys, *args, dest, *([] if kind == "checkpoint" else ["--step", "1"]))
    finally:
        trap.disarm()
    assert trap.fired, "the pull never reached that moment"
    assert code == 143 and "terminated (SIGTERM)" in err, (code, out, err)
    entries = sorted(p.name for p in dest.iterdir()) if dest.exists() else []
    assert not [e for e in entries if e.startswith(STAGING_PREFIX)], entries
    if entries:
        assert snapshot(dest) == snapshot(model), entries
    assert bool(entries) == (moment != "making-staging")  # once verified and moving in, all of it lands


def test_a_sigterm_whose_handler_lands_in_a_weakref_callback_is_delivered_again_not_lost():
    """Python runs a signal's handler between any two bytecodes, also a garbage-collection callback's, which
    cannot raise: the command line's SIGTERM exception would be printed as "Exception ignored" and the signal
    lost (met in the campaign's SIGTERM trials). It is raised again and ends the command once out of the callback."""
    from taskpoint.cli import _app

    class Thing:
        pass

    def callback(_ref: object) -> None:
        signal.raise_signal(signal.SIGTERM)
        for _ in range(1000):  # the handler runs here, inside the callback
            pass

    with pytest.raises(_app._Terminated), _app._ended_by_signals():
        thing = Thing()
        ref = weakref.ref(thing, callback)
        del thing
        deadline = time.monotonic() + 30  # the signal comes again 10 ms later; bounded, on a busy machine too
        while time.monotonic() < deadline:
            time.sleep(0.005)
    assert ref() is None


@pytest.mark.e2e("starts a python process")
def test_sigterm_at_many_moments_of_pull_and_push_on_a_loaded_machine_leaves_nothing_half_done(tmp_path):
    """Real SIGTERMs at moments spread over whole pulls and pushes (from the first milliseconds to past the end),
    the moment DEST's staging folder is made, during the publish and while the payload is written, with both
    cores busy: never a staging folder or a partial result, never a half upload, the previous step intact."""
    trials = _Trials(tmp_path, str(tmp_path / "store"), {}, size=48 << 20)
    with both_cores_busy():
        for command in ("pull", "push"):
            trials.at_delays(command, 7)
        for _ in range(3):
            trials.pull_when_staging_appears()
        trials.pull_while_publishing()
        trials.push_when_the_step_folder_fills()
    trials.check_the_previous_step()
    trials.report("SIGTERM trials, local disk, both cores busy")
    assert any(code in ENDED_BY_SIGTERM for _, _, code, _ in trials.rows)


@pytest.mark.slow
@pytest.mark.campaign("20 moments per command, idle and loaded, local and S3, 30 at the staging folder's creation")
@pytest.mark.parametrize("loaded", [False, True], ids=["idle", "loaded"])
def test_sigterm_at_many_moments_of_pull_and_push_many_trials(where, tmp_path, loaded):
    base, _, options = where
    trials = _Trials(tmp_path, base, options, size=96 << 20)
    with both_cores_busy() if loaded else contextlib.nullcontext():
        for command in ("pull", "push"):
            trials.at_delays(command, 20)
        if not options:  # local disk: the moments seen in its folders
            for _ in range(30):
                trials.pull_when_staging_appears()
            for _ in range(5):
                trials.pull_while_publishing()
                trials.push_when_the_step_folder_fills()
    trials.check_the_previous_step()
    trials.report(f"SIGTERM trials, {'S3' if options else 'local disk'}, {'both cores busy' if loaded else 'idle'}")
