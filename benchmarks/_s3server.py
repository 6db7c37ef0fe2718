"""moto's S3 on 127.0.0.1 in its own process, for the benchmark: ``python -m benchmarks._s3server``.

Uses the test suite's ``running_s3_server()`` (``tests/_servers.py``), prints one JSON line with the
endpoint and storage options, and serves until its standard input closes. Running it in a separate
process keeps moto's memory and CPU out of the measured process's RSS and GIL.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

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


def main() -> int:
    servers = load_test_servers()
    with servers.running_s3_server() as server:
        print(json.dumps({"endpoint": server.endpoint, "storage_options": server.storage_options,
                          "bucket": server.bucket}), flush=True)
        sys.stdin.read()  # until the benchmark closes our stdin (or dies)
    return 0


if __name__ == "__main__":
    sys.exit(main())
