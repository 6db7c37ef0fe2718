"""taskpoint's JAX extra: PyTrees as checkpoints, and Datarax's ``OrbaxCheckpointHandler`` on any store.

Install it with ``pip install "taskpoint[jax]"`` (jax, orbax-checkpoint, and flax for ``nnx`` modules)::

    from taskpoint.jax import PyTree, load_pytree_sync

    cp.save_sync(PyTree({"params": params, "step": 10, "rng": jax.random.key(0)}))
    state = load_pytree_sync(cp, target=abstract_state)   # None on the first attempt
"""

try:
    import jax  # noqa: F401
    import orbax.checkpoint  # noqa: F401
except ImportError as exc:
    raise ImportError(f'taskpoint.jax needs jax and orbax-checkpoint ({exc}); install them with '
                      f'pip install "taskpoint[jax]"') from exc

from . import _kind  # noqa: F401  (registers the jax.pytree step kind of CheckpointManager)
from ._handler import Checkpointable, OrbaxCheckpointHandler
from ._load import load_pytree, load_pytree_sync
from ._pytree import PyTree

__all__ = ["Checkpointable", "OrbaxCheckpointHandler", "PyTree", "load_pytree", "load_pytree_sync"]
