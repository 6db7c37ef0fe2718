"""Runs inside a venv with the real ``flyte`` package: saves or loads a checkpoint with flyte.Checkpoint.

Usage: python flyte_side.py save DEST (bytes HEX | path PATH)
       python flyte_side.py load SRC      -> prints JSON describing what flyte.Checkpoint.load_sync returned
"""

from __future__ import annotations

import json
import os
import pathlib
import sys

import flyte


def _describe(root: pathlib.Path) -> dict[str, object]:
    out: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(dirnames + filenames):
            p = pathlib.Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                out[rel] = ["link", os.readlink(p)]
            elif p.is_dir():
                out[rel] = ["dir"]
            else:
                out[rel] = ["file", p.read_bytes().hex()]
    return out


def main() -> None:
    action, uri = sys.argv[1], sys.argv[2]
    if action == "save":
        cp = flyte.Checkpoint(uri)
        kind, value = sys.argv[3], sys.argv[4]
        cp.save_sync(bytes.fromhex(value) if kind == "bytes" else pathlib.Path(value))
        return
    cp = flyte.Checkpoint(uri + ".unused-dest", uri)
    result = cp.load_sync()
    if result is None:
        print(json.dumps({"result": None}))
    elif result == cp.path:
        print(json.dumps({"result": "dir", "tree": _describe(result)}))
    else:
        print(json.dumps({"result": "payload", "name": result.name, "data": result.read_bytes().hex()}))


if __name__ == "__main__":
    main()
