"""The runtime layer: retried tasks, their attempts, and the context code inside them sees.

Owns: :class:`TaskContext` and where the running one is kept (``state``), the names of the storage layout
and environment variables (``layout``), lineage across attempts (``lineage``), how the ranks of a launch
agree on their attempt (``rendezvous``), the URI repair rules (``repair``), :func:`ctx` and contexts built
from the environment (``context``), and the :func:`task` decorator (``task``).

May import: :mod:`taskpoint.manager`, :mod:`taskpoint.checkpoint` and everything below them. Inside the
package the modules form layers too (``task`` > ``context`` > ``lineage`` > ``rendezvous`` > ``repair`` >
``state`` > ``layout``; ``flyte_bridge``, the context inside a Flyte 2 task, beside ``lineage``), checked by
import-linter like the package layers.
"""

from .context import ctx, environment_context, repair_prev_checkpoint_uri, running_attempt
from .state import TaskContext
from .task import task

__all__ = ["TaskContext", "ctx", "environment_context", "repair_prev_checkpoint_uri", "running_attempt", "task"]
