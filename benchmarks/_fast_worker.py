"""The worker of the ``fast`` section (issue 26 item 3): alternating rounds of each case, in one process.

Run as ``python -m benchmarks._fast_worker SPEC RESULT``; SPEC is the JSON :func:`benchmarks._fast.run` writes.
Every round times each method of each case once, in turn, starting at another method each round (so that a drift
of the machine, and what an operation inherits from the one before it, touch them alike),
after a ``sync`` and the runner's wait (``settle`` seconds); the result holds every round's seconds and CPU
seconds. Each restore is compared with what was saved after its clock stops.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import sys
import tarfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

#: The Flyte-style baseline's gzip level (Python's default, which flytekit's tar keeps).
BASELINE_LEVEL = 9


def _timed(fn: Callable[[], Any], settle: float) -> tuple[float, float, Any]:
    # Every operation starts with no dirty pages: the kernel throttles a writer once the dirty pages of everyone
    # pass its limits (here about 3 GiB), so an operation timed right after others wrote gigabytes (a round's
    # baseline and save) paid for their writeback: a directory restore took 2.9 s there and 1.4 s alone.
    os.sync()
    time.sleep(settle)
    cpu0, t0 = _cpu_seconds(), time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, _cpu_seconds() - cpu0, out


def _cpu_seconds() -> float:
    """CPU-seconds of this process and of the children it waited for (where an operation runs one)."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


class Cases:
    """Each case: ``name -> {method: (save, load, check)}``; built lazily so that a section alone imports
    only what it measures."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.work = Path(spec["work"])
        self.round = 0
        #: How each case checks what a load returned (after its clock).
        self.checks: dict[str, Callable[[Any], None]] = {}

    def fresh(self, name: str) -> Path:
        path = self.work / f"{name}-{self.round}"
        shutil.rmtree(path, ignore_errors=True)
        return path

    # -- a JAX PyTree ------------------------------------------------------------------------------------

    def pytree(self) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
        import jax
        import numpy as np
        import orbax.checkpoint as ocp

        from taskpoint import CheckpointManager
        from taskpoint.jax import PyTree, load_pytree_sync

        total, leaves = int(self.spec["pytree_bytes"]), 8
        rng = np.random.default_rng(0)
        tree = {f"layer{i}": {"kernel": jax.numpy.asarray(
            rng.normal(0, 0.02, total // leaves // 4).astype(np.float32))} for i in range(leaves)}
        tree["step"] = jax.numpy.asarray(7)
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, tree)
        checkpointer = ocp.StandardCheckpointer()
        state: dict[str, Any] = {}

        def orbax_save() -> None:
            state["orbax"] = self.fresh("orbax") / "tree"
            checkpointer.save(state["orbax"], tree)
            checkpointer.wait_until_finished()

        def orbax_load() -> Any:
            return checkpointer.restore(state["orbax"], abstract)

        def ours_save() -> None:
            folder = self.fresh("pytree-manager")
            state["manager"] = CheckpointManager(str(folder), keep=None)
            state["manager"].save(PyTree(tree), 1)

        def ours_load() -> Any:
            with state["manager"] as manager:
                return load_pytree_sync(manager, abstract, step=1)

        def check(restored: Any) -> None:
            for a, b in zip(jax.tree_util.tree_leaves(tree), jax.tree_util.tree_leaves(restored), strict=True):
                assert np.array_equal(np.asarray(a), np.asarray(b)), "a restored leaf differs"

        self.checks["pytree"] = check
        return {"orbax": (orbax_save, orbax_load), "taskpoint": (ours_save, ours_load)}

    # -- a torch state dict ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
        import torch

        from taskpoint import CheckpointManager
        from taskpoint.torch import StateDict, load_state_dict_sync

        total, tensors = int(self.spec["state_dict_bytes"]), 8
        generator = torch.Generator().manual_seed(0)
        sd = {f"layer{i}.weight": torch.randn(total // tensors // 4, generator=generator) * 0.02
              for i in range(tensors)}
        state: dict[str, Any] = {}

        def torch_save() -> None:
            path = self.fresh("torch") / "model.pt"
            path.parent.mkdir(parents=True)
            with open(path, "wb") as f:
                torch.save(sd, f)
                f.flush()
                os.fsync(f.fileno())
            state["torch"] = path

        def torch_load() -> Any:
            return torch.load(state["torch"], weights_only=True)

        def bytes_save() -> None:  # the way before StateDict: torch.save into bytes, saved as a raw payload
            buffer = io.BytesIO()
            torch.save(sd, buffer)
            state["bytes"] = CheckpointManager(str(self.fresh("sd-bytes")), keep=None)
            state["bytes"].save(buffer.getvalue(), 1)

        def bytes_load() -> Any:
            with state["bytes"] as manager:
                return torch.load(manager.restore(1), weights_only=True)

        def ours_save() -> None:
            state["manager"] = CheckpointManager(str(self.fresh("sd-manager")), keep=None)
            state["manager"].save(StateDict(sd), 1)

        def ours_load() -> Any:
            with state["manager"] as manager:
                return load_state_dict_sync(manager, 1)

        def check(restored: Any) -> None:
            assert restored.keys() == sd.keys() and all(torch.equal(sd[k], restored[k]) for k in sd)

        self.checks["state_dict"] = check
        return {"torch": (torch_save, torch_load), "taskpoint": (ours_save, ours_load),
                "bytes": (bytes_save, bytes_load)}

    # -- a plain directory step ----------------------------------------------------------------------------

    def directory(self) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
        from taskpoint import CheckpointManager

        source = Path(self.spec["directory"])
        state: dict[str, Any] = {}

        def raw_save() -> None:
            state["raw"] = self.fresh("raw")
            shutil.copytree(source, state["raw"])

        def raw_load() -> Path:
            out = self.fresh("raw-out")
            shutil.copytree(state["raw"], out)
            return out

        def baseline_save() -> None:
            folder = self.fresh("baseline")
            folder.mkdir(parents=True)
            state["baseline"] = folder / "checkpoint.tar.gz"
            with tarfile.open(state["baseline"], "w:gz", compresslevel=BASELINE_LEVEL) as tar:
                for entry in sorted(os.listdir(source)):
                    tar.add(source / entry, arcname=entry)

        def baseline_load() -> Path:
            out = self.fresh("baseline-out")
            with tarfile.open(state["baseline"], "r:gz") as tar:
                tar.extractall(out, filter="data")
            return out

        def ours_save() -> None:
            state["manager"] = CheckpointManager(str(self.fresh("dir-manager")), keep=None)
            state["manager"].save(source, 1)

        def ours_load() -> Path:
            out = self.fresh("dir-out")
            with state["manager"] as manager:
                return manager.restore(1, into=out)

        def check(restored: Path) -> None:
            for folder, _, files in os.walk(source):
                for name in files:
                    original = Path(folder, name)
                    copy = restored / original.relative_to(source)
                    assert copy.read_bytes() == original.read_bytes(), f"{copy} differs"

        self.checks["directory"] = check
        return {"raw": (raw_save, raw_load), "baseline": (baseline_save, baseline_load),
                "taskpoint": (ours_save, ours_load)}


    # -- issue 42: the stored format's costs against the plain operations ------------------------------------

    def plain(self) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
        """A plain directory step saved and restored, against a raw copy of the same files with fsync, and a raw
        copy back."""
        methods = self.directory()
        source, state = Path(self.spec["directory"]), {}

        def raw_fsync_save() -> None:
            state["raw"] = self.fresh("raw")
            shutil.copytree(source, state["raw"], copy_function=_copy_fsync)

        def raw_load() -> Path:
            out = self.fresh("raw-out")
            shutil.copytree(state["raw"], out)
            return out

        self.checks["plain"] = self.checks["directory"]
        return {"raw-fsync": (raw_fsync_save, raw_load), "taskpoint": methods["taskpoint"]}

    def verify(self) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
        """``CheckpointManager.verify`` of a directory step (its "load"), against reading the step's stored bytes
        once, unhashed; each saves the same step first (its "save")."""
        from taskpoint import CheckpointManager

        source, state = Path(self.spec["directory"]), {}

        def save(name: str) -> Callable[[], None]:
            def run() -> None:
                state[name] = self.fresh(name)
                with CheckpointManager(str(state[name]), keep=None) as manager:
                    manager.save(source, 1)
            return run

        def verify() -> Any:
            with CheckpointManager(str(state["verify"]), keep=None) as manager:
                return manager.verify(1).steps[0].healthy

        def read() -> Any:
            for path in sorted((state["read"] / "ckpt-1").iterdir()):
                with open(path, "rb", buffering=0) as f:
                    while f.read(READ_PIECE):
                        pass
            return True

        def check(healthy: Any) -> None:
            assert healthy is True, "the step did not verify"

        self.checks["verify"] = check
        return {"read": (save("read"), read), "taskpoint": (save("verify"), verify)}

    def dcp(self) -> dict[str, tuple[Callable[[], Any], Callable[[], Any]]]:
        """A DCP checkpoint of one process saved and loaded through DCP's own FileSystemWriter/Reader, and through
        taskpoint.torch's Writer/Reader of a manager step (every byte verified by its BLAKE3 pieces)."""
        import torch
        import torch.distributed.checkpoint as dcp

        from taskpoint import CheckpointManager
        from taskpoint.torch import Reader, Writer

        total, tensors = int(self.spec["state_dict_bytes"]), 8
        generator = torch.Generator().manual_seed(0)
        sd = {f"layer{i}.weight": torch.randn(total // tensors // 4, generator=generator) for i in range(tensors)}
        state: dict[str, Any] = {}

        def empty() -> dict[str, Any]:
            return {k: torch.empty_like(v) for k, v in sd.items()}

        def fs_save() -> None:
            state["fs"] = self.fresh("dcp-fs")
            dcp.save(sd, storage_writer=dcp.FileSystemWriter(str(state["fs"])))

        def fs_load() -> Any:
            target = empty()
            dcp.load(target, storage_reader=dcp.FileSystemReader(str(state["fs"])))
            return target

        def ours_save() -> None:
            state["manager"] = CheckpointManager(str(self.fresh("dcp-manager")), keep=None)
            dcp.save(sd, storage_writer=Writer.for_step(state["manager"], 1))

        def ours_load() -> Any:
            target = empty()
            with state["manager"] as manager:
                dcp.load(target, storage_reader=Reader.for_step(manager, 1))
            return target

        def check(restored: Any) -> None:
            assert all(torch.equal(sd[k], restored[k]) for k in sd), "a loaded tensor differs"

        self.checks["dcp"] = check
        return {"filesystem": (fs_save, fs_load), "taskpoint": (ours_save, ours_load)}


#: Bytes per read of the "read once" reference.
READ_PIECE = 8 << 20


def _copy_fsync(src: str, dst: str) -> str:
    """``shutil.copy2`` and an fsync of the copy: a raw copy as durable as a save."""
    shutil.copy2(src, dst)
    fd = os.open(dst, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    return dst


def main(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    cases = Cases(spec)
    built = {name: getattr(cases, name)() for name in spec["cases"]}
    out: dict[str, dict[str, dict[str, list[float]]]] = {}
    for number in range(int(spec["runs"])):
        cases.round = number
        for name, methods in built.items():
            # Each round starts the case at another method: an operation's cost depends on what ran just before it
            # (on this VM, bytes written into page-cache pages freshly taken from the host cost up to 3x the sys
            # time: a directory restore took 1.2 s alone and 3.0 s right after a raw copy of the same files), so
            # over the rounds every method takes every place in turn.
            order = list(methods.items())
            order = order[number % len(order):] + order[:number % len(order)]
            for method, (save, load) in order:
                row = out.setdefault(name, {}).setdefault(method, {"save": [], "load": [], "save_cpu": [],
                                                                   "load_cpu": []})
                seconds, cpu, _ = _timed(save, spec["settle"])
                row["save"].append(seconds)
                row["save_cpu"].append(cpu)
                seconds, cpu, restored = _timed(load, spec["settle"])
                row["load"].append(seconds)
                row["load_cpu"].append(cpu)
                cases.checks[name](restored)
                del restored
                print(f"  {name}/{method} round {number + 1}: save {row['save'][-1]:.3f} s, load "
                      f"{row['load'][-1]:.3f} s", flush=True)
            shutil.rmtree(cases.work, ignore_errors=True)
            cases.work.mkdir(parents=True)
    Path(result_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
