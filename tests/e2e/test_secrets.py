"""Credentials in storage_options never reach taskpoint's messages, reprs, warnings or log records.

Recognisable secrets go into the options; real errors are provoked on a real S3 server (an endpoint where
nothing listens, a bucket that does not exist, a background save that fails, a task whose root is
missing); every message, note, repr, warning and taskpoint log record seen on the way is searched."""

from __future__ import annotations

import logging
import traceback
import uuid
import warnings
from collections.abc import Callable
from typing import Any

import pytest

from _faults import closed_port_url
from taskpoint import Checkpoint, CheckpointManager, RetryPolicy, StorageError, ctx, task

KEY_ID = "AKIATPSECRETKEY7F3A"
SECRET = "tp-secret-value-9c1e52"
TOKEN = "tp-session-token-40d7"
SECRETS = (KEY_ID, SECRET, TOKEN)
FAST = RetryPolicy(attempts=2, initial_delay=0.01)


def _with_secrets(options: dict[str, Any], **changes: Any) -> dict[str, Any]:
    return {**options, "key": KEY_ID, "secret": SECRET, "token": TOKEN,
            "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}, **changes}


def _texts(exc: BaseException) -> list[str]:
    """Everything an error shows: message, repr and notes of it and of every exception in its chain, and the
    whole formatted traceback."""
    texts, seen, current = [], set(), exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        texts += [str(current), repr(current), *getattr(current, "__notes__", [])]
        current = current.__cause__ or current.__context__
    texts.append("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    return texts


def _assert_clean(texts: list[str], what: str) -> None:
    for text in texts:
        for secret in SECRETS:
            assert secret not in text, f"{what} shows a secret: {text[:2000]}"


def _provoke(call: Callable[[], object]) -> BaseException:
    with pytest.raises(Exception) as info:  # any error: what it shows is what is checked
        call()
    return info.value


def test_storage_errors_reprs_warnings_and_log_records_never_show_the_options(s3_server, caplog):
    good = _with_secrets(s3_server.storage_options)
    unreachable = _with_secrets(s3_server.storage_options, endpoint_url=closed_port_url())
    location = s3_server.new_location()
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:12]}"
    errors: list[BaseException] = []
    shown: list[str] = []

    with warnings.catch_warnings(record=True) as caught, caplog.at_level(logging.DEBUG, logger="taskpoint"):
        warnings.simplefilter("always")
        # An endpoint where nothing listens: save, existence check and load.
        for call in (
            lambda: Checkpoint(location.url("a"), storage_options=unreachable, retry=FAST).save_sync(b"x"),
            lambda: Checkpoint(location.url("b"), location.url("a"), storage_options=unreachable,
                               retry=FAST).prev_exists(),
            lambda: Checkpoint(location.url("b"), location.url("a"), storage_options=unreachable,
                               retry=FAST).load_sync(),
            lambda: CheckpointManager(location.url("m"), storage_options=unreachable, retry=FAST).steps(),
        ):
            errors.append(_provoke(call))
        # A bucket that does not exist: save, load, the manager's queries, a background save's error.
        for call in (
            lambda: Checkpoint(f"{missing}/a", storage_options=good).save_sync(b"x"),
            lambda: Checkpoint(location.url("c"), f"{missing}/a", storage_options=good).load_sync(),
            lambda: CheckpointManager(f"{missing}/m", storage_options=good).restore(),
        ):
            errors.append(_provoke(call))
        background = CheckpointManager(f"{missing}/bg", storage_options=good, background_process=False)
        background.save(b"x", 1, blocking=False)
        errors.append(_provoke(background.wait_until_finished))
        shown.append(repr(background))
        background.close()
        # The same in the save process, whose traceback comes back with the error.
        process = CheckpointManager(f"{missing}/proc", storage_options=good)
        process.save(b"x", 1, blocking=False)
        errors.append(_provoke(process.close))

        # A task whose root's bucket is missing, and one that works: its context, checkpoint and manager.
        @task(retries=1, root=f"{missing}/root", storage_options=good)
        def nowhere() -> None:
            pass

        errors.append(_provoke(nowhere))

        @task(retries=1, root=location.url("root"), storage_options=good)
        def somewhere() -> None:
            c = ctx()
            shown.extend([repr(c), str(c), repr(c.checkpoint), repr(c.checkpoints)])
            if c.attempt == 1:
                raise RuntimeError("fail once, so that an attempt failure is logged")

        somewhere()

    assert all(isinstance(e, StorageError) for e in errors), [type(e) for e in errors]
    for error in errors:
        _assert_clean(_texts(error), f"{type(error).__name__}")
    _assert_clean(shown, "a repr")
    _assert_clean([str(w.message) for w in caught], "a warning")
    _assert_clean([r.getMessage() for r in caplog.records if r.name.startswith("taskpoint")], "a log record")
    assert any("attempt 1 of 2" in r.getMessage() for r in caplog.records)  # the log was really captured
    assert len(shown) == 9 and all(shown)  # the background manager, then four per attempt


def test_a_rejected_key_is_access_denied_naming_its_source_never_its_value(azure_server):
    """azurite checks signatures: a wrong account key is refused, and the error says which credential was
    tried (the connection string) without showing it."""
    import base64

    from _servers import AZURITE_ACCOUNT
    from taskpoint import StorageAccessDenied

    wrong_key = base64.b64encode(b"tp-secret-azure-account-key-5b1f").decode()
    connection = (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={wrong_key};"
                  f"BlobEndpoint={azure_server.endpoint}/{AZURITE_ACCOUNT};")
    options = {"connection_string": connection}
    location = azure_server.new_location()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        errors = [_provoke(lambda: Checkpoint(location.url("a"), storage_options=options, retry=FAST).save_sync(b"x")),
                  _provoke(lambda: Checkpoint(location.url("b"), location.url("a"), storage_options=options,
                                              retry=FAST).load_sync()),
                  _provoke(lambda: CheckpointManager(location.url("m"), storage_options=options).steps())]
    assert all(isinstance(e, StorageAccessDenied) for e in errors), [repr(e) for e in errors]
    assert all("connection string given in storage_options" in str(e) for e in errors)
    for error in errors:
        for text in _texts(error):
            assert wrong_key not in text and connection not in text, text[:2000]
    for w in caught:
        assert wrong_key not in str(w.message)
