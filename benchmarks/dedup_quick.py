"""Quick measurements behind the choices of deduplicated steps (issue 15), one core, a few seconds.

    PYTHONPATH=src python benchmarks/dedup_quick.py

Part 1: per-chunk codecs on float32 weights (compress and inflate speed, ratio, one core).
Part 2: what fixed-size chunks reuse when a file's tensors are rewritten in place, and when a header grows.

The end-to-end saves and restores (today's format against deduplicated steps, on local disk and S3) are a
section of ``make bench``: ``python -m benchmarks --methods dedup`` (``benchmarks/_dedup.py``).
"""

from __future__ import annotations

import gzip
import hashlib
import time

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


def main() -> None:
    codecs()
    reuse()


if __name__ == "__main__":
    main()
