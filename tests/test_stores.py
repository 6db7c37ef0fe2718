"""Smoke tests of the test stores themselves, through plain fsspec (no taskpoint code).

If these fail, every store-backed taskpoint test would fail for reasons that are not taskpoint's.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from typing import Any

import pytest

from _servers import StoreLocation, async_filesystem

SMALL = 1024
LARGE = 12 * 2**20  # > 2 blocks of 5 MiB: multipart / resumable uploads on every remote store
MiB = 2**20


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _write_in_chunks(f: Any, data: bytes, chunk: int = MiB) -> None:
    for start in range(0, len(data), chunk):
        f.write(data[start:start + chunk])


def test_store_location_is_fresh_and_urls_join_under_base(store: StoreLocation) -> None:
    fs = store.fs()
    assert not store.base.endswith("/")
    assert store.url("a", "b.bin") == f"{store.base}/a/b.bin"
    assert store.url("/a/", "b.bin") == f"{store.base}/a/b.bin"
    assert not fs.exists(store.url("anything"))


def test_objects_round_trip_with_ls_info_and_rm(store: StoreLocation) -> None:
    fs = store.fs()
    payloads = {"small.bin": os.urandom(SMALL), "dir/large.bin": os.urandom(LARGE)}

    for name, data in payloads.items():
        fs.makedirs(fs._parent(store.url(name)), exist_ok=True)  # a no-op on object stores
        with fs.open(store.url(name), "wb") as f:
            _write_in_chunks(f, data)

    for name, data in payloads.items():
        with fs.open(store.url(name), "rb") as f:
            assert _sha256(f.read()) == _sha256(data), name
        info = fs.info(store.url(name))
        assert info["size"] == len(data)
        assert info["type"] == "file"

    fs.invalidate_cache()
    top = sorted(p.rstrip("/") for p in fs.ls(store.base, detail=False))
    assert top == sorted([fs._strip_protocol(store.url("dir")), fs._strip_protocol(store.url("small.bin"))])
    assert fs.ls(store.url("dir"), detail=False) == [fs._strip_protocol(store.url("dir/large.bin"))]

    fs.rm(store.url("small.bin"))
    fs.rm(store.url("dir"), recursive=True)
    fs.invalidate_cache()
    for name in payloads:
        assert not fs.exists(store.url(name)), name


def test_async_api_round_trips_on_remote_stores(remote_store: StoreLocation) -> None:
    small, large = os.urandom(SMALL), os.urandom(LARGE)

    async def main() -> None:
        async with async_filesystem(remote_store) as fs:
            assert fs.asynchronous
            await asyncio.gather(
                fs._pipe_file(remote_store.url("async-small.bin"), small),
                fs._pipe_file(remote_store.url("async-large.bin"), large),
            )
            got_small, got_large = await asyncio.gather(
                fs._cat_file(remote_store.url("async-small.bin")),
                fs._cat_file(remote_store.url("async-large.bin")),
            )
            assert _sha256(got_small) == _sha256(small)
            assert _sha256(got_large) == _sha256(large)
            info = await fs._info(remote_store.url("async-large.bin"))
            assert info["size"] == LARGE
            await fs._rm(remote_store.url("async-small.bin"))
            fs.invalidate_cache()
            assert not await fs._exists(remote_store.url("async-small.bin"))

    asyncio.run(main())


def test_async_wrapper_round_trips_on_local_and_memory(tmp_path: Any) -> None:
    from uuid import uuid4

    locations = [StoreLocation("local", str(tmp_path)), StoreLocation("memory", f"memory://tp-{uuid4().hex}")]
    data = os.urandom(SMALL)

    async def main() -> None:
        for location in locations:
            async with async_filesystem(location) as fs:
                await fs._pipe_file(location.url("x.bin"), data)
                assert await fs._cat_file(location.url("x.bin")) == data
                await fs._rm(location.url("x.bin"))

    asyncio.run(main())
    memory_fs = locations[1].fs()
    if memory_fs.exists(locations[1].base):
        memory_fs.rm(locations[1].base, recursive=True)


class _Boom(Exception):
    """Raised by the test in the middle of a write."""


def _multipart_uploads(fs: Any, bucket: str, key: str) -> list[dict[str, Any]]:
    fs.invalidate_cache()
    response = fs.call_s3("list_multipart_uploads", Bucket=bucket, Prefix=key)
    return [u for u in response.get("Uploads", []) if u["Key"] == key]


def test_s3_discarded_multipart_write_leaves_no_object_and_no_upload(s3_store: StoreLocation) -> None:
    fs = s3_store.fs()
    url = s3_store.url("aborted.bin")
    bucket, key, _ = fs.split_path(url)
    data = os.urandom(LARGE)

    f = fs.open(url, "wb", block_size=5 * MiB)
    try:
        with pytest.raises(_Boom):
            for start in range(0, LARGE, MiB):
                f.write(data[start:start + MiB])
                if start >= 7 * MiB:
                    # One 5 MiB part is uploaded: the multipart upload exists on the server.
                    assert len(_multipart_uploads(fs, bucket, key)) == 1
                    raise _Boom
    finally:
        f.discard()
        f.closed = True

    assert _multipart_uploads(fs, bucket, key) == []
    fs.invalidate_cache()
    assert not fs.exists(url)
