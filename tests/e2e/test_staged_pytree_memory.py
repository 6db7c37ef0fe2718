"""The memory a save process holds while it writes a staged PyTree (issue 43): the segment, and no second copy
of any array, jax or numpy. Orbax, compressing, held each array it wrote a second time until its file was written
(0.8-0.9x the tree beside the segment at the peak, writing every array at once; 244 MiB for this tree, two arrays
of 32 MiB in flight at a time); the arrays are stored uncompressed, written from the segment's pages. Orbax's numpy
handler deep-copied every numpy array before writing it (768 MiB, the whole tree); ours writes them by
reference."""

from __future__ import annotations

import logging
import platform
import time
from pathlib import Path

import numpy as np
import pytest

from taskpoint import CheckpointManager

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

from taskpoint.jax import PyTree, load_pytree_sync  # noqa: E402

logger = logging.getLogger(__name__)

#: The tree: float32 arrays of ARRAY_BYTES, STATE_BYTES in all: many arrays, and four times the bytes the write has
#: in flight at a time (taskpoint.jax._pytree.WRITE_IN_FLIGHT_BYTES), so that a copy of those in flight shows.
STATE_BYTES, ARRAY_BYTES = 768 << 20, 32 << 20
#: The peak the save process may reach beyond what it held after the first save: less than one array, so that no
#: array is held a second time (measured: 8 MiB here at load 9; compressed, 244 MiB).
PEAK_BYTES = ARRAY_BYTES
#: The number of ``pselect6``, the call the save process's main thread waits for its next message in, once it has
#: released the memory of the last one (``select.select``, through glibc), per machine.
PSELECT6 = {"x86_64": 270, "aarch64": 72}
IDLE_WAIT_SECONDS = 120.0


def _idle(pid: int) -> None:
    """Until the save process's main thread waits for its next message: after the reply to a save, it releases the
    memory the write freed (``malloc_trim``), then waits there."""
    call = PSELECT6.get(platform.machine())
    if call is None:
        pytest.skip(f"the number of pselect6 on {platform.machine()} is not known here")
    began = logged = time.monotonic()
    while Path(f"/proc/{pid}/syscall").read_text().split()[0] != str(call):
        waited = time.monotonic() - began
        assert waited < IDLE_WAIT_SECONDS, f"the save process did not wait for a message within {waited:.0f} s"
        if time.monotonic() - logged >= 10:
            logger.info("waiting for the save process to wait for its next message, since %.0f s", waited)
            logged = time.monotonic()
        time.sleep(0.01)


def _status(pid: int, field: str) -> int:
    """A ``kB`` line of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), in bytes."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) << 10
    raise AssertionError(f"no {field} in /proc/{pid}/status")


@pytest.mark.parametrize("leaves", ["jax", "numpy"])
def test_a_save_process_writing_staged_pytrees_holds_the_segment_and_not_a_second_copy_of_the_tree(tmp_path, leaves):
    """The resident peak of the save process over later saves (the kernel's high-water mark, reset after the first
    save by ``clear_refs``: no sampling to miss it) stays within PEAK_BYTES above its resident size after
    the first save, which holds the segment and the imports of jax and Orbax, read once it released the memory that
    save freed."""
    rng = np.random.default_rng(0)
    tree = {f"layer{i}": rng.standard_normal(ARRAY_BYTES // 4, dtype=np.float32)
            for i in range(STATE_BYTES // ARRAY_BYTES)}
    if leaves == "jax":
        tree = {key: jnp.asarray(array) for key, array in tree.items()}
    with CheckpointManager(tmp_path / "ckpts", async_save=True, preemption=False) as m:
        m.save(PyTree(tree), 1)
        m.wait_until_finished()
        assert m._background.staging.ready is not None, "the tree was not staged (saved blocking)"
        saver = m._background.saver.pid
        _idle(saver)
        after_first = _status(saver, "VmRSS")
        assert after_first >= STATE_BYTES, "the save process does not hold the segment it wrote from"
        Path(f"/proc/{saver}/clear_refs").write_text("5")  # the high-water mark starts again from now
        for step in (2, 3):
            m.save(PyTree(tree), step)
            m.wait_until_finished()
        peak = _status(saver, "VmHWM")
        logger.info("save process: %d MiB resident after the first save, a peak of %d MiB over saves 2-3",
                    after_first >> 20, peak >> 20)
        assert m._background.saver.pid == saver, "the save process was replaced"
        assert peak - after_first <= PEAK_BYTES, (
            f"the save process peaked {(peak - after_first) >> 20} MiB above its {after_first >> 20} MiB after the "
            f"first save (the tree is {STATE_BYTES >> 20} MiB), over {PEAK_BYTES >> 20} MiB")
        restored = load_pytree_sync(m, step=3)
        assert all(np.array_equal(restored[key], tree[key]) for key in tree)
        assert all(isinstance(restored[key], np.ndarray) == (leaves == "numpy") for key in tree)
