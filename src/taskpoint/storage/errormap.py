"""The typed error map at the storage boundary: what a client's exception means, and the error we raise for it.

Every read, write, listing and delete of a :class:`~taskpoint.storage.Location` runs inside
:func:`map_errors` (and its retries ask :func:`classify`). Exceptions are told apart by their type and by the
HTTP status or error code the client reports (botocore's ``response``, azure-core's ``status_code`` and
``error_code``, gcsfs's ``code``, aiohttp's ``status``, the status and S3 code in the text of obstore's errors,
the ``errno`` of an ``OSError``), walking the chain of causes because clients wrap each other (s3fs raises
``PermissionError`` from botocore's ``ClientError``).
Client classes are looked up only in modules already imported: an exception of a module's type cannot
exist before that module is loaded, so nothing heavy is imported here.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import errno
import http.client
import re
import sys
from collections.abc import Iterator

from ..errors import (
    CheckpointError,
    SaveStalledError,
    StorageAccessDenied,
    StorageError,
    StorageFull,
    StorageNotFound,
)


class Failure(enum.Enum):
    """What a storage exception means for the caller."""

    #: The object is not there. Reads decide what that means; for a write it is a missing container.
    ABSENT = "absent"
    #: The bucket or container does not exist.
    NO_CONTAINER = "no container"
    #: Credentials missing or rejected, or permissions forbid it.
    DENIED = "denied"
    #: No space left on a device or in a quota.
    FULL = "full"
    #: May pass on a retry: network, timeouts, throttling, 5xx answers, I/O errors.
    TRANSIENT = "transient"
    #: A storage failure that retrying cannot fix (a path that is a folder, a name the store refuses).
    BROKEN = "broken"
    #: Not a storage failure (taskpoint's own errors, programming errors): raised unchanged.
    PASS = "pass"


#: Error codes (S3, Azure) that name a missing bucket or container.
_NO_CONTAINER_CODES = frozenset({"NoSuchBucket", "ContainerNotFound", "ContainerBeingDeleted"})
#: Error codes of rejected credentials or missing permissions.
_DENIED_CODES = frozenset({
    "AccessDenied", "AccountProblem", "AllAccessDisabled", "ExpiredToken", "InvalidAccessKeyId",
    "InvalidSecurity", "InvalidToken", "NotSignedUp", "SignatureDoesNotMatch", "TokenRefreshRequired",
    "RequestTimeTooSkewed", "AuthenticationFailed", "AuthorizationFailure", "AuthorizationPermissionMismatch",
    "InsufficientAccountPermissions", "InvalidAuthenticationInfo", "NoAuthenticationInformation",
})
#: Error codes of throttling and server trouble.
_TRANSIENT_CODES = frozenset({
    "SlowDown", "RequestTimeout", "InternalError", "ServiceUnavailable", "Throttling", "ThrottlingException",
    "RequestLimitExceeded", "ServerBusy", "OperationTimedOut", "InternalServerError",
})
#: errno values of a full device or quota.
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
#: errno values of a permission problem.
_DENIED_ERRNOS = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})
#: errno values that retrying cannot fix.
_BROKEN_ERRNOS = frozenset({
    errno.EISDIR, errno.ENOTDIR, errno.EEXIST, errno.ENAMETOOLONG, errno.EINVAL, errno.ENOTEMPTY, errno.ENOSYS,
    errno.ELOOP, errno.EXDEV, getattr(errno, "EREMCHG", errno.ENOENT), getattr(errno, "EMSGSIZE", errno.EINVAL),
})
#: Client exceptions that mean "credentials missing or unusable", by module and class name.
_CREDENTIAL_TYPES = (
    ("botocore.exceptions", ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                             "NoAuthTokenError", "TokenRetrievalError", "UnauthorizedSSOTokenError")),
    ("google.auth.exceptions", ("DefaultCredentialsError", "RefreshError")),
    ("azure.core.exceptions", ("ClientAuthenticationError",)),
    ("obstore.exceptions", ("UnauthenticatedError", "PermissionDeniedError")),
)
#: Client exceptions of the transport (connection, timeout, truncated answer).
_TRANSPORT_TYPES = (
    ("botocore.exceptions", ("HTTPClientError", "ConnectionError", "IncompleteReadError", "ResponseStreamingError")),
    ("aiohttp", ("ClientError",)),
    ("azure.core.exceptions", ("ServiceRequestError", "ServiceResponseError", "IncompleteReadError")),
    ("google.auth.exceptions", ("TransportError",)),
    ("urllib3.exceptions", ("HTTPError",)),
)
#: The base classes of storage clients' own errors. One of these that says nothing more definite (an unknown
#: code: Azure's InvalidBlockList when two writers race on one blob, say) is retried, boundedly.
_CLIENT_TYPES = (
    ("botocore.exceptions", ("BotoCoreError", "ClientError")),
    ("azure.core.exceptions", ("AzureError",)),
    ("gcsfs.retry", ("HttpError",)),
    ("obstore.exceptions", ("BaseError",)),
)
#: Client exceptions of a request the client refused to send (bad parameters): not retried.
_INVALID_REQUEST_TYPES = (
    ("botocore.exceptions", ("ParamValidationError",)),
    ("obstore.exceptions", ("InvalidPathError", "UnknownConfigurationKeyError", "NotSupportedError")),
)
#: Exceptions that are programming errors or taskpoint's own: never reinterpreted as storage failures.
_OWN = (CheckpointError, ValueError, TypeError, NotImplementedError, ImportError, AttributeError, KeyError,
        AssertionError)


def _loaded(groups: tuple[tuple[str, tuple[str, ...]], ...]) -> tuple[type[BaseException], ...]:
    """The exception classes named in ``groups`` whose module is already imported."""
    found: list[type[BaseException]] = []
    for module_name, names in groups:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in names:
            cls = getattr(module, name, None)
            if isinstance(cls, type) and issubclass(cls, BaseException):
                found.append(cls)
    return tuple(found)


def chain(exc: BaseException) -> Iterator[BaseException]:
    """``exc`` and the exceptions it was raised from or during (clients such as adlfs wrap the real error)."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def code_and_status(exc: BaseException) -> tuple[str | None, int | None]:
    """The error code and HTTP status a storage client attached to ``exc``, where it did."""
    response = getattr(exc, "response", None)
    if isinstance(response, dict):  # botocore's ClientError
        error, meta = response.get("Error") or {}, response.get("ResponseMetadata") or {}
        status = meta.get("HTTPStatusCode")
        return error.get("Code"), status if isinstance(status, int) else None
    status = getattr(exc, "status_code", None)  # azure-core's HttpResponseError
    if isinstance(status, int):
        code = getattr(exc, "error_code", None)
        return (str(code) if code else None), status
    status = getattr(exc, "status", None)  # aiohttp's ClientResponseError
    if isinstance(status, int) and not isinstance(exc, OSError):
        return None, status
    if _from_obstore(exc):  # obstore gives the status and S3's code only in the text
        return _obstore_code_and_status(str(exc))
    if type(exc).__name__ == "HttpError" and type(exc).__module__.startswith("gcsfs"):
        code = getattr(exc, "code", None)
        return None, code if isinstance(code, int) else None
    return None, None


_OBSTORE_STATUS = re.compile(r"status code: (\d{3})")
_OBSTORE_CODE = re.compile(r"<Code>(\w+)</Code>")


#: How object_store words a store's error answer in the text of the plain OSError obstore's writer raises for it
#: (``The operation lacked the necessary privileges ...: Server returned non-2xx status code: 403 ...``).
_OBSTORE_ANSWER = "Server returned non-2xx status code"


def _from_obstore(exc: BaseException) -> bool:
    """An obstore error: its own types, and the plain OSError its writer raises (``Generic S3 error: ...``, or
    any text that quotes the store's answer)."""
    return type(exc).__module__ == "obstore.exceptions" or (
        type(exc) is OSError and (str(exc).startswith("Generic S3 error") or _OBSTORE_ANSWER in str(exc)))


def _obstore_code_and_status(text: str) -> tuple[str | None, int | None]:
    """The S3 error code and HTTP status in the text of an obstore error (``... non-2xx status code: 404 Not
    Found: <?xml ...><Code>NoSuchBucket</Code>...``); answers without a body (HEAD) carry only the status."""
    status, code = _OBSTORE_STATUS.search(text), _OBSTORE_CODE.search(text)
    return (code.group(1) if code else None), (int(status.group(1)) if status else None)


def _by_code(code: str | None, status: int | None) -> Failure | None:
    if code in _NO_CONTAINER_CODES:
        return Failure.NO_CONTAINER
    if code in _DENIED_CODES or status in (401, 403):
        return Failure.DENIED
    if code in _TRANSIENT_CODES or status in (408, 429) or (status is not None and status >= 500):
        return Failure.TRANSIENT
    if status == 404:
        return Failure.ABSENT
    return None


def _by_errno(exc: OSError) -> Failure:
    number = exc.errno
    if number is None and str(exc).startswith("Forbidden"):
        return Failure.DENIED  # gcsfs answers a 403 with a bare OSError("Forbidden: ...")
    if isinstance(exc, FileNotFoundError) or number == errno.ENOENT:
        return Failure.ABSENT
    if number in _FULL_ERRNOS:
        return Failure.FULL
    if isinstance(exc, PermissionError) or number in _DENIED_ERRNOS:
        return Failure.DENIED
    if isinstance(exc, (IsADirectoryError, NotADirectoryError, FileExistsError)) or number in _BROKEN_ERRNOS:
        return Failure.BROKEN
    return Failure.TRANSIENT  # EIO, ESTALE, ECONNRESET, ETIMEDOUT, EBUSY (S3's SlowDown), unknown codes


def _one(exc: BaseException) -> Failure | None:
    """What ``exc`` alone says; None when it says nothing definite."""
    if isinstance(exc, CheckpointError):
        return Failure.PASS
    code, status = code_and_status(exc)
    by_code = _by_code(code, status)
    if by_code is not None:
        return by_code
    if status == 400 and _from_obstore(exc):
        return Failure.BROKEN  # a request S3 refuses (EntityTooSmall...): s3fs makes these EINVAL
    if isinstance(exc, _loaded(_CREDENTIAL_TYPES)):
        return Failure.DENIED
    if isinstance(exc, _loaded(_INVALID_REQUEST_TYPES)):
        return Failure.BROKEN
    if isinstance(exc, OSError):  # ConnectionError, TimeoutError, requests' errors and ssl's are OSErrors
        return _by_errno(exc)
    if isinstance(exc, (asyncio.TimeoutError, http.client.HTTPException, *_loaded(_TRANSPORT_TYPES),
                        *_loaded(_CLIENT_TYPES))):
        return Failure.TRANSIENT
    if isinstance(exc, _OWN):
        return Failure.PASS
    return None


#: Failures that decide the meaning wherever they appear in the chain, strongest first.
_DECISIVE = (Failure.NO_CONTAINER, Failure.DENIED, Failure.FULL)


def classify(exc: BaseException) -> Failure:
    """What ``exc`` means. taskpoint's own errors pass unchanged; otherwise a missing container, a denial or a
    full disk anywhere in the chain decides; otherwise the outermost exception that says anything."""
    if isinstance(exc, CheckpointError) or not isinstance(exc, Exception):
        return Failure.PASS
    found = [_one(e) for e in chain(exc)]
    for decisive in _DECISIVE:
        if decisive in found:
            return decisive
    return next((f for f in found if f is not None), Failure.PASS)


def is_transient(exc: BaseException) -> bool:
    """True for failures that may pass on a retry: network errors, timeouts, throttling, 5xx answers."""
    return classify(exc) is Failure.TRANSIENT


class Symptom(enum.Enum):
    """What a transient failure says about the endpoint, for the advice of :class:`StorageUnavailable`; in the
    order of evidence (a refusal seen once says more than a timeout after it)."""

    #: Nothing accepted the connection (ECONNREFUSED): no server at that host and port.
    REFUSED = "refused"
    #: The connection attempt got no answer in time: packets dropped, or a wrong address.
    UNREACHABLE = "unreachable"
    #: Connected, then no answer in time (a client's read timeout).
    SILENT = "silent"
    #: No answer before taskpoint's deadline cancelled the call: connected or not, the client does not say (it
    #: may have been retrying refused connections on its own, as botocore does for about 15 s).
    NO_ANSWER = "no answer"


#: The advice for each symptom: what happened, and what to check.
SYMPTOM_ADVICE = {
    Symptom.REFUSED: "Nothing accepted a connection at the endpoint (connection refused): check that the storage "
                     "server runs and that the endpoint's host and port are right",
    Symptom.UNREACHABLE: "No answer came to the connection attempts (a firewall that drops packets, or a wrong "
                         "address, looks like this): check the endpoint's address and the network",
    Symptom.SILENT: "The endpoint accepted connections and did not answer in time (a stuck or overloaded server, or "
                    "a port that is not the storage service's, looks like this): check the storage service",
    Symptom.NO_ANSWER: "No answer came in time (nothing listening while the client retries on its own, or an "
                       "endpoint that accepts connections and never answers, looks like this): check the endpoint "
                       "and the storage service",
}
#: Client timeouts of a connection attempt, and of a connection's answer, by module and class name.
_CONNECT_TIMEOUT_TYPES = (
    ("botocore.exceptions", ("ConnectTimeoutError",)),
    ("aiohttp", ("ConnectionTimeoutError",)),
    ("urllib3.exceptions", ("ConnectTimeoutError",)),
)
_READ_TIMEOUT_TYPES = (
    ("botocore.exceptions", ("ReadTimeoutError",)),
    ("aiohttp", ("ServerTimeoutError",)),
    ("urllib3.exceptions", ("ReadTimeoutError",)),
)
#: How clients that keep only the text (obstore, azure-core) say that a connection was refused.
_REFUSED_TEXT = re.compile(r"connection refused|os error 111\b", re.IGNORECASE)
#: How obstore says that a request timed out (its error's text, reqwest's kind and source): without this, a request
#: to an endpoint that accepts connections and never answers ended at its timeout with advice that said nothing of it.
_TIMEOUT_TEXT = re.compile(r"\bkind: Timeout\b|\bTimedOut\b")


def symptom(exc: BaseException) -> Symptom | None:
    """What ``exc`` (a transient failure) says about the endpoint; None when it says nothing of it (a reset
    connection, a 5xx answer, throttling)."""
    found: set[Symptom] = set()
    for e in chain(exc):
        if isinstance(e, ConnectionRefusedError) or (isinstance(e, OSError) and e.errno == errno.ECONNREFUSED) \
                or _REFUSED_TEXT.search(str(e)):
            found.add(Symptom.REFUSED)
        elif isinstance(e, _loaded(_CONNECT_TIMEOUT_TYPES)):
            found.add(Symptom.UNREACHABLE)
        elif isinstance(e, _loaded(_READ_TIMEOUT_TYPES)):
            found.add(Symptom.SILENT)
        elif isinstance(e, (TimeoutError, asyncio.TimeoutError)) or _TIMEOUT_TEXT.search(str(e)):
            found.add(Symptom.NO_ANSWER)
    return strongest(found)


def strongest(found: set[Symptom]) -> Symptom | None:
    """The symptom that says the most of those ``found`` (see :class:`Symptom`)."""
    return next((s for s in Symptom if s in found), None)


_URL_QUERY = re.compile(r"(https?://[^\s?'\"]+)\?[^\s'\"]*")


def describe(exc: BaseException) -> str:
    """``Type: message`` of an exception, one line, with URL query strings (SAS tokens, signatures) cut."""
    text = " ".join(str(exc).split())
    text = _URL_QUERY.sub(r"\1?…", text)
    if len(text) > 300:
        text = text[:300] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def storage_error(exc: BaseException, failure: Failure, action: str, uri: str,
                  credentials: str | None) -> BaseException:
    """The StorageError for a failure that retrying cannot fix; ``exc`` itself when it is no storage failure.

    ``credentials`` says which credential source the store used (never a value); None on local disk.
    """
    what = describe(exc)
    if failure is Failure.DENIED:
        if credentials is None:
            return StorageAccessDenied(f"could not {action} {uri}: permission denied ({what}). Check the owner and "
                                       "mode of the path and its folders.")
        return StorageAccessDenied(f"could not {action} {uri}: access denied ({what}). taskpoint used {credentials}; "
                                   "check those credentials and the bucket's or container's policy.")
    if failure in (Failure.NO_CONTAINER, Failure.ABSENT):
        return StorageNotFound(f"could not {action} {uri}: the bucket, container or folder does not exist ({what}). "
                               "Create it, or fix the URI.")
    if failure is Failure.FULL:
        where = f" at {exc.filename}" if isinstance(exc, OSError) and exc.filename else ""
        return StorageFull(f"could not {action} {uri}: no space left{where} ({what}), on the destination or on the "
                           "local disk a load extracts to. Free some space and try again; nothing was lost.")
    if failure is Failure.BROKEN:
        return StorageError(f"could not {action} {uri}: {what}. Fix the location (is a parent path a file, or the "
                            "path a folder?) and try again.")
    return exc


def swept_while_written(path: str, what: str) -> SaveStalledError:
    """The error of a write whose unfinished object (``what``: a temp file, a multipart upload) a sweep removed
    while it was being written, taking it for a dead writer's leftover: the writer was stalled past the grace."""
    return SaveStalledError(
        f"{path} was not written: its {what} was removed while it was being written, by a sweep that took it for "
        "the leftover of a dead save (older than the sweep's grace period). This save was stalled (paused, frozen "
        "or starved) for longer than that, or another process sweeps with a shorter grace_seconds. Nothing was "
        "committed; save again.")


@contextlib.contextmanager
def map_errors(action: str, uri: str, credentials: str | None = None, *, writing: bool = False) -> Iterator[None]:
    """Raise storage failures inside the block as the matching StorageError subclass.

    Transient failures that outlived no retry policy and exceptions that are no storage failure pass
    unchanged. So does ``FileNotFoundError`` of a missing object when reading (readers decide whether absent
    is fine); when ``writing``, a missing object can only mean a missing bucket, container or folder.
    """
    try:
        yield
    except Exception as exc:
        failure = classify(exc)
        if failure in (Failure.PASS, Failure.TRANSIENT) or (failure is Failure.ABSENT and not writing):
            raise
        raise storage_error(exc, failure, action, uri, credentials) from exc
