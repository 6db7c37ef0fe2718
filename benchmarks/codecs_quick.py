"""Per-core speed and ratio of the codecs a manager step could use, on weights and on a training log (issue 26).

``python -m benchmarks.codecs_quick [--mib 64] [--runs 5]``: one thread each, the best of ``--runs``, on float32
N(0, 0.02) values (what weights look like to a compressor) and on a text log, in 4 MiB pieces as the archive's
gzip members are. Rows: ISA-L gzip members at taskpoint's levels with the store probe (``pgzip.member`` with
``store``, as a manager's steps write them) and always compressed (as a Checkpoint's are), zstd at levels 1
and 3. Inflating includes the CRC32 (gzip) or the frame checksum (zstd) check. The figures behind the default
codec, docs/performance.md.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import numpy as np
import zstandard

from taskpoint.format import pgzip

PIECE = pgzip.MEMBER_SIZE


def _best(fn: Callable[[], object], runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def _each(fn: Callable[[bytes], bytes], items: list[bytes]) -> None:
    for item in items:
        fn(item)


def _codecs() -> dict[str, tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]]:
    def gzip_member(level: int, store: bool) -> Callable[[bytes], bytes]:
        return lambda data: pgzip.member(data, level, store)

    def zstd(level: int) -> tuple[Callable[[bytes], bytes], Callable[[bytes], bytes]]:
        c = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        d = zstandard.ZstdDecompressor()
        return c.compress, d.decompress

    inflate = pgzip.open_member
    return {"gzip isal 1, store probe": (gzip_member(1, True), inflate),
            "gzip isal 2, store probe": (gzip_member(2, True), inflate),
            "gzip isal 1, always": (gzip_member(1, False), inflate),
            "gzip isal 2, always": (gzip_member(2, False), inflate),
            "zstd 1": zstd(1), "zstd 3": zstd(3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    n = args.mib << 20
    data = {"weights": np.random.default_rng(0).normal(0, 0.02, n // 4).astype(np.float32).tobytes(),
            "log": b"".join(f"step {i} loss {1 / (i + 1):.6f} lr 0.001\n".encode() for i in range(n // 30))[:n]}
    print(f"{'codec':26} {'data':8} {'ratio':>6} {'pack MB/s':>10} {'inflate MB/s':>13}")
    for name, (pack, unpack) in _codecs().items():
        for label, blob in data.items():
            pieces = [blob[i:i + PIECE] for i in range(0, len(blob), PIECE)]
            packed = [pack(p) for p in pieces]
            assert b"".join(unpack(p) for p in packed) == blob
            pack_s = _best(functools.partial(_each, pack, pieces), args.runs)
            unpack_s = _best(functools.partial(_each, unpack, packed), args.runs)
            ratio = sum(map(len, packed)) / len(blob)
            print(f"{name:26} {label:8} {ratio:6.3f} {n / pack_s / 1e6:10.0f} {n / unpack_s / 1e6:13.0f}")


if __name__ == "__main__":
    main()
