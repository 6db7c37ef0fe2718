"""Whether a stored document follows its specification (docs/format.md), field by field.

The readers (:mod:`.records`, :mod:`.fileset`) read leniently what they need: ``"size": "12"`` or a ``save_id`` of
the wrong length still reads, and a checked document's fields they do not know are ignored. A document whose
check matches yet whose fields break the specification was written by a writer other than taskpoint's, or by a
taskpoint with a bug; :func:`format_problems` names the first such field, so that ``taskpoint verify`` reports it
with the document (a step's manifest and file-set manifests, a checkpoint's record). Only the forms written now
are held to the tables here; older forms are checked by their readers (:mod:`.legacy`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from .documents import ATTEMPT_FORMAT, EPOCH_FORMAT, GROUP_FORMAT, LEASE_FORMAT
from .names import CHECKPOINT_FORMAT, FILESET_FORMAT, STEP_FORMAT

#: Checks one field's value; what it expected when it does not hold.
Rule = tuple[Callable[[Any], bool], str]

_HEX = {n: re.compile(f"[0-9a-f]{{{n}}}") for n in (8, 32, 64)}


def _hex(digits: int) -> Rule:
    return (lambda v: isinstance(v, str) and bool(_HEX[digits].fullmatch(v))), f"{digits} lower-case hex digits"


def _or_null(rule: Rule) -> Rule:
    return (lambda v: v is None or rule[0](v)), f"{rule[1]} or null"


def _of(*types: type) -> Rule:
    names = " or ".join(t.__name__ for t in types)
    return (lambda v: isinstance(v, types) and not (isinstance(v, bool) and bool not in types)), names


STR, INT, BOOL, OBJECT, LIST = _of(str), _of(int), _of(bool), _of(dict), _of(list)
NUMBER = _of(int, float)
NULL: Rule = (lambda v: v is None), "null"
SAVE_ID, SHA256, CRC32 = _hex(32), _hex(64), _hex(8)

#: By field: its rule and whether it must be there.
Fields = dict[str, tuple[Rule, bool]]

_STEP_HEADER: Fields = {
    "format": (STR, True), "version": (INT, True), "step": (INT, True), "kind": (STR, True), "codec": (STR, True),
    "save_id": (SAVE_ID, True), "created": (NUMBER, True), "size": (_or_null(INT), True),
    "sha256": (_or_null(SHA256), True), "crc32": (NULL, True), "blake3": (SHA256, False), "index": (OBJECT, False),
    "piece_size": (INT, False), "piece_hash": (STR, False), "pieces": (LIST, False),
    "attempt": (_or_null(INT), True), "metadata": (OBJECT, True), "check": (SHA256, True)}
#: A step manifest's own fields by version (1 to 3: the kind's fields at the top; 4 to 7: named, with content).
_STEP_CONTENT: dict[int, Fields] = {
    1: {"payload": (STR, True)}, 2: {"payload": (STR, True), "tree": (OBJECT, True)},
    3: {"payload": (STR, True), "shards": (LIST, True)},
    **{version: {"step_kind": (STR, True), "content": (OBJECT, True)} for version in (4, 5, 6, 7)}}
_ENTRY: Fields = {"kind": (STR, True), "codec": (STR, True), "save_id": (SAVE_ID, True), "created": (NUMBER, True),
                  "size": (INT, True), "crc32": (CRC32, True), "sha256": (NULL, True), "index": (OBJECT, False)}
_RECORD: Fields = {"format": (STR, True), "version": (INT, True), "objects": (LIST, True),
                   "confirmed": (_or_null(SAVE_ID), True), "sweep": (BOOL, False), "check": (CRC32, True)}
_FILESET: Fields = {"format": (STR, True), "version": (INT, True), "kind": (STR, True), "save_id": (SAVE_ID, True),
                    "created": (NUMBER, True), "attempt": (_or_null(INT), True), "metadata": (OBJECT, True),
                    "files": (OBJECT, True), "check": (SHA256, True)}
_FILE: Fields = {"size": (INT, True), "sha256": (SHA256, True), "piece_size": (INT, False),
                 "piece_hash": (STR, False), "pieces": (LIST, False)}
ANY: Rule = (lambda v: True), "any JSON"
#: The small documents (:mod:`.documents`): not sealed, each of version 1.
_SMALL: dict[str, Fields] = {
    LEASE_FORMAT: {"written": (NUMBER, True), "grace": (NUMBER, True), "beat": (NUMBER, False)},
    EPOCH_FORMAT: {"epoch": (SAVE_ID, True)},
    GROUP_FORMAT: {"round": (STR, True), "rank": (INT, True), "world_size": (INT, True), "host": (STR, True),
                   "pid": (INT, True), "at": (NUMBER, True), "value": (ANY, True)},
    ATTEMPT_FORMAT: {"attempt": (INT, True), "started": (NUMBER, True), "pid": (INT, True), "host": (STR, True),
                     "world_size": (INT, False)}}


def _fields(doc: Any, fields: Fields, where: str) -> str | None:
    """The first field of ``doc`` that breaks ``fields`` ("field `size`: expected int, found str"), or None."""
    if not isinstance(doc, dict):
        return f"{where}: expected a JSON object, found {type(doc).__name__}"
    for name, ((holds, expected), required) in fields.items():
        if name not in doc:
            if required:
                return f"field `{where}{name}`: missing (expected {expected})"
        elif not holds(doc[name]):
            return f"field `{where}{name}`: expected {expected}, found {type(doc[name]).__name__} {doc[name]!r:.40}"
    return None


def _first(*found: str | None) -> str | None:
    return next((each for each in found if each is not None), None)


def _step(doc: dict[str, Any]) -> str | None:
    version = doc.get("version")
    content = _STEP_CONTENT.get(version) if isinstance(version, int) else None
    if content is None:
        return f"field `version`: expected 1 to {max(_STEP_CONTENT)}, found {version!r}"
    return _fields(doc, {**_STEP_HEADER, **content}, "")


def _record(doc: dict[str, Any]) -> str | None:
    objects = doc.get("objects")
    entries = objects if isinstance(objects, list) else []
    return _first(_fields(doc, _RECORD, ""),
                  *(_fields(entry, _ENTRY, f"objects[{i}].") for i, entry in enumerate(entries)))


def _fileset(doc: dict[str, Any]) -> str | None:
    files = doc.get("files")
    listed = files.items() if isinstance(files, dict) else ()
    return _first(_fields(doc, _FILESET, ""), *(_fields(entry, _FILE, f"files[{name!r}].") for name, entry in listed))


_CHECKS: dict[str, Callable[[dict[str, Any]], str | None]] = {
    STEP_FORMAT: _step, CHECKPOINT_FORMAT: _record, FILESET_FORMAT: _fileset}
#: The first version of each format held to these tables (older ones: their readers in :mod:`.legacy`).
_HELD_SINCE = {CHECKPOINT_FORMAT: 2}


def document_problem(name: str, data: bytes | None) -> str | None:
    """What is wrong with the stored document ``name`` (its bytes ``data``; None: absent) by
    :func:`format_problems`, as a report says it; None when it follows the specification, is no sealed document,
    or is not JSON (its reader says so)."""
    try:
        doc = json.loads(data) if data is not None else None
    except ValueError:
        return None
    problem = format_problems(doc) if isinstance(doc, dict) else None
    return None if problem is None else f"{name} does not follow the stored format (docs/format.md): {problem}"


def format_problems(doc: dict[str, Any]) -> str | None:
    """The first field of the sealed (or small) document ``doc`` (parsed JSON, read already by its reader) that
    does not follow the specification, or None. A sealed document without a check is an older form: left to its
    reader."""
    small = _SMALL.get(str(doc.get("format")))
    if small is not None:
        return _fields(doc, {"format": (STR, True), "version": (_of(int), True), **small}, "")
    check = _CHECKS.get(str(doc.get("format")))
    version = doc.get("version")
    if check is None or "check" not in doc or not isinstance(version, int):
        return None
    if version < _HELD_SINCE.get(str(doc["format"]), 1):
        return None
    return check(doc)
