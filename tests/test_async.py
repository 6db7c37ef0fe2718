"""The async API runs on asyncio and trio, and never blocks the event loop while it moves data."""

from __future__ import annotations

import anyio
import pytest

from helpers import make_tree, snapshot
from taskpoint import Checkpoint, StorageError


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request):
    return request.param


@pytest.mark.anyio
async def test_async_save_and_load_round_trip(store, tmp_path):
    src = make_tree(tmp_path / "src")
    dest = store.url("ckpt")
    cp = Checkpoint(dest, storage_options=store.storage_options)
    await cp.save(src)
    nxt = Checkpoint(store.url("next"), dest, storage_options=store.storage_options)
    assert await nxt.prev_exists_async()
    loaded = await nxt.load()
    assert snapshot(loaded) == snapshot(src)
    assert await nxt.load() == loaded
    await cp.save(b"bytes too")
    assert (await Checkpoint(store.url("n2"), dest, storage_options=store.storage_options).load()).read_bytes() \
        == b"bytes too"


@pytest.mark.anyio
async def test_event_loop_keeps_running_during_save_and_load(tmp_path):
    src = make_tree(tmp_path / "src", big=48 << 20)
    ticks = 0
    done = anyio.Event()

    async def ticker() -> None:
        nonlocal ticks
        while not done.is_set():
            ticks += 1
            await anyio.sleep(0)

    async with anyio.create_task_group() as tg:
        tg.start_soon(ticker)
        await Checkpoint(tmp_path / "ckpt").save(src)
        during_save = ticks
        await Checkpoint(tmp_path / "x", tmp_path / "ckpt").load()
        during_load = ticks - during_save
        done.set()
    assert during_save > 10 and during_load > 10


@pytest.mark.anyio
async def test_async_errors_are_the_sync_errors(tmp_path):
    cp = Checkpoint(tmp_path / "d")
    with pytest.raises(TypeError, match="bytes, bytearray"):
        await cp.save(12)
    with pytest.raises(FileNotFoundError, match="pass bytes"):
        await cp.save("some text")
    (tmp_path / "file").write_text("x")
    with pytest.raises(StorageError):
        await Checkpoint(tmp_path / "file" / "under-a-file").save(b"x")


@pytest.mark.anyio
async def test_concurrent_async_saves_to_different_destinations(store, tmp_path):
    async with anyio.create_task_group() as tg:
        for i in range(4):
            cp = Checkpoint(store.url(f"c{i}"), storage_options=store.storage_options)
            tg.start_soon(cp.save, f"payload {i}".encode())
    for i in range(4):
        got = await Checkpoint(store.url(f"n{i}"), store.url(f"c{i}"), storage_options=store.storage_options).load()
        assert got.read_bytes() == f"payload {i}".encode()
