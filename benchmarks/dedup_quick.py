"""A quick measurement of deduplicated steps (issue 15), small enough for the shared 2-core machine.

    PYTHONPATH=src:tests python benchmarks/dedup_quick.py [--mib 256] [--stores local,s3]

Part 1: per-chunk codecs on float32 weights (compress and inflate speed, ratio, one core).
Part 2: what fixed-size chunks reuse when a file's tensors are rewritten in place, and when a header grows.
Part 3: on local disk and on moto's S3 (in this process: slower than a real server), with ``--mib`` of float32
weights in 4 files: today's save and restore, a deduplicated first save, an unchanged step, a step where
10% of the bytes changed (one tensor region of one file), and the deduplicated restore.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np


def weights(shape: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    return (rng.standard_normal(shape).astype(np.float32) * 0.02).tobytes()


def codecs() -> None:
    import zstandard
    from isal import igzip

    data = weights(16 << 20 >> 2, 0)  # 16 MiB
    chunks = [data[i:i + (4 << 20)] for i in range(0, len(data), 4 << 20)]
    rows = []
    for name, comp, decomp in [
        ("zstd-1", lambda b: zstandard.ZstdCompressor(level=1).compress(b),
         lambda b: zstandard.ZstdDecompressor().decompress(b)),
        ("zstd-3", lambda b: zstandard.ZstdCompressor(level=3).compress(b),
         lambda b: zstandard.ZstdDecompressor().decompress(b)),
        ("gzip (isal 0)", lambda b: igzip.compress(b, 0), igzip.decompress),
        ("gzip (zlib 1)", lambda b: gzip.compress(b, 1), gzip.decompress),
        ("none", bytes, bytes),
    ]:
        t = time.perf_counter()
        blobs = [comp(c) for c in chunks]
        tc = time.perf_counter() - t
        t = time.perf_counter()
        for b in blobs:
            decomp(b)
        td = time.perf_counter() - t
        ratio = sum(map(len, blobs)) / len(data)
        rows.append((name, len(data) / tc / 1e6, len(data) / td / 1e6, ratio))
    t = time.perf_counter()
    for c in chunks:
        hashlib.sha256(c).digest()
    sha = len(data) / (time.perf_counter() - t) / 1e6
    print("\n| codec (one core, 4 MiB chunks of float32) | compress MB/s | inflate MB/s | stored/plain |")
    print("|---|---|---|---|")
    for name, c, d, r in rows:
        print(f"| {name} | {c:.0f} | {d:.0f} | {r:.3f} |")
    print(f"\nsha256 of the chunks: {sha:.0f} MB/s on one core")


def reuse() -> None:
    size = 4 << 20
    base = bytearray(weights(64 << 20 >> 2, 1))  # one 64 MiB file
    changed = bytearray(base)
    start = len(base) // 3
    span = len(base) // 10 // 4 * 4
    changed[start:start + span] = weights(span >> 2, 2)  # 10% rewritten in place

    def keys(b: bytes | bytearray) -> list[bytes]:
        return [hashlib.sha256(b[i:i + size]).digest() for i in range(0, len(b), size)]

    old = set(keys(base))
    new = keys(changed)
    shifted = keys(b"x" * 100 + bytes(base))  # a header grew by 100 bytes: every offset moves
    print("\n| case (64 MiB file, 4 MiB fixed chunks) | chunks reused |")
    print("|---|---|")
    print(f"| 10% of the tensors rewritten in place | {sum(k in old for k in new)}/{len(new)} |")
    print(f"| 100 bytes inserted at the front | {sum(k in old for k in shifted)}/{len(shifted)} |")


def end_to_end(mib: int, stores: list[str]) -> None:
    from taskpoint import CheckpointManager

    tmp = Path(tempfile.mkdtemp(prefix="dedup-bench-"))
    src = tmp / "src"
    src.mkdir()
    per_file = (mib << 20) // 4
    for i in range(4):
        (src / f"layer{i}.bin").write_bytes(weights(per_file >> 2, 10 + i))
    rows: list[tuple[str, str, float, float, float]] = []

    def timed(fn):  # type: ignore[no-untyped-def]
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    for store in stores:
        if store == "s3":
            sys.path.insert(0, "tests")
            from _servers import running_s3_server

            server_cm = running_s3_server()
            server = server_cm.__enter__()
            base, options = "s3://taskpoint-tests/bench", server.storage_options
        else:
            base, options = str(tmp / "store"), {}
        for name in ("plain", "dedup"):
            for i in range(4):
                (src / f"layer{i}.bin").write_bytes(weights(per_file >> 2, 10 + i))
            with CheckpointManager(f"{base}-{name}", storage_options=options, dedup=name == "dedup") as mgr:
                full = timed(lambda mgr=mgr: mgr.save(src, 1))
                sent = mgr._dedup.last.uploaded_bytes if name == "dedup" else mgr.last_save.bytes  # type: ignore
                rows.append((store, f"{name}: full save", full, sent / (mib << 20), 1.0))
                if name == "dedup":
                    same = timed(lambda mgr=mgr: mgr.save(src, 2))
                    rows.append((store, "dedup: nothing changed", same, mgr._dedup.last.uploaded_bytes / (mib << 20),
                                 same / full))
                    f = src / "layer1.bin"
                    data = bytearray(f.read_bytes())
                    span = (mib << 20) // 10 // 4 * 4
                    data[len(data) // 4:len(data) // 4 + span] = weights(span >> 2, 99)
                    f.write_bytes(bytes(data))
                    ten = timed(lambda mgr=mgr: mgr.save(src, 3))
                    rows.append((store, "dedup: 10% of the bytes changed", ten,
                                 mgr._dedup.last.uploaded_bytes / (mib << 20), ten / full))
                out = tmp / f"out-{store}-{name}"
                restore = timed(lambda mgr=mgr, out=out: mgr.restore(1, into=out))
                rows.append((store, f"{name}: restore", restore, 0.0, 0.0))
                shutil.rmtree(out)
        if store == "s3":
            server_cm.__exit__(None, None, None)
    print(f"\n| store | operation ({mib} MiB of float32 in 4 files) | seconds | uploaded / data | time / full save |")
    print("|---|---|---|---|---|")
    for store, what, secs, frac, rel in rows:
        print(f"| {store} | {what} | {secs:.2f} | {frac:.4f} | {rel:.3f} |")
    shutil.rmtree(tmp, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--stores", default="local,s3")
    args = parser.parse_args()
    codecs()
    reuse()
    end_to_end(args.mib, args.stores.split(","))


if __name__ == "__main__":
    main()
