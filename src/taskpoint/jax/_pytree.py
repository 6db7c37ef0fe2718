"""A PyTree on local disk: array leaves in an Orbax PyTree checkpoint, everything else in a JSON sidecar.

Layout of a folder written by :meth:`Encoded.write`::

    taskpoint-pytree.json   the sidecar: the tree's structure and one record per leaf (kind, path, dtype,
                            shape, PRNG key implementation, and the values Orbax does not store)
    orbax/                  Orbax's standard PyTree checkpoint of the array leaves, a flat dict keyed by the
                            leaf's index in the sidecar (absent when the tree holds no non-empty array)

Orbax stores what it stores well (arrays, with their dtypes and shardings); the sidecar keeps what it
mangles or drops: strings (stored whole, not one leaf per character), Python scalars (with their exact
type and value), zero-size arrays (Orbax refuses them), the implementation of typed PRNG keys (Orbax sees
only their uint32 data), and the containers (dict, list, tuple, None) so that a tree comes back as it was
saved even without a target.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

#: Name of the sidecar inside a PyTree folder.
SIDECAR_NAME = "taskpoint-pytree.json"
#: Name of the Orbax checkpoint of the array leaves inside a PyTree folder.
ARRAYS_FOLDER = "orbax"
#: Version of the sidecar's format; a reader refuses a newer one.
FORMAT_VERSION = 1
#: Whether Orbax compresses the arrays it writes (zstd, its default): not. Orbax holds an array's compressed copy
#: until its file is written, and the arrays of a checkpoint barely compress, so compression cost memory and time
#: for little space: writing 4 arrays of 64 MiB (float32 N(0, 1)) from a tmpfs mapping took 118-178 MiB beside the
#: arrays and 0.55-1.05 s compressed (236 MiB of files), against 0-1 MiB and 0.24-0.46 s uncompressed (256 MiB), 5
#: rounds alternating at load 6-9 (issue 43). Orbax reads either (the arrays' metadata names the codec), so steps
#: written compressed before read as they did.
ARRAYS_COMPRESSED = False
#: The bytes of arrays Orbax writes at once (its ``save_concurrent_gb``, 96 GB unless given): two arrays of 64 MiB
#: at a time, one a core of this machine. An uncompressed jax array on the CPU is written from its own buffer (no
#: copy measured), so the bound costs no memory; it keeps a tree of many arrays from being written all at once.
WRITE_IN_FLIGHT_BYTES = 192 << 20
#: The payload kind of a PyTree (a :class:`~taskpoint.Checkpoint`'s, and the record of a manager's step).
PAYLOAD_KIND = "pytree"
#: The step kind a manager saves a PyTree as (:mod:`._kind`).
KIND = "jax.pytree"

# Leaf kinds recorded in the sidecar. Arrays live in Orbax (unless empty); the others in the sidecar.
JAX, NUMPY, NUMPY_SCALAR, KEY = "jax.Array", "numpy.ndarray", "numpy.generic", "jax.random.key"
STR, BOOL, INT, FLOAT, COMPLEX = "str", "bool", "int", "float", "complex"
_ARRAY_KINDS = frozenset({JAX, NUMPY, NUMPY_SCALAR, KEY})
_PY_SCALARS: dict[type, str] = {bool: BOOL, int: INT, float: FLOAT, complex: COMPLEX}

Path_ = tuple[str | int, ...]


class PyTree:
    """A JAX PyTree to save as a checkpoint: ``cp.save_sync(taskpoint.jax.PyTree(tree))``.

    The tree may nest dicts, lists, tuples, None and registered PyTree nodes (namedtuples, dataclasses
    registered with JAX, flax structs) around ``jax.Array``, numpy arrays, Python and numpy scalars, ``str``,
    typed PRNG keys (``jax.random.key``) and raw uint32 keys. It is serialized when the save starts, so the
    caller may change its arrays as soon as the save call returns. Load it with
    :func:`taskpoint.jax.load_pytree`.
    """

    __slots__ = ("tree",)

    def __init__(self, tree: Any) -> None:
        self.tree = tree

    def __repr__(self) -> str:
        return f"PyTree({jax.tree_util.tree_structure(self.tree)})"


# -- writing -----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Encoded:
    """A tree walked once (:func:`encode`): the sidecar's structure and leaf records, and the arrays Orbax stores,
    by leaf index. A background save stages the arrays and rebuilds this in the save process (:mod:`._staged`),
    which then writes the same folder a blocking save writes."""

    structure: Any
    leaves: list[dict[str, Any]]
    arrays: dict[str, Any]

    def write(self, folder: Path) -> None:
        """Serialize the tree into the empty folder ``folder``."""
        if self.arrays:
            # Orbax refuses an array of its bound or more: a larger array is written alone.
            in_flight = max(WRITE_IN_FLIGHT_BYTES, 1 + max(array.nbytes for array in self.arrays.values()))
            handler = ocp.PyTreeCheckpointHandler(save_concurrent_gb=in_flight / 10**9,
                                                  use_compression=ARRAYS_COMPRESSED,
                                                  type_handler_registry=_write_handlers())
            ocp.Checkpointer(handler).save(folder / ARRAYS_FOLDER, self.arrays)
        sidecar = {
            "format": FORMAT_VERSION,
            "written_by": {"jax": jax.__version__, "orbax-checkpoint": _orbax_version()},
            "structure": self.structure,
            "leaves": self.leaves,
        }
        (folder / SIDECAR_NAME).write_text(json.dumps(sidecar, indent=1), encoding="utf-8")


def _write_handlers() -> Any:
    """The type handlers of our own writes: those registered with Orbax, with Orbax's numpy handler told to write
    numpy arrays by reference instead of deep-copying each first (its default, in case the caller of an
    asynchronous save changes an array while it is written). Each of our writes ends before its caller may change
    the arrays (a blocking save's ``save`` call; in a background save, the segment the save process owns until
    the write ends), so such a copy would guard nothing and holds a second copy of every numpy leaf: a blocking
    save of 4 numpy arrays of 64 MiB peaked 1.00x the tree above its start with it, 0.03x without (issue 43). The
    files are the same (the same handler, its type name ``np.ndarray``). Made for each write, never registered
    globally, so the user's own Orbax saves keep the copy; a numpy handler of the user's own, registered in
    Orbax's place, is kept as it is."""
    handlers = ocp.type_handlers
    registry = handlers.create_type_handler_registry(
        *((kind, handlers.get_type_handler(kind)) for kind in handlers.supported_types()))
    if type(handlers.get_type_handler(np.ndarray)) is handlers.NumpyHandler:
        registry.add(np.ndarray, handlers.NumpyHandler(deepcopy_host_arrays=False), override=True,
                     ignore_warnings=True)
    return registry


def encode(tree: Any) -> Encoded:
    """``tree`` walked once; TypeError naming the first leaf that cannot be saved."""
    encoder = _Encoder()
    structure = encoder.encode(tree, ())
    return Encoded(structure, encoder.leaves, encoder.arrays)


class _Encoder:
    """Walks a tree once: records its containers and leaves, and collects the arrays Orbax will store."""

    def __init__(self) -> None:
        self.leaves: list[dict[str, Any]] = []
        self.arrays: dict[str, Any] = {}

    def encode(self, node: Any, path: Path_) -> Any:
        spec = self._leaf(node, path)
        if spec is not None:
            self.leaves.append(spec)
            return {"leaf": len(self.leaves) - 1}
        if node is None:
            return None
        if type(node) is dict:
            return {"dict": [[_json_key(key, path), self.encode(child, (*path, key))] for key, child in node.items()]}
        if type(node) in (list, tuple):
            return {type(node).__name__: [self.encode(child, (*path, i)) for i, child in enumerate(node)]}
        children = _children(node)
        if children is None:
            raise TypeError(f"{show_path(path)}: a PyTree leaf cannot be a {type(node).__qualname__}; leaves are "
                            "jax or numpy arrays, Python or numpy scalars, str, PRNG keys, or None")
        return {"node": f"{type(node).__module__}.{type(node).__qualname__}",
                "items": [[_json_key(key, path), self.encode(child, (*path, key))] for key, child in children]}

    def _leaf(self, value: Any, path: Path_) -> dict[str, Any] | None:
        """The sidecar record of ``value`` when it is a leaf (storing its array for Orbax), else None."""
        spec: dict[str, Any] = {"path": list(path)}
        if isinstance(value, jax.Array):
            if jnp.issubdtype(value.dtype, jax.dtypes.prng_key):
                data = jax.random.key_data(value)
                spec.update(kind=KEY, impl=str(jax.random.key_impl(value)), shape=list(value.shape))
                return self._array(spec, data)
            return self._array({**spec, "kind": JAX}, value)
        if isinstance(value, np.ndarray):
            if value.dtype.hasobject:
                raise TypeError(f"{show_path(path)}: numpy arrays of dtype object cannot be saved")
            return self._array({**spec, "kind": NUMPY}, value)
        if isinstance(value, str):  # before np.generic: np.str_ is both
            return {**spec, "kind": STR, "value": str(value)}
        if isinstance(value, np.generic):
            return self._array({**spec, "kind": NUMPY_SCALAR}, np.asarray(value))
        kind = next((k for t, k in _PY_SCALARS.items() if isinstance(value, t)), None)
        if kind is None:
            return None
        return {**spec, "kind": kind, "value": _scalar_to_json(value, kind)}

    def _array(self, spec: dict[str, Any], data: Any) -> dict[str, Any]:
        spec.update(dtype=str(data.dtype), data_shape=list(data.shape))
        spec.setdefault("shape", list(data.shape))
        if data.size:  # Orbax refuses zero-size arrays; their shape and dtype say everything
            self.arrays[str(len(self.leaves))] = data
        return spec


def _children(node: Any) -> list[tuple[Any, Any]] | None:
    """The children of a registered PyTree node with their keys; None when ``node`` is not a node."""
    flat, _ = jax.tree_util.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    if len(flat) == 1 and flat[0][0] == ():
        return None
    return [(entry_key(entry_path[0]), child) for entry_path, child in flat]


def entry_key(entry: Any) -> Any:
    """The plain key of one step of a JAX key path (dict key, index or attribute name)."""
    for attribute in ("key", "idx", "name"):
        if hasattr(entry, attribute):
            return getattr(entry, attribute)
    return str(entry)


def _json_key(key: Any, path: Path_) -> str | int:
    if isinstance(key, bool) or not isinstance(key, (str, int)):
        raise TypeError(f"{show_path(path)}: dict keys must be str or int to be saved, got {key!r}")
    return key


def _scalar_to_json(value: Any, kind: str) -> Any:
    if kind == FLOAT:
        return float(value).hex()  # exact, and covers nan and inf
    if kind == COMPLEX:
        return [float(value.real).hex(), float(value.imag).hex()]
    return bool(value) if kind == BOOL else int(value)


def scalar_from_json(value: Any, kind: str) -> Any:
    if kind == FLOAT:
        return float.fromhex(value)
    if kind == COMPLEX:
        return complex(float.fromhex(value[0]), float.fromhex(value[1]))
    return bool(value) if kind == BOOL else int(value)


def show_path(path: Path_ | list[Any]) -> str:
    """A leaf's path as users write it: ``params/dense/kernel``."""
    return "/".join(str(key) for key in path) or "<root>"


@functools.cache
def _orbax_version() -> str:
    try:
        return version("orbax-checkpoint")
    except PackageNotFoundError:
        return "unknown"
