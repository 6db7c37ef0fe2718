"""``taskpoint verify`` of a 256 MiB manager step (sha256) against a plain download of the same object (issue 14:
"takes at most 1.2x the time of downloading it"), on local disk and on moto's S3 server in its own process,
stock and with ranged GETs that read only their bytes (``--moto-fast-ranges``: stock moto reads the whole
object, and computes its ETag, for every range). Run: ``python -m benchmarks.verify_quick``."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import fsspec

import taskpoint
from taskpoint.cli import main as cli

from ._runner import open_store

SIZE = 256 << 20


def _measure(uri: str, options: dict[str, Any], work: Path, runs: int = 3) -> tuple[float, float]:
    tree = work / "tree"
    tree.mkdir(parents=True)
    for i in range(4):
        (tree / f"w{i}.bin").write_bytes(os.urandom(SIZE // 4))
    mgr = taskpoint.CheckpointManager(uri, storage_options=options, codec="none")
    mgr.save(tree, 1)
    described = mgr.describe(1)
    # The payload object, read with plain fsspec: the raw download that verify is compared with.
    fs, path = fsspec.core.url_to_fs(f"{described.uri.rstrip('/')}/{described.payload}",
                                     **{k: v for k, v in options.items() if k != "s3_client"})
    args = [f"-o{k}={v if isinstance(v, str) else json.dumps(v)}" for k, v in options.items()]
    download, verify = [], []
    for _ in range(runs):
        start = time.perf_counter()
        fs.get_file(path, str(work / "download.bin"))
        download.append(time.perf_counter() - start)
        os.remove(work / "download.bin")
        start = time.perf_counter()
        assert cli(["verify", uri, "--step", "1", *args]) == 0
        verify.append(time.perf_counter() - start)
    mgr.close()
    return statistics.median(download), statistics.median(verify)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="verify-quick-"))
    try:
        rows = [("local disk", *_measure(str(work / "local"), {}, work / "a"))]
        for fast in (False, True):
            with open_store("s3", (work / f"s3-{fast}").resolve(), print, fast_ranges=fast) as store:
                what = "moto, own process, " + ("ranges read only their bytes" if fast else "stock")
                figures = _measure(store.root + "/verify", store.storage_options, work / f"b{fast}")
                rows.append((f"S3 ({what})", *figures))
        data = os.urandom(SIZE)
        start = time.perf_counter()
        hashlib.sha256(data).hexdigest()
        hashing = time.perf_counter() - start
        print("| store | download (fs.get_file) | taskpoint verify | verify / download |\n|---|---|---|---|")
        for store_name, download, verify in rows:
            print(f"| {store_name} | {download:.3f} s | {verify:.3f} s | {verify / download:.2f} |")
        print(f"\nsha256 of the same 256 MiB in memory, one core: {hashing:.3f} s")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
