"""moto's S3 on 127.0.0.1 in its own process, for the benchmark: ``python -m benchmarks._s3server``.

Uses the test suite's ``running_s3_server()`` (``tests/_servers.py``), prints one JSON line with the
endpoint and storage options, and serves until its standard input closes. Running it in a separate
process keeps moto's memory and CPU out of the measured process's RSS and GIL.

``--fast-ranges``: stock moto answers a ranged GET by reading the *whole* object and then slicing it, so
one 8 MiB range of an 840 MiB object costs as much as the whole object (measured here: 16 MiB ranges take
0.045 s from a 64 MiB object and 0.39 s from an 840 MiB one). Real S3 reads only the range. With this
flag, a single ``Range: bytes=a-b`` GET reads only those bytes from moto's buffer, so clients that read
large objects in many ranges are not penalised for an artifact of the test server.
"""

from __future__ import annotations

import importlib.util
import json
import re
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import Any

_RANGE = re.compile(r"bytes=(\d+)-(\d*)")

REPO_ROOT = Path(__file__).resolve().parent.parent


def load_test_servers() -> ModuleType:
    """``tests/_servers.py`` imported by path (``tests`` is not a package)."""
    name = "taskpoint_test_servers"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "tests" / "_servers.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def serve_ranges_in_place() -> None:
    """Patch moto (in this process only) so a single-range GET reads just its bytes; see the module doc."""
    from moto.s3 import models, responses

    wanted = threading.local()
    stock_value = models.FakeKey.value
    stock_get_object = responses.S3Response.get_object

    def value(self: Any) -> bytes:
        request = getattr(wanted, "range", None)
        if request is None or request[0] >= self.size:
            return stock_value.fget(self)  # type: ignore[no-any-return]  # moto then answers 416 itself
        begin, end = request
        end = self.size - 1 if end is None else min(end, self.size - 1)
        with self.lock:
            self._value_buffer.seek(begin)
            data: bytes = self._value_buffer.read(end - begin + 1)
        wanted.served = (begin, end, self.size)
        return data

    def get_object(self: Any) -> Any:
        match = _RANGE.fullmatch(self.headers.get("range") or "")
        if match is None or self._get_int_param("partNumber"):
            return stock_get_object(self)
        wanted.range = (int(match.group(1)), int(match.group(2)) if match.group(2) else None)
        wanted.served = None
        try:
            status, headers, body = stock_get_object(self)
        finally:
            wanted.range = None
        if status != 200 or wanted.served is None:
            return status, headers, body
        begin, end, size = wanted.served
        for name in [h for h in headers if h.lower().startswith("x-amz-checksum-")]:
            del headers[name]  # as S3 and moto do for ranges
        headers["content-range"] = f"bytes {begin}-{end}/{size}"
        headers["content-length"] = str(len(body))
        return 206, headers, body

    models.FakeKey.value = property(value, stock_value.fset)  # type: ignore[method-assign,assignment]
    responses.S3Response.get_object = get_object  # type: ignore[method-assign]


def main() -> int:
    if "--fast-ranges" in sys.argv[1:]:
        serve_ranges_in_place()
    servers = load_test_servers()
    with servers.running_s3_server() as server:
        print(json.dumps({"endpoint": server.endpoint, "storage_options": server.storage_options,
                          "bucket": server.bucket}), flush=True)
        sys.stdin.read()  # until the benchmark closes our stdin (or dies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
