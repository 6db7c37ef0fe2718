"""Connecting to a store: which client and which backend serve a URI.

The S3 client a location uses (s3fs, or obstore's fast path: :data:`S3_CLIENT_OPTION`), the clients'
per-request timeouts lowered to a short retry deadline, gcsfs's answers traced so its throttling is counted,
a credential failure told apart from a malformed option, and the backend picked by the filesystem's class
(:func:`backend_for`). :class:`~taskpoint.storage.location.Location` calls these once, when it is made.
"""

from __future__ import annotations

import os
import sys
import traceback
from typing import Any

from fsspec.implementations.local import LocalFileSystem

from ._obstore import require_obstore
from .backends import _OBJECT_STORES, Backend, MovingBackend, protocols
from .localdisk import LocalBackend
from .objectstores import AzureBackend, GCSBackend, ObjectStoreBackend, S3Backend
from .retry import CLIENT_TIMEOUT
from .throttle import gcs_trace


def client_timeouts(scheme: str, options: dict[str, Any], deadline: float | None) -> dict[str, Any]:
    """``options`` with the client's per-request timeouts lowered to ``deadline`` where it is shorter than
    :data:`CLIENT_TIMEOUT` and the caller set none: s3fs's ``config_kwargs`` connect and read timeouts,
    gcsfs's ``requests_timeout``, adlfs's ``connection_timeout`` and ``read_timeout``. Clients fix them when the
    filesystem is created, so they cannot shrink with the time left; the clients' own retries (botocore's,
    s3fs's, gcsfs's, the Azure SDK's) still multiply them.

    gcsfs given no ``requests_timeout`` bounds a request by aiohttp's default alone, five minutes in all, and
    retries it five times: an upload (gcsfs's file, a small object's too) or a delete to an endpoint that accepts
    connections and never answers, which taskpoint's deadline cannot interrupt, waited over 18 minutes (measured
    on 127.0.0.1, stopped there). It is given :func:`silence_bound` instead, as botocore's timeouts are."""
    lowered = deadline is not None and deadline < CLIENT_TIMEOUT
    out = dict(options)
    if scheme in ("s3", "s3a") and lowered:
        config = dict(out.get("config_kwargs") or {})
        config.setdefault("connect_timeout", deadline)
        config.setdefault("read_timeout", deadline)
        out["config_kwargs"] = config
    elif scheme in ("gs", "gcs"):
        out.setdefault("requests_timeout", deadline if lowered else silence_bound())
    elif scheme in ("az", "abfs", "abfss") and lowered:
        out.setdefault("connection_timeout", deadline)
        out.setdefault("read_timeout", deadline)
    return out


def silence_bound() -> Any:
    """An aiohttp ``ClientTimeout`` that ends a request whose connection or answer stays silent for
    :data:`CLIENT_TIMEOUT` (botocore's connect and read timeouts), and sets no bound on a request that moves: a
    large part over a slow link takes what it takes (:mod:`.stalls` watches its progress)."""
    import aiohttp

    return aiohttp.ClientTimeout(total=None, sock_connect=CLIENT_TIMEOUT, sock_read=CLIENT_TIMEOUT)


def watched(scheme: str, options: dict[str, Any]) -> dict[str, Any]:
    """``options`` with gcsfs's aiohttp session traced (:func:`~taskpoint.storage.throttle.gcs_trace`), so that
    each throttling answer its own retries absorb is counted; other clients are watched by their backend."""
    if scheme not in ("gs", "gcs"):
        return options
    session = dict(options.get("session_kwargs") or {})
    traces = list(session.get("trace_configs") or [])
    if gcs_trace() not in traces:
        traces.append(gcs_trace())
    session["trace_configs"] = traces
    return {**options, "session_kwargs": session}


#: The storage option, and the environment variable, that choose the client of ``s3://`` locations.
S3_CLIENT_OPTION = "s3_client"
S3_CLIENT_ENV = "TASKPOINT_S3_CLIENT"
#: The clients there are: s3fs (the default) and obstore (the fast path, extra ``taskpoint[obstore]``).
S3_CLIENTS = ("s3fs", "obstore")


def s3_client(scheme: str, options: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """The client for an ``s3://`` location (``storage_options["s3_client"]``, else ``$TASKPOINT_S3_CLIENT``,
    else s3fs), and the options without taskpoint's key, for fsspec. ImportError naming the extra when
    obstore is chosen and not installed; ValueError for an unknown client."""
    fs_options = {key: value for key, value in options.items() if key != S3_CLIENT_OPTION}
    chosen = options.get(S3_CLIENT_OPTION) or os.environ.get(S3_CLIENT_ENV) or "s3fs"
    if chosen not in S3_CLIENTS:
        raise ValueError(f"unknown S3 client {chosen!r} (storage option {S3_CLIENT_OPTION!r} or "
                         f"${S3_CLIENT_ENV}); choose one of {', '.join(S3_CLIENTS)}")
    if scheme not in ("s3", "s3a"):
        return "s3fs", fs_options
    if chosen == "obstore":
        require_obstore()
    return chosen, fs_options


def _is_instance(fs: Any, module: str, name: str) -> bool:
    """``isinstance(fs, module.name)`` without importing ``module`` (an instance implies it is loaded)."""
    cls = getattr(sys.modules.get(module), name, None)
    return isinstance(cls, type) and isinstance(fs, cls)


#: Where a client's credential loading lives: a KeyError or ValueError raised there is a bad key file or token
#: (gcsfs with a service-account file whose key does not parse ends in KeyError: 'refresh_token').
_CREDENTIAL_CODE = (f"{os.sep}gcsfs{os.sep}credentials.py", f"{os.sep}google{os.sep}auth{os.sep}",
                    f"{os.sep}google{os.sep}oauth2{os.sep}")


def raised_by_credentials(exc: BaseException) -> bool:
    """True when ``exc`` was raised inside a client's credential loading."""
    frames = traceback.extract_tb(exc.__traceback__)
    return any(any(part in frame.filename for part in _CREDENTIAL_CODE) for frame in frames)


def backend_for(fs: Any, options: dict[str, Any]) -> Backend:
    """The backend for a filesystem, by its class (and, for other object stores, by its protocol)."""
    if isinstance(fs, LocalFileSystem):
        return LocalBackend(fs, options)
    if _is_instance(fs, "s3fs", "S3FileSystem"):
        return S3Backend(fs, options)
    if _is_instance(fs, "gcsfs", "GCSFileSystem"):
        return GCSBackend(fs, options)
    if _is_instance(fs, "adlfs", "AzureBlobFileSystem"):
        return AzureBackend(fs, options)
    if _OBJECT_STORES.intersection(protocols(fs)):
        return ObjectStoreBackend(fs, options)
    return MovingBackend(fs, options)
