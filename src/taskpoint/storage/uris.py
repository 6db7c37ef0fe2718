"""What a :class:`~taskpoint.storage.Location` accepts: a URI fsspec can take, and options its filesystem takes.

Both are checked once, where a Location is made, so that every entry point (``Checkpoint``, the manager, the
runtime's root, the command line) refuses the same mistakes with the same words. A malformed URL is never
taken for a local path: ``s3:/bucket/key`` (one slash) would otherwise save to a local folder ``./s3:`` and
die with the machine. An option the filesystem does not take is refused before it is silently ignored
(``memory://``, local disk, gcsfs) or fails at the first request (s3fs hands it to aiobotocore's session).
"""

from __future__ import annotations

import difflib
import functools
import importlib
import importlib.util
import inspect
import re
from typing import Any

import fsspec
from fsspec.registry import known_implementations, registry

#: The extra of taskpoint that installs the client of each object store it documents.
EXTRAS = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}

#: A string that starts like a URL without ``//``: a scheme of two or more characters and a colon (one letter
#: and a colon is a Windows drive).
_SCHEME_ONLY = re.compile(r"([A-Za-z][A-Za-z0-9+.\-]+):(?!//)(.*)", re.DOTALL)
#: Protocols fsspec takes without ``//`` (``data:text/plain;base64,...``).
_WITHOUT_SLASHES = frozenset({"data"})


def extra_for(protocol: str) -> str:
    """The ``pip install`` that brings the client of ``protocol``: taskpoint's extra where it has one."""
    extra = EXTRAS.get(protocol)
    if extra is not None:
        return f"pip install 'taskpoint[{extra}]'"
    implementation = known_implementations.get(protocol, {})
    return implementation.get("err") or f"install the fsspec implementation of {protocol}://"


def _known(protocol: str) -> bool:
    return protocol in registry or protocol in known_implementations


def usable_protocols() -> list[str]:
    """The protocols fsspec can open here: those registered, and those whose package is installed."""
    found = set(registry)
    for protocol, implementation in known_implementations.items():
        package = implementation["class"].split(".", 1)[0]
        if importlib.util.find_spec(package) is not None:
            found.add(protocol)
    return sorted(found)


def _protocols_here() -> str:
    """The protocols fsspec can use here, and the extras of taskpoint's stores that are not installed."""
    usable = usable_protocols()
    missing: dict[str, list[str]] = {}
    for protocol, extra in EXTRAS.items():
        if protocol not in usable:
            missing.setdefault(extra, []).append(protocol)
    text = f"Protocols fsspec can use here: {', '.join(usable)}."
    for extra, protocols in missing.items():
        text += f" {', '.join(protocols)}: pip install 'taskpoint[{extra}]'."
    return text


def check_uri(uri: str, what: str = "") -> None:
    """ValueError when ``uri`` looks like a URL but fsspec cannot take it as one: a protocol fsspec does not
    know (``s4://b/k``), or a known one without ``//`` (``s3:/b/k``, ``s3:b/k``, ``gs:/b``), which fsspec would
    take for a local path. The message names ``what`` (``$TASKPOINT_ROOT``) when given, the URI and what is wrong:
    for a known protocol without ``//`` the fixed URL first (and the install of its client, when missing); for an
    unknown one the protocols fsspec can use here. Each part of a chained URL (``simplecache::s3://...``) is
    checked."""
    shown = f"{what}={uri!r}" if what else repr(uri)
    for part in uri.split("::"):
        scheme, sep, rest = part.partition("://")
        if sep and len(scheme) > 1:  # one letter is a Windows drive, as fsspec has it
            if not _known(scheme):
                near = _near(scheme, [*usable_protocols(), *EXTRAS])
                hint = f" (did you mean {' or '.join(repr(p) for p in near)}?)" if near else ""
                raise ValueError(f"{shown} names the protocol {scheme!r}, which fsspec does not know{hint}. "
                                 f"{_protocols_here()}")
            continue
        malformed = _SCHEME_ONLY.fullmatch(part)
        if malformed is None:
            continue
        scheme, rest = malformed.group(1), malformed.group(2)
        if scheme.lower() in _WITHOUT_SLASHES or not _known(scheme.lower()):
            continue
        fixed = uri.replace(part, f"{scheme}://{rest.lstrip('/')}", 1)
        # The fix first and alone: the protocol is known, so the list of protocols would only bury it.
        client = "" if scheme.lower() in usable_protocols() else f" Its client is not installed: {extra_for(scheme)}."
        raise ValueError(
            f"{shown} is not a valid URL: did you mean {fixed!r}? ({scheme + ':'!r} must be followed by '//'; "
            f"taskpoint does not take it for a local path, so that nothing is saved to a local folder named "
            f"after a URL: write {'./' + uri!r} if that folder is meant.){client}")


def _near(name: str, candidates: list[str]) -> list[str]:
    """The candidates closest to ``name`` (a case-insensitive match first), at most two."""
    exact = [c for c in candidates if c.lower() == name.lower()]
    return exact[:1] or difflib.get_close_matches(name, sorted(set(candidates)), n=2, cutoff=0.5)


#: Options that every fsspec filesystem takes (its instance cache, listings cache and event loop).
FSSPEC_OPTIONS = frozenset({"skip_instance_cache", "use_listings_cache", "listings_expiry_time", "max_paths",
                            "asynchronous", "loop", "batch_size"})
#: fsspec's base classes: what their ``**kwargs`` take is :data:`FSSPEC_OPTIONS`; the rest they ignore.
_FSSPEC_BASES = frozenset({"fsspec.spec.AbstractFileSystem", "fsspec.asyn.AsyncFileSystem"})
#: Where filesystems that take ``**kwargs`` send the options they do not name: fsspec's base classes only, or
#: also a client whose signature says what it takes (s3fs: aiobotocore's session). A filesystem that takes
#: ``**kwargs`` and is not listed may send them anywhere (adlfs: to azure-identity): its options are not checked.
_FORWARDED: dict[str, tuple[str, ...]] = {
    "fsspec.implementations.local.LocalFileSystem": (),
    "fsspec.implementations.memory.MemoryFileSystem": (),
    "s3fs.core.S3FileSystem": ("aiobotocore.session.AioSession",),
    "gcsfs.core.GCSFileSystem": (),
    "gcsfs.extended_gcsfs.ExtendedGcsFileSystem": (),
}
#: Advice for names people reach for on S3, where the closest valid name alone would mislead.
_S3_ADVICE = {
    "endpoint": "endpoint_url=..., or client_kwargs={'endpoint_url': ...}",
    "endpoint_uri": "endpoint_url=..., or client_kwargs={'endpoint_url': ...}",
    "region": "client_kwargs={'region_name': ...}",
    "region_name": "client_kwargs={'region_name': ...}",
    "aws_access_key_id": "key=...",
    "aws_secret_access_key": "secret=...",
    "aws_session_token": "token=...",
    "profile_name": "profile=...",
}


def _named(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _parameters(fn: Any) -> tuple[set[str], bool]:
    """The keyword names ``fn`` takes, and whether it takes ``**kwargs`` too."""
    params = inspect.signature(fn).parameters.values()
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self"}
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


@functools.cache
def accepted_options(cls: type) -> frozenset[str] | None:
    """The storage options the filesystem class ``cls`` takes, from the signatures of its ``__init__`` methods
    and of the client it forwards the rest to; None when it forwards them somewhere this cannot know."""
    names = set(FSSPEC_OPTIONS)
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is object:
            continue
        own, open_ended = _parameters(init)
        names |= own
        if not open_ended or _named(klass) in _FSSPEC_BASES:
            continue
        targets = _FORWARDED.get(_named(klass))
        if targets is None:
            return None
        for target in targets:
            module, _, name = target.rpartition(".")
            names |= _parameters(getattr(importlib.import_module(module), name).__init__)[0]
    return frozenset(names)


def check_storage_options(uris: list[str], options: dict[str, Any]) -> None:
    """ValueError naming each option in ``options`` that none of the filesystems of ``uris`` takes (one dict of
    options serves a checkpoint's destination and source, which may be on different stores), the stores and the
    closest valid name; taskpoint's own options are taken out before. Not checked where a filesystem's options
    cannot be known: a chained URL (options per protocol), a filesystem that forwards them to an unknown place,
    a protocol fsspec does not know (:func:`check_uri` refuses it) or a missing client (making the filesystem
    says which extra to install). A malformed URI is refused first (:func:`check_uri`): its options mean nothing."""
    for uri in uris:
        check_uri(uri)
    if not options:
        return
    stores: dict[str, type] = {}
    for uri in uris:
        if "::" in uri:
            return
        protocol = uri.partition("://")[0] if "://" in uri else "file"
        try:
            stores.setdefault(protocol, fsspec.get_filesystem_class(protocol))
        except (ImportError, ValueError):
            return
    valid: set[str] = set()
    for cls in stores.values():
        accepted = accepted_options(cls)
        if accepted is None:
            return
        valid |= accepted
    unknown = sorted(name for name in options if name not in valid)
    if not unknown:
        return
    advice = _S3_ADVICE if {"s3", "s3a"} & set(stores) else {}
    hints = []
    for name in unknown:
        near = advice.get(name) or next(iter(difflib.get_close_matches(name, sorted(valid), n=1)), None)
        hints.append(f"{name!r} (did you mean {near}?)" if near else repr(name))
    where = " and ".join(f"{protocol}:// ({_named(cls)})" for protocol, cls in stores.items())
    raise ValueError(
        f"{' and '.join(dict.fromkeys(uris))}: {where} {'takes' if len(stores) == 1 else 'take'} no storage option "
        f"{' and no '.join(hints)}. The options {'it takes' if len(stores) == 1 else 'they take'}: "
        f"{', '.join(sorted(valid))}.")
