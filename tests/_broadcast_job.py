"""The torchrun job of the broadcast restore tests (tests/e2e/test_broadcast_restore.py,
tests/e2e/test_broadcast_subgroups.py): :data:`WORLD` gloo ranks of tests/_broadcast_worker.py running phases."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from _fault_proxy import FaultProxy

WORKER = Path(__file__).parent / "_broadcast_worker.py"
TORCHRUN = Path(sys.executable).with_name("torchrun")
WORLD = 4
#: The bound on one torchrun job (4 workers import torch on 2 busy cores, then restore a few tens of MiB).
JOB_WITHIN = 300.0


def torchrun(phases: list[dict[str, Any]], ranks: dict[str, int] | None = None
             ) -> dict[str, dict[int, dict[str, Any]]]:
    """Run the worker's ``phases`` on 4 ranks; each phase's outcome by rank, from every rank unless ``ranks`` names
    how many report it (the job killed, and the test failed, after :data:`JOB_WITHIN` seconds)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen([str(TORCHRUN), "--standalone", f"--nproc-per-node={WORLD}", str(WORKER),
                             json.dumps(phases)], env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=JOB_WITHIN)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        raise AssertionError(f"torchrun did not end within {JOB_WITHIN} s:\n{err[-4000:]}") from None
    assert proc.returncode == 0, f"torchrun ended with {proc.returncode}:\n{err[-4000:]}"
    outcomes: dict[str, dict[int, dict[str, Any]]] = {}
    for line in out.splitlines():
        if line.startswith("{"):
            event = json.loads(line)
            outcomes.setdefault(event["name"], {})[event["rank"]] = event
    assert all(len(got) == (ranks or {}).get(name, WORLD) for name, got in outcomes.items()), (outcomes, err[-4000:])
    return outcomes


def phase(name: str, proxy: FaultProxy | None, server: Any, directory: str | list[str], call: str, broadcast: bool
          ) -> dict[str, Any]:
    options = server.storage_options
    if proxy is not None:
        options["endpoint_url"] = proxy.url
    return {"name": name, "directory": directory, "options": options, "call": call, "broadcast": broadcast}


def digests(outcome: dict[int, dict[str, Any]]) -> dict[int, Any]:
    """Each rank's sha256 (or its whole report, when it has none)."""
    return {rank: got.get("sha256", got) for rank, got in outcome.items()}
