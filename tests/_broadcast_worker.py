"""One rank of a gloo job for tests/e2e/test_broadcast_restore.py and ``benchmarks --methods broadcast``, started by the
real ``torchrun``: ``python tests/_broadcast_worker.py PHASES_JSON``.

Each rank joins one gloo process group (its collectives bounded by :data:`GROUP_TIMEOUT`), then runs the phases
of PHASES_JSON in order, each a dict: ``name``, ``directory`` (or a list of them: each rank's) and ``options``
(the manager's), ``call``
(``restore``: ``manager.restore(broadcast=...)`` of the newest step, its ``payload`` file hashed; ``in_place``:
the same through ``manager.restore_in_place(broadcast=...)``; ``pytree``: ``taskpoint.jax.load_pytree_sync(manager,
broadcast=...)``, its arrays hashed by :func:`arrays_digest`;
``state_dict``: ``taskpoint.torch.load_state_dict_sync(manager, broadcast=...)``, its tensors hashed by
:func:`tensors_digest`) and ``broadcast``; optionally ``commit_timeout`` (the manager's, which bounds each
collective) and ``absent`` (a rank that never takes part in the job's last phase, and then exits). Each rank
prints one JSON line per phase: ``{"event": "phase", "name", "rank", "sha256", "seconds"}`` (``seconds``: the
restore or load alone), or ``"error"`` (the exception's type) and ``"message"`` instead of ``sha256``; the ranks
meet at a monitored barrier between phases, so that each phase's requests reach the store apart.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import sys
import time
from collections.abc import Mapping
from typing import Any

#: How long a collective of this job waits (gloo's own timeout): well inside the test's bound on the job.
GROUP_TIMEOUT = datetime.timedelta(seconds=120)


def tensors_digest(state: Mapping[str, Any]) -> str:
    """The sha256 of a flat state dict's tensors' bytes, in key order: the same on every rank that loaded it."""
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].contiguous().numpy().tobytes())
    return digest.hexdigest()


def arrays_digest(tree: Mapping[str, Any]) -> str:
    """The sha256 of a flat tree's arrays' bytes, in key order (numpy or jax arrays alike)."""
    import numpy as np

    digest = hashlib.sha256()
    for key in sorted(tree):
        digest.update(key.encode())
        digest.update(np.asarray(tree[key]).tobytes())
    return digest.hexdigest()


def run(phase: dict[str, Any], rank: int) -> dict[str, Any]:
    import taskpoint
    import taskpoint.torch

    try:
        directory = phase["directory"][rank] if isinstance(phase["directory"], list) else phase["directory"]
        with taskpoint.CheckpointManager(directory, storage_options=phase["options"], preemption=False,
                                         commit_timeout=phase.get("commit_timeout", 600)) as manager:
            began = time.monotonic()
            if phase["call"] == "restore":
                folder = manager.restore(broadcast=phase["broadcast"])
                seconds = time.monotonic() - began
                digest = hashlib.sha256(folder.read_bytes()).hexdigest()
            elif phase["call"] == "in_place":
                with manager.restore_in_place(broadcast=phase["broadcast"]) as folder:
                    seconds = time.monotonic() - began
                    digest = hashlib.sha256(folder.read_bytes()).hexdigest()
            elif phase["call"] == "pytree":
                import taskpoint.jax

                tree = taskpoint.jax.load_pytree_sync(manager, broadcast=phase["broadcast"])
                seconds = time.monotonic() - began
                digest = arrays_digest(tree)
            else:
                state = taskpoint.torch.load_state_dict_sync(manager, broadcast=phase["broadcast"])
                seconds = time.monotonic() - began
                assert state is not None
                digest = tensors_digest(state)
    except Exception as exc:
        return {"error": type(exc).__name__, "message": str(exc)}
    return {"sha256": digest, "seconds": seconds}


def main() -> None:
    import torch.distributed as dist

    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    dist.init_process_group("gloo", timeout=GROUP_TIMEOUT)
    rank = dist.get_rank()
    for phase in json.loads(sys.argv[1]):
        if phase.get("absent") == rank:  # never takes part: the others' waits must end (the job's last phase)
            time.sleep(3 * phase["commit_timeout"])
            os._exit(0)
        outcome = run(phase, rank)
        # One write per line: the ranks share torchrun's stdout, unbuffered here (print writes the newline apart).
        sys.stdout.write(json.dumps({"event": "phase", "name": phase["name"], "rank": rank, **outcome}) + "\n")
        sys.stdout.flush()
        if "absent" in phase:  # the group is broken now: no collective, no teardown that could wait on it
            os._exit(0)
        dist.monitored_barrier(timeout=GROUP_TIMEOUT)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
