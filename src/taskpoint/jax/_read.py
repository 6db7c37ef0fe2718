"""Reading a PyTree folder written by :meth:`~._pytree.Encoded.write`: the sidecar, the Orbax checkpoint of the
array leaves, and a target's structure, dtypes and shardings matched leaf by leaf (see :mod:`._pytree` for the
layout)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from ..errors import CheckpointError, RestoreMismatch, RestoreReport
from ._pytree import (
    _ARRAY_KINDS,
    ARRAYS_FOLDER,
    FORMAT_VERSION,
    JAX,
    KEY,
    NUMPY_SCALAR,
    SIDECAR_NAME,
    STR,
    Path_,
    entry_key,
    scalar_from_json,
    show_path,
)


def read_tree(folder: Path, target: Any = None, where: str | None = None, *, strict: bool = True,
              step: int | None = None) -> Any:
    """The tree serialized in ``folder``; shaped, typed and placed like ``target`` when it is given. ``where``
    names the checkpoint in messages ("the checkpoint at s3://...", "step 3 in s3://..."): ``folder`` is a
    workspace, gone once the load returns.

    Without a target, containers come back as saved (dict, list, tuple, None; other registered nodes as
    dicts of their children), jax arrays on the default device. With one, the result has the target's
    structure, dtypes and shardings; leaves missing from the checkpoint, leaves the target lacks, and leaves
    of another shape or kind raise RestoreMismatch naming them (a ValueError too). ``strict=False`` returns
    ``(tree, report)`` instead: the leaves that match restored, the others the target's own, and a
    RestoreReport (of ``step``) listing them.
    """
    where = where or f"the checkpoint in {folder}"
    sidecar = _read_sidecar(folder, where)
    specs: list[dict[str, Any]] = sidecar["leaves"]
    if target is None:
        tree = _build(sidecar["structure"], _Restorer(folder, specs, [None] * len(specs), where).values())
        return tree if strict else (tree, RestoreReport(step))
    flat, treedef = jax.tree_util.tree_flatten_with_path(target)
    leaves = [leaf for _, leaf in flat]
    order, report = _match(specs, [tuple(entry_key(e) for e in path) for path, _ in flat], leaves, step)
    if strict and not report.complete:
        raise RestoreMismatch(report, where)
    targets: list[Any] = [None] * len(specs)
    for position, index in enumerate(order):
        if index is not None:
            targets[index] = leaves[position]
    values = _Restorer(folder, specs, targets, where, with_target=True).values()
    tree = jax.tree_util.tree_unflatten(treedef, [leaves[position] if index is None else values[index]
                                                  for position, index in enumerate(order)])
    return tree if strict else (tree, report)


def _read_sidecar(folder: Path, where: str) -> dict[str, Any]:
    if not (folder / SIDECAR_NAME).is_file():
        raise CheckpointError(f"{where} holds no taskpoint.jax.PyTree ({SIDECAR_NAME} is missing): it was saved "
                              "from something else. Save trees with taskpoint.jax.PyTree(tree).")
    text = (folder / SIDECAR_NAME).read_text(encoding="utf-8")
    sidecar: dict[str, Any] = json.loads(text)
    if sidecar.get("format") != FORMAT_VERSION:
        raise CheckpointError(f"{where} has {SIDECAR_NAME} format {sidecar.get('format')!r}; this taskpoint "
                              f"reads format {FORMAT_VERSION}. Upgrade taskpoint to load it.")
    return sidecar


def _build(node: Any, values: list[Any]) -> Any:
    if node is None:
        return None
    if "leaf" in node:
        return values[node["leaf"]]
    if "dict" in node:
        return {key: _build(child, values) for key, child in node["dict"]}
    if "list" in node:
        return [_build(child, values) for child in node["list"]]
    if "tuple" in node:
        return tuple(_build(child, values) for child in node["tuple"])
    return {key: _build(child, values) for key, child in node["items"]}


# -- matching a target -------------------------------------------------------------------------------------


def _match(specs: list[dict[str, Any]], paths: list[Path_], leaves: list[Any], step: int | None
           ) -> tuple[list[int | None], RestoreReport]:
    """For each target leaf, the index of the checkpoint leaf that fits it (None when none does); and the
    report of every leaf that did not match, named by path."""
    by_path = {tuple(spec["path"]): index for index, spec in enumerate(specs)}
    order: list[int | None] = []
    missing: list[str] = []
    mismatched: list[tuple[str, str]] = []
    for path, leaf in zip(paths, leaves, strict=True):
        index = by_path.pop(path, None)
        problem = None if index is None else _differs(specs[index], leaf)
        if index is None:
            missing.append(show_path(path))
        elif problem:
            mismatched.append((show_path(path), problem))
        order.append(None if index is None or problem else index)
    unexpected = tuple(sorted(show_path(path) for path in by_path))  # the target's order has no place for them
    return order, RestoreReport(step, tuple(missing), unexpected, tuple(mismatched))


def _differs(spec: dict[str, Any], leaf: Any) -> str | None:
    """What makes checkpoint leaf ``spec`` unfit for target leaf ``leaf``, or None when it fits."""
    kind = spec["kind"]
    wanted = _category(leaf)
    held = "key" if kind == KEY else "str" if kind == STR else "number"
    if wanted is not None and wanted != held:
        return f"the checkpoint holds a {kind}, the target a {_describe(leaf)}"
    shape = tuple(spec.get("shape", ()))
    target_shape = _shape(leaf)
    if target_shape is not None and shape != target_shape:
        return f"shape {shape} in the checkpoint vs {target_shape} in the target"
    if kind == KEY and isinstance(leaf, jax.Array) and str(jax.random.key_impl(leaf)) != spec["impl"]:
        return f"PRNG key implementation {spec['impl']} in the checkpoint vs {jax.random.key_impl(leaf)} in the target"
    return None


def _category(leaf: Any) -> str | None:
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) and jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key):
        return "key"
    if isinstance(leaf, str):
        return "str"
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic, bool, int, float, complex)):
        return "number"
    return None  # a leaf type we do not know: it takes whatever the checkpoint holds


def _shape(leaf: Any) -> tuple[int, ...] | None:
    if isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct, np.ndarray, np.generic)):
        return tuple(leaf.shape)
    if isinstance(leaf, (bool, int, float, complex)):
        return ()
    return None


def _describe(leaf: Any) -> str:
    if isinstance(leaf, jax.Array):
        return "jax.Array"
    return f"{type(leaf).__module__}.{type(leaf).__qualname__}".removeprefix("builtins.")


# -- restoring values --------------------------------------------------------------------------------------


@dataclass
class _Restorer:
    """Turns checkpoint leaves into values: one Orbax restore for all arrays, then per-leaf conversion."""

    folder: Path
    specs: list[dict[str, Any]]
    targets: list[Any]
    #: What messages call the checkpoint (its URI, or its step and directory): ``folder`` is a workspace.
    where: str
    with_target: bool = False

    def values(self) -> list[Any]:
        stored = self._restore_arrays()
        return [self._value(spec, target, stored.get(str(index)))
                for index, (spec, target) in enumerate(zip(self.specs, self.targets, strict=True))]

    def _restore_arrays(self) -> dict[str, Any]:
        args = {str(index): self._restore_args(spec, target)
                for index, (spec, target) in enumerate(zip(self.specs, self.targets, strict=True)) if _in_orbax(spec)}
        if not args:
            return {}
        try:
            restored: dict[str, Any] = ocp.PyTreeCheckpointer().restore(
                self.folder / ARRAYS_FOLDER, args=ocp.args.PyTreeRestore(restore_args=args))
        except Exception as exc:  # Orbax names the workspace it reads, gone once the load returns
            problem = " ".join(str(exc).replace(str(self.folder), "<checkpoint>").split())
            if self.with_target:
                raise ValueError(f"{self.where}: Orbax could not restore its arrays as the target asks "
                                 f"({type(exc).__name__}: {problem})") from exc
            raise CheckpointError(f"{self.where}: Orbax could not restore its arrays "
                                  f"({type(exc).__name__}: {problem})") from exc
        return restored

    def _restore_args(self, spec: dict[str, Any], target: Any) -> ocp.RestoreArgs:
        """How Orbax reads one array: as the target leaf wants it, else as it was saved."""
        kind = spec["kind"]
        if kind == KEY or (kind == JAX and target is None):  # key data is placed after wrapping
            return ocp.ArrayRestoreArgs(sharding=_default_sharding())
        if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
            return ocp.ArrayRestoreArgs(sharding=_sharding(target), dtype=target.dtype,
                                        global_shape=tuple(target.shape))
        dtype = target.dtype if isinstance(target, (np.ndarray, np.generic)) else None
        return ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype)

    def _value(self, spec: dict[str, Any], target: Any, stored: Any) -> Any:
        kind = spec["kind"]
        if kind == STR:
            return spec["value"]
        if kind not in _ARRAY_KINDS:
            value = scalar_from_json(spec["value"], kind)
        elif kind == KEY:
            value = jax.random.wrap_key_data(stored if stored is not None else _empty(spec, None), impl=spec["impl"])
            sharding = getattr(target, "sharding", None)
            return value if sharding is None or sharding == value.sharding else jax.device_put(value, sharding)
        else:
            value = stored if stored is not None else _empty(spec, target)
            if kind == NUMPY_SCALAR:
                value = value[()]
        return _like(value, target) if self.with_target else value


def _in_orbax(spec: dict[str, Any]) -> bool:
    return spec["kind"] in _ARRAY_KINDS and math.prod(spec["data_shape"]) > 0


def _empty(spec: dict[str, Any], target: Any) -> Any:
    """A zero-size array as saved (Orbax does not store them)."""
    data = np.zeros(spec["data_shape"], dtype=jnp.dtype(spec["dtype"]))
    if spec["kind"] in (JAX, KEY) and not isinstance(target, (np.ndarray, np.generic)):
        return jax.device_put(data, _default_sharding())
    return data


def _like(value: Any, target: Any) -> Any:
    """``value`` converted to the type, dtype and placement of a target leaf."""
    if isinstance(target, (jax.Array, jax.ShapeDtypeStruct)):
        if isinstance(value, jax.Array) and value.dtype == target.dtype and value.sharding == _sharding(target):
            return value
        return jax.device_put(np.asarray(value, dtype=target.dtype), _sharding(target))
    if isinstance(target, np.ndarray):
        return np.asarray(value, dtype=target.dtype)
    if isinstance(target, np.generic):
        return target.dtype.type(np.asarray(value)[()])
    if isinstance(target, (bool, int, float, complex)):
        return type(target)(np.asarray(value).item() if isinstance(value, (jax.Array, np.ndarray, np.generic))
                            else value)
    return value


def _sharding(target: Any) -> Any:
    sharding = getattr(target, "sharding", None)
    return sharding if sharding is not None else _default_sharding()


def _default_sharding() -> jax.sharding.Sharding:
    return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
