"""The deterministic data set: built once into ``benchmarks/data/dataset`` and reused while its spec matches.

At ``size=1`` (the issue's sizes):

* ``checkpoint/``: 4 files of 224 MiB of float32 values drawn from a normal distribution, 1,000 JSON files
  of about 1 KiB under ``metadata/``, and a 64 MiB text training log;
* ``file/model.bin``: one 256 MiB file of float32 normal values;
* ``bytes/payload.bin``: the 64 MiB read into memory as the ``bytes`` payload;
* ``small/payload.bin``: 4 KiB read into memory as the ``small`` payload (not scaled).

``size`` scales every byte count but the small payload's, and the number of JSON files.
"""

from __future__ import annotations

import json
import random
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

MIB = 1 << 20
#: Bump when the generators change, so that an old data set is rebuilt.
GENERATOR_VERSION = 1
SEED = 20240607

WEIGHT_FILES = 4
WEIGHT_BYTES = 224 * MIB
JSON_FILES = 1000
JSON_BYTES = 1024
LOG_BYTES = 64 * MIB
FILE_BYTES = 256 * MIB
BYTES_PAYLOAD = 64 * MIB
#: The small-save payload (issue 11 item 19: latency of frequent small saves), the same at every size.
SMALL_PAYLOAD = 4 << 10

_FLOATS_PER_CHUNK = 4 * MIB  # 16 MiB of float32 per generator call
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Dataset:
    """Where the three payloads are and their logical sizes (the bytes a user asked to save)."""

    root: Path
    directory: Path
    file: Path
    bytes_file: Path
    sizes: dict[str, int]
    files: dict[str, int]

    def source(self, payload: str) -> Path:
        return {"directory": self.directory, "file": self.file, "bytes": self.bytes_file,
                "small": self.root / "small" / "payload.bin"}[payload]


def spec_for(size: float) -> dict[str, Any]:
    """The sizes the data set has at scale ``size``; a manifest with another spec means rebuild."""
    def scaled(n: int, quantum: int = 4) -> int:
        return max(quantum, int(n * size) // quantum * quantum)

    return {
        "generator": GENERATOR_VERSION,
        "seed": SEED,
        "size": size,
        "weight_files": WEIGHT_FILES,
        "weight_bytes": scaled(WEIGHT_BYTES),
        "json_files": max(1, round(JSON_FILES * size)),
        "json_bytes": JSON_BYTES,
        "log_bytes": scaled(LOG_BYTES, 1),
        "file_bytes": scaled(FILE_BYTES),
        "bytes_payload": scaled(BYTES_PAYLOAD),
        "small_payload": SMALL_PAYLOAD,
    }


def prepare(data_dir: Path, size: float, log: Any = print) -> Dataset:
    """The data set at ``size`` under ``data_dir``, reused when its manifest matches, else rebuilt."""
    spec = spec_for(size)
    root = data_dir / "dataset"
    manifest_path = data_dir / MANIFEST
    if manifest_path.exists():
        try:
            manifest = json.loads(manifest_path.read_text())
        except ValueError:
            manifest = {}
        if manifest.get("spec") == spec and _files_match(root, manifest.get("files", {})):
            log(f"data set: reusing {root} (size {size})")
            return _dataset(root, manifest["files"])
    log(f"data set: building {root} (size {size}) ...")
    manifest_path.unlink(missing_ok=True)
    if root.exists():
        shutil.rmtree(root)
    _build(root, spec)
    files = {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}
    manifest_path.write_text(json.dumps({"spec": spec, "files": files}, indent=1, sort_keys=True))
    return _dataset(root, files)


def _files_match(root: Path, files: dict[str, int]) -> bool:
    if not files:
        return False
    for rel, size in files.items():
        try:
            if (root / rel).stat().st_size != size:
                return False
        except OSError:
            return False
    return True


def _dataset(root: Path, files: dict[str, int]) -> Dataset:
    def total(prefix: str) -> int:
        return sum(n for rel, n in files.items() if rel.startswith(prefix + "/"))

    sizes = {"directory": total("checkpoint"), "file": total("file"), "bytes": total("bytes"),
             "small": total("small")}
    return Dataset(root, root / "checkpoint", root / "file" / "model.bin", root / "bytes" / "payload.bin",
                   sizes, files)


def _build(root: Path, spec: dict[str, Any]) -> None:
    ckpt = root / "checkpoint"
    (ckpt / "metadata").mkdir(parents=True)
    for i in range(spec["weight_files"]):
        name = f"model-{i + 1:05d}-of-{spec['weight_files']:05d}.bin"
        _write_normals(ckpt / name, spec["weight_bytes"], stream=i)
    for i in range(spec["json_files"]):
        (ckpt / "metadata" / f"rank-{i:04d}.json").write_bytes(_json_doc(i, spec["json_bytes"]))
    _write_log(ckpt / "train.log", spec["log_bytes"])
    (root / "file").mkdir()
    _write_normals(root / "file" / "model.bin", spec["file_bytes"], stream=100)
    (root / "bytes").mkdir()
    _write_normals(root / "bytes" / "payload.bin", spec["bytes_payload"], stream=200)
    (root / "small").mkdir()
    _write_normals(root / "small" / "payload.bin", spec["small_payload"], stream=300)


def _write_normals(path: Path, nbytes: int, stream: int) -> None:
    """``nbytes`` of float32 N(0, 0.02) values (like initialised weights), from generator ``stream``."""
    rng = np.random.default_rng([SEED, stream])
    remaining = nbytes // 4
    with open(path, "wb") as f:
        while remaining:
            n = min(remaining, _FLOATS_PER_CHUNK)
            (rng.standard_normal(n, dtype=np.float32) * np.float32(0.02)).tofile(f)
            remaining -= n


def _json_doc(i: int, target: int) -> bytes:
    """About ``target`` bytes of JSON: the per-rank state a trainer writes beside its weights."""
    rnd = random.Random(SEED * 1000 + i)
    doc: dict[str, Any] = {
        "rank": i, "step": 12000, "epoch": 3, "world_size": JSON_FILES,
        "rng": {"seed": rnd.getrandbits(32), "offset": rnd.randrange(1 << 20)},
        "optimizer": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.1},
        "loss_history": [],
    }
    while len(json.dumps(doc)) < target - 24:
        doc["loss_history"].append(round(rnd.uniform(1.5, 3.0), 6))
    return json.dumps(doc, indent=None).encode()


def _write_log(path: Path, nbytes: int) -> None:
    """``nbytes`` of a training log: timestamped lines of step, loss, learning rate and throughput."""
    rnd = np.random.default_rng([SEED, 300])
    written = 0
    step = 0
    with open(path, "wb") as f:
        while written < nbytes:
            n = 10_000
            loss = 2.0 + rnd.standard_normal(n) * 0.1
            gnorm = np.abs(rnd.standard_normal(n)) + 0.5
            tps = 12_000 + rnd.standard_normal(n) * 300
            lines = []
            for k in range(n):
                s = step + k
                lines.append(
                    f"2024-06-07T{(s // 3600) % 24:02d}:{(s // 60) % 60:02d}:{s % 60:02d}.{(s * 37) % 1000:03d}Z "
                    f"INFO train step={s:07d} loss={loss[k]:.6f} lr=3.000e-04 grad_norm={gnorm[k]:.4f} "
                    f"tokens_per_s={tps[k]:.1f}\n")
            chunk = "".join(lines).encode()[: nbytes - written]
            f.write(chunk)
            written += len(chunk)
            step += n


def remove(data_dir: Path) -> None:
    """Delete the data set and its manifest."""
    (data_dir / MANIFEST).unlink(missing_ok=True)
    shutil.rmtree(data_dir / "dataset", ignore_errors=True)


__all__ = ["Dataset", "prepare", "remove", "spec_for"]
