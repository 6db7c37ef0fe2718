"""The typed storage errors: each StorageError subclass, raised by the real servers and by local disk.

``StorageUnavailable`` after retries, ``StorageAccessDenied`` (not retried, naming the credential source and
never its value), ``StorageNotFound`` for a missing bucket or container, ``StorageFull`` for a full
destination or a full local disk under a load, and a plain ``StorageError`` for what no retry can fix. A full
disk is a real tmpfs of 1 MiB mounted by the test (skipped where this process may not mount one).
"""

from __future__ import annotations

import base64
import errno
import json
import os
import re
from collections.abc import Callable
from typing import TypeVar

import pytest

from _faults import closed_port_url
from helpers import CountingRetry, fast_counting, mounted_tmpfs
from taskpoint import (
    Checkpoint,
    CheckpointCorruptError,
    CheckpointError,
    CheckpointManager,
    StorageAccessDenied,
    StorageError,
    StorageFull,
    StorageNotFound,
    StorageUnavailable,
)
from taskpoint.storage import Location
from taskpoint.storage.errormap import Failure, classify, describe

T = TypeVar("T")


# -- unavailable: transient, retried, then raised -----------------------------------------------------------


def test_an_unreachable_server_is_storage_unavailable_after_every_retry(s3_store):
    """Every operation that met the closed port is attempted exactly the policy's 3 times. Counted per operation,
    not per save: a new Checkpoint's first save sends the record's read, its create and the folder check at once
    (record.py), and each is retried on its own, except the folder check, which is cut short when the create
    fails (it starts no attempt after that, record_writes.SaveState._beside). The operation that runs another
    inside it (the payload's write, whose hook writes the record) ends after one attempt with the inner one's
    StorageUnavailable: retries are never multiplied."""
    options = {**s3_store.storage_options, "endpoint_url": closed_port_url(),
               "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}}
    retry = fast_counting()
    with pytest.raises(StorageUnavailable, match="3 attempts") as info:
        Checkpoint(s3_store.url("d"), storage_options=options, retry=retry).save_sync(b"x")
    assert isinstance(info.value, StorageError)
    check = [op for op in retry.operations if op.action == "check"]
    met = [op for op in retry.operations
           if op not in check and not isinstance(op.outcomes[-1], StorageUnavailable)]
    assert "read" in [op.action for op in met], retry.operations  # the record's read: the save's first
    assert all(op.attempts == 3 and None not in op.outcomes for op in met), retry.operations
    assert all(op.attempts == 1 for op in retry.operations if op not in met and op not in check), retry.operations
    assert len(check) == 1 and check[0].attempts <= 3 and None not in check[0].outcomes, retry.operations


# -- access denied: not retried, the credential source named, never a value ---------------------------------


def test_missing_s3_credentials_are_access_denied_naming_the_default_chain(s3_store, monkeypatch, tmp_path):
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "no-credentials"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "no-config"))
    options = {k: v for k, v in s3_store.storage_options.items() if k not in ("key", "secret")}
    retry = fast_counting()
    cp = Checkpoint(s3_store.url("d"), s3_store.url("prev"), storage_options=options, retry=retry)
    obstore = "s3_client" in options  # obstore: its own chain, and no probe of the metadata address
    with pytest.raises(StorageAccessDenied, match="obstore's default chain" if obstore else
                       "botocore's default chain") as info:
        cp.save_sync(b"x")
    _each_attempted_once(retry)  # not retried
    assert ("no S3 credentials" if obstore else "NoCredentialsError") in str(info.value)
    with pytest.raises(StorageAccessDenied):
        cp.load_sync()  # never "no checkpoint"


@pytest.mark.e2e("starts azurite")
def test_a_rejected_azure_key_is_access_denied_and_the_key_is_never_shown(azure_server):
    good = azure_server.storage_options["connection_string"]
    wrong_key = base64.b64encode(b"not-the-key-of-this-account" * 2).decode()
    options = {"connection_string": re.sub(r"AccountKey=[^;]+", f"AccountKey={wrong_key}", good)}
    retry = fast_counting()
    with pytest.raises(StorageAccessDenied, match="the connection string given in storage_options") as info:
        Checkpoint("az://taskpoint-tests/denied/ckpt", storage_options=options, retry=retry).save_sync(b"x")
    _each_attempted_once(retry)  # not retried
    assert wrong_key not in str(info.value) and wrong_key[:20] not in str(info.value)


def _each_attempted_once(retry: CountingRetry) -> None:
    """Each operation the save sent was attempted once: counted per operation, not per save, because a new
    Checkpoint's first save sends the record's read, its create and the folder check at once (record.py), and
    each meets the refusal on its own; the check may be cut short before its attempt, once the create was
    refused. The record's read, the save's first operation, is among them."""
    assert "read" in [op.action for op in retry.operations], retry.operations
    assert all(op.attempts == 1 for op in retry.operations if op.action != "check"), retry.operations
    assert all(op.attempts <= 1 for op in retry.operations), retry.operations


@pytest.mark.e2e("starts the GCS emulator")
def test_missing_google_default_credentials_are_access_denied(gcs_server, monkeypatch, tmp_path):
    monkeypatch.delenv("GOOGLE_APPLICATION_CREDENTIALS", raising=False)
    monkeypatch.setenv("CLOUDSDK_CONFIG", str(tmp_path / "no-gcloud"))
    monkeypatch.setenv("NO_GCE_CHECK", "true")
    options = {**gcs_server.storage_options, "token": "google_default"}
    with pytest.raises(StorageAccessDenied, match="Google application default credentials"):
        Checkpoint("gs://taskpoint-tests/denied/ckpt", storage_options=options).save_sync(b"x")


@pytest.mark.e2e("starts the GCS emulator")
def test_a_service_account_key_that_does_not_parse_is_access_denied(gcs_server, tmp_path):
    """gcsfs ends a key file whose private key does not parse in KeyError: 'refresh_token' (the campaign's
    secrets scenario found it escaping raw): it is StorageAccessDenied, naming no part of the key."""
    secret = "tp-KEY-SECRET-77aa"
    key = tmp_path / "key.json"
    key.write_text(json.dumps({"type": "service_account", "project_id": "test", "private_key_id": secret,
                               "private_key": f"-----BEGIN PRIVATE KEY-----\n{secret}\n-----END PRIVATE KEY-----\n",
                               "client_email": "x@test.iam.gserviceaccount.com", "client_id": "1",
                               "token_uri": closed_port_url() + "/token"}))
    options = {"token": str(key), "project": "test", "endpoint_url": gcs_server.endpoint}
    with pytest.raises(StorageAccessDenied, match="credentials could not be used") as caught:
        Checkpoint("gs://taskpoint-tests/key/a", storage_options=options).save_sync(b"x")
    assert secret not in str(caught.value)


def test_a_read_only_local_disk_is_access_denied_and_names_no_credentials(tmp_path):
    with mounted_tmpfs(tmp_path / "ro", "ro,size=1m") as folder, \
            pytest.raises(StorageAccessDenied, match="Read-only file system") as info:
        Checkpoint(folder / "ckpt").save_sync(b"x")
    assert "credentials" not in str(info.value)


# -- not found: the bucket or container -----------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["s3", "gcs", "azure"])
def test_saving_to_a_missing_bucket_is_storage_not_found(request, kind):
    server = request.getfixturevalue({"s3": "s3_server", "gcs": "gcs_server", "azure": "azure_server"}[kind])
    scheme = {"s3": "s3", "gcs": "gs", "azure": "az"}[kind]
    retry = fast_counting()
    with pytest.raises(StorageNotFound, match="does not exist"):
        Checkpoint(f"{scheme}://no-such-bucket-{os.getpid()}/run/ckpt", storage_options=server.storage_options,
                   retry=retry).save_sync(b"data")
    _each_attempted_once(retry)  # no retries


@pytest.mark.e2e("starts the S3 server")
def test_loading_from_and_listing_a_missing_bucket_is_storage_not_found(s3_server):
    missing = f"s3://no-such-bucket-{os.getpid()}"
    cp = Checkpoint(f"{missing}/x", f"{missing}/run/ckpt", storage_options=s3_server.storage_options)
    with pytest.raises(StorageNotFound):
        cp.load_sync()
    with CheckpointManager(f"{missing}/steps", storage_options=s3_server.storage_options) as m:
        with pytest.raises(StorageNotFound):
            m.steps()
        with pytest.raises(StorageNotFound):
            m.restore(1)  # a step asked for by number: still no "step 1 does not exist"
        with pytest.raises(StorageNotFound):
            m.metadata(1)


# -- full: the destination, or the local disk a load extracts to ----------------------------------------------




def test_a_full_destination_is_storage_full_and_the_previous_checkpoint_survives(tmp_path):
    with mounted_tmpfs(tmp_path / "small", "size=1m") as folder:
        Checkpoint(folder / "ckpt").save_sync(b"good")
        retry = fast_counting()
        with pytest.raises(StorageFull, match="no space left") as info:
            Checkpoint(folder / "ckpt", retry=retry).save_sync(os.urandom(2 << 20))
        assert retry.runs.count("save a checkpoint to") == 1, retry.runs  # the payload: not retried
        assert isinstance(info.value.__cause__, OSError) and info.value.__cause__.errno == errno.ENOSPC
        with Checkpoint(tmp_path / "next", folder / "ckpt") as cp:
            assert cp.load_sync().read_bytes() == b"good"
        assert [p.name for p in folder.iterdir() if p.name.endswith(".tmp")] == []  # no partial temp file left


def test_a_file_copied_by_the_kernel_into_a_full_destination_is_storage_full(tmp_path):
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(2 << 20))
    with mounted_tmpfs(tmp_path / "small", "size=1m") as folder, pytest.raises(StorageFull):
        Checkpoint(folder / "ckpt", retry=fast_counting()).save_sync(weights)


@pytest.mark.parametrize("kind", ["local", "s3"])
def test_a_load_into_a_full_local_disk_is_storage_full_not_an_outage(kind, request, tmp_path):
    if kind == "local":
        src, options = str(tmp_path / "store" / "ckpt"), None
    else:
        store = request.getfixturevalue("s3_server").new_location()
        src, options = store.url("ckpt"), store.storage_options
    tree = tmp_path / "tree"
    tree.mkdir()
    (tree / "weights.bin").write_bytes(os.urandom(2 << 20))
    Checkpoint(src, storage_options=options).save_sync(tree)
    with mounted_tmpfs(tmp_path / "small", "size=1m") as workspace:
        retry = fast_counting()
        with Checkpoint(tmp_path / "next", src, storage_options=options, workspace=workspace, retry=retry) as cp, \
                pytest.raises(StorageFull, match="local disk a load extracts to"):
            cp.load_sync()
        assert retry.runs.count("load the checkpoint from") == 1
        assert list(workspace.iterdir()) == []  # the staged part was removed


# -- broken: what retrying cannot fix --------------------------------------------------------------------------


def test_a_folder_is_no_raw_os_error_as_source_or_destination(tmp_path):
    # A folder source loads as a directory checkpoint (tests/test_folder_sources.py); a folder destination is
    # refused with a CheckpointError before anything is written.
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "f").write_bytes(b"x")
    with Checkpoint(tmp_path / "d", folder) as cp:
        assert (cp.load_sync() / "f").read_bytes() == b"x"
    with pytest.raises(CheckpointError, match="is a folder"):
        Checkpoint(folder).save_sync(b"x")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder"]


# -- the map itself, on the clients' own exception objects ------------------------------------------------------


def _client_error(code: str, status: int) -> Exception:
    from botocore.exceptions import ClientError

    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


def _wrapped(outer: BaseException, inner: BaseException) -> BaseException:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize(("make", "expected"), [
    (lambda: _client_error("SlowDown", 503), Failure.TRANSIENT),
    (lambda: _client_error("InternalError", 500), Failure.TRANSIENT),
    (lambda: _client_error("AccessDenied", 403), Failure.DENIED),
    (lambda: _client_error("NoSuchBucket", 404), Failure.NO_CONTAINER),
    (lambda: _client_error("NoSuchKey", 404), Failure.ABSENT),
    (lambda: _wrapped(PermissionError("denied"), _client_error("InvalidAccessKeyId", 403)), Failure.DENIED),
    (lambda: _wrapped(FileNotFoundError("gone"), _client_error("NoSuchBucket", 404)), Failure.NO_CONTAINER),
    (lambda: _wrapped(OSError(errno.EBUSY, "slow down"), _client_error("SlowDown", 503)), Failure.TRANSIENT),
    (lambda: __import__("botocore.exceptions").exceptions.NoCredentialsError(), Failure.DENIED),
    (lambda: __import__("botocore.exceptions").exceptions.ParamValidationError(report="bad"), Failure.BROKEN),
    (lambda: __import__("google.auth.exceptions").auth.exceptions.DefaultCredentialsError("none"), Failure.DENIED),
    (lambda: _azure("HttpResponseError", 503, "ServerBusy"), Failure.TRANSIENT),
    (lambda: _azure("ResourceNotFoundError", 404, "ContainerNotFound"), Failure.NO_CONTAINER),
    (lambda: _azure("ResourceNotFoundError", 404, "BlobNotFound"), Failure.ABSENT),
    (lambda: _azure("ClientAuthenticationError", 403, "AuthenticationFailed"), Failure.DENIED),
    (lambda: _wrapped(RuntimeError("Failed to upload block"), _azure("HttpResponseError", 400, "InvalidBlockList")),
     Failure.TRANSIENT),  # two writers racing on one blob: an unknown client error is retried
    (lambda: OSError("Forbidden: https://storage.googleapis.com/b/o"), Failure.DENIED),  # gcsfs's 403
    # obstore: its types, and the status and S3 code that only its text carries (as its answers read)
    (lambda: _obstore("NotFoundError", 404, "NoSuchBucket"), Failure.NO_CONTAINER),
    (lambda: _obstore("NotFoundError", 404, "NoSuchKey"), Failure.ABSENT),
    (lambda: _obstore("NotFoundError", 404, None), Failure.ABSENT),  # a HEAD: no body, no code
    (lambda: _obstore("PermissionDeniedError", 403, "AccessDenied"), Failure.DENIED),
    (lambda: _obstore("UnauthenticatedError", None, None), Failure.DENIED),
    (lambda: _obstore("GenericError", 503, "SlowDown"), Failure.TRANSIENT),
    (lambda: _obstore("GenericError", None, None), Failure.TRANSIENT),  # "error sending request": the network
    (lambda: _obstore("InvalidPathError", None, None), Failure.BROKEN),
    (lambda: OSError(_obstore_text(400, "EntityTooSmall")), Failure.BROKEN),  # its writer's close, refused
    (lambda: OSError(errno.ENOSPC, "No space left on device"), Failure.FULL),
    (lambda: OSError(errno.EDQUOT, "Disk quota exceeded"), Failure.FULL),
    (lambda: OSError(errno.EIO, "Input/output error"), Failure.TRANSIENT),
    (lambda: OSError(errno.ESTALE, "Stale file handle"), Failure.TRANSIENT),
    (lambda: OSError(errno.EACCES, "Permission denied"), Failure.DENIED),
    (lambda: IsADirectoryError(errno.EISDIR, "Is a directory"), Failure.BROKEN),
    (lambda: ConnectionResetError(), Failure.TRANSIENT),
    (lambda: TimeoutError(), Failure.TRANSIENT),
    (lambda: _wrapped(CheckpointCorruptError("bad gzip"), OSError(errno.EIO, "x")), Failure.PASS),
    (lambda: ValueError("programming error"), Failure.PASS),
])
def test_the_error_map_classifies_by_type_and_by_code(make: Callable[[], BaseException], expected: Failure):
    assert classify(make()) is expected


def _obstore_text(status: int | None, code: str | None) -> str:
    answer = (f" - Server returned non-2xx status code: {status} Status" if status else
              " - HTTP error: error sending request")
    body = f': <?xml version="1.0" encoding="utf-8"?><Error><Code>{code}</Code></Error>' if code else ""
    return f"Generic S3 error: Error performing PUT http://127.0.0.1:9/b/k in 3ms{answer}{body}"


def _obstore(name: str, status: int | None, code: str | None) -> Exception:
    import obstore.exceptions as obstore_errors

    return getattr(obstore_errors, name)(_obstore_text(status, code))  # type: ignore[no-any-return]


def _azure(name: str, status: int, code: str) -> Exception:
    import azure.core.exceptions as azure_errors

    exc = getattr(azure_errors, name)(message=f"{code} happened")
    exc.status_code, exc.error_code = status, code
    return exc  # type: ignore[no-any-return]


def test_messages_cut_signed_url_queries():
    exc = OSError("GET http://127.0.0.1:1/c/b?sv=2021&sig=SECRETSIGNATURE failed")
    assert "SECRETSIGNATURE" not in describe(exc)


def test_every_location_operation_maps_errors(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"")
    below_a_file = Location(str(blocker / "child"))
    with pytest.raises(StorageError):
        below_a_file.write_small(b"x")
    assert below_a_file.read_small() is None  # nothing can be there: absent, not an error
    assert below_a_file.list_names() == []
