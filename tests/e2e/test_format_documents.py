"""docs/format.md names every document a run writes, including those that live for a moment only.

tests/test_format_doc.py lists what a run of the core's kinds *leaves* in a local directory; a lease, a rank's shard
record or a sweep's lock is removed again before the run ends and is never seen that way. Here the run goes to the
S3 server through our proxy (tests/_fault_proxy.py, no fault injected), which logs every request: every object a
write names (a PUT, a multipart upload's POST and its parts) must match a path of the specification's layout. The
run exercises every step kind (payload, directory, deduplicated with a delete and a sweep, several ranks, a torch
state dict, a DCP file set, a JAX PyTree where JAX is installed), a background save through the save process, an
overwrite, a restore (its lease) and a local tier promoting its steps. The single checkpoints of retried tasks and
their attempt markers are the layout's other half: tests/test_format_doc.py checks their names.
"""

from __future__ import annotations

import collections
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import pytest

from _fault_proxy import fault_proxy
from taskpoint import CheckpointManager
from test_format_doc import save_on_two_ranks, specified_names

#: Requests that create or write an object (a multipart upload is a POST, its parts PUTs to the same name).
WRITES = ("PUT", "POST")


def _written(log: collections.deque[list[Any]], bucket: str, prefix: str) -> set[str]:
    """The names, relative to ``prefix``, of the objects that the logged requests wrote."""
    start = f"/{bucket}/{prefix}/"
    return {unquote(path)[len(start):] for method, path, *_ in log
            if method in WRITES and unquote(path).startswith(start)}


@pytest.mark.slow
def test_every_object_a_run_writes_is_named_by_the_specification(s3_server: Any, tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    import taskpoint.torch as tp_torch

    source = tmp_path / "source"
    (source / "sub").mkdir(parents=True)
    (source / "sub" / "a.txt").write_text("a")
    prefix = f"documents-{uuid.uuid4().hex}"
    with fault_proxy(s3_server.endpoint, rate=0.0) as proxy:
        proxy.log = collections.deque()  # every request of the run, not the last few hundred
        options = {**s3_server.storage_options, "endpoint_url": proxy.url}
        directory = f"s3://{s3_server.bucket}/{prefix}/steps"
        with CheckpointManager(directory, storage_options=options) as manager:
            manager.save(source, 1, metadata={"loss": 0.5})
            manager.save(b"bytes", 2)
            manager.save(b"again", 2, overwrite=True)
            manager.save(b"in the background", 3, blocking=False)
            manager.wait_until_finished()
            manager.save(tp_torch.StateDict({"w": torch.arange(8.0)}), 4)
            assert manager.restore(2).read_bytes() == b"again"  # under a restore lease
        with CheckpointManager(directory, storage_options=options, dedup=True) as dedup:
            dedup.save(source, 5)
            (source / "sub" / "a.txt").write_text("b")
            dedup.save(source, 7)
            dedup.delete(5)
            dedup.gc(0)
        save_on_two_ranks(directory, 6, storage_options=options)
        with CheckpointManager(directory, storage_options=options) as manager:
            dcp.save({"w": torch.zeros(4)}, storage_writer=tp_torch.Writer.for_step(manager, 8), no_dist=True)
        with CheckpointManager(directory, storage_options=options, local_dir=tmp_path / "local") as tiered:
            tiered.save(b"local first", 9)
            tiered.wait_until_finished()
        jax_ran = _pytree(directory, options)
        log = list(proxy.log)
    written = _written(collections.deque(log), s3_server.bucket, prefix)
    names = {name.split("/", 1)[-1] if name.startswith("steps/") else name for name in written}
    steps = {name[len("steps/"):] for name in written if name.startswith("steps/")}
    must = {"ckpt-1/taskpoint.json", "ckpt-4/taskpoint.json", "ckpt-6/taskpoint.json", "ckpt-8/taskpoint.json",
            "ckpt-9/taskpoint.json", "leases/epoch", "ckpt-6/rank-1.json"}
    assert must <= steps, sorted(must - steps)  # the run did reach every kind, the ranks, the sweep and the tier
    assert any(name.startswith("leases/gc-") for name in steps) and any("/restore-" in name for name in steps)
    if jax_ran:
        assert "ckpt-10/taskpoint.json" in steps
    patterns = specified_names("{dir}/")
    unnamed = sorted(name for name in steps if not any(p.fullmatch(name) for p in patterns))
    assert unnamed == [], f"objects written that docs/format.md's layout of a manager's directory does not name; " \
                          f"all written: {sorted(names)}"


def _pytree(directory: str, options: dict[str, Any]) -> bool:
    """Step 10 as a JAX PyTree, where JAX and Orbax are installed; whether it ran."""
    try:
        import jax.numpy as jnp

        import taskpoint.jax as tp_jax
    except ImportError:
        return False
    with CheckpointManager(directory, storage_options=options) as manager:
        manager.save(tp_jax.PyTree({"w": jnp.arange(4.0)}), 10)
    return True
