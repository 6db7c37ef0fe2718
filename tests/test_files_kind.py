"""The core's kind of files (``manager/kinds/files.py``) under the extras' names, ``jax.pytree`` and ``fileset``
(DCP): what their steps share there, on local disk (files hashed by pieces on threads, through open fds) and on
memory:// (files streamed), with real Orbax and real DCP in this process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import fsspec
import numpy as np
import pytest

from helpers import LazyModule, requires
from taskpoint import CheckpointError, CheckpointManager
from test_progress import Recorder

pytestmark = requires("jax", "orbax.checkpoint", "torch")

tpjax = LazyModule("taskpoint.jax")
tpt = LazyModule("taskpoint.torch")
dcp = LazyModule("torch.distributed.checkpoint")
torch = LazyModule("torch")


def remove(store: Any, uri: str) -> None:
    if store.kind == "local":
        Path(uri).unlink()
    else:
        fsspec.filesystem(store.protocol, **store.fs_options).rm_file(uri)


@pytest.mark.parametrize("store", ["local", "memory"], indirect=True)
def test_a_pytree_step_verifies_counting_every_byte_of_its_files_and_names_the_one_missing(store: Any) -> None:
    tree = {"w": np.arange(300_000.0), "b": np.ones(7, dtype=np.float32), "step": 3}
    with CheckpointManager(store.url("m"), storage_options=store.storage_options) as m:
        m.save(tpjax.PyTree(tree), 1)
        files = m.describe(1).details
        recorder = Recorder()
        (checked,) = m.verify(1, progress=recorder).steps
        assert checked.state == "healthy" and checked.size == files["size"]
        assert checked.detail == f"{files['files']} files, sha256 match its manifest"
        recorder.assert_exact(files["size"])

        step_uri = m.step_uri(1)
        sidecar = f"{m.describe(1).payload.removesuffix('.files.json')}/taskpoint-pytree.json"
        remove(store, f"{step_uri}/{sidecar}")
        (row,) = m.verify().steps
        assert row.state == "damaged" and row.detail.endswith(f"is damaged: its file {sidecar} is missing")


def test_a_dcp_step_is_read_neither_in_place_nor_as_a_copy_but_verifies_file_by_file(tmp_path: Path) -> None:
    state = {"w": torch.arange(5000, dtype=torch.float32), "extra": {"step": 1}}
    with CheckpointManager(tmp_path / "m") as m:
        dcp.save(state, storage_writer=tpt.Writer.for_step(m, 1))
        with pytest.raises(CheckpointError, match=r"dcp\.load"), m.restore_in_place(1):
            pass
        with pytest.raises(CheckpointError, match=r"dcp\.load"):
            m.restore(1)
        (checked,) = m.verify(1).steps
        assert checked.state == "healthy" and checked.detail == f"{m.describe(1).details['files']} files, blake3 " \
                                                                 "match its manifest"
        (data,) = (tmp_path / "m" / "ckpt-1").glob("*.distcp")
        data.unlink()
        (row,) = m.verify().steps
        assert row.state == "damaged" and row.detail.endswith(f"is damaged: its file {data.name} is missing")
