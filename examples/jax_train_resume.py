"""A tiny JAX training loop that survives a failure: it resumes from its last saved step.

    python examples/jax_train_resume.py --steps 40 --save-every 5 --fail-at 23

The state (parameters, the typed PRNG key that draws each batch, the step, and a str) is saved every
``--save-every`` steps as a ``taskpoint.jax.PyTree`` into ``taskpoint.ctx().checkpoints``, the versioned
manager shared by every attempt of this run. Each ``--fail-at N`` makes one attempt fail at step N; the
next attempt restores the newest step and goes on, and ends with exactly the parameters of a run that
never failed (the last line prints them bit for bit).
"""

from __future__ import annotations

import argparse
from typing import Any

import jax
import jax.numpy as jnp

import taskpoint
from taskpoint.jax import PyTree, load_pytree_sync

TRUE_W = jnp.array([1.5, -2.0, 0.5])
TRUE_B = 0.25
LEARNING_RATE = 0.1


def loss_fn(params: dict[str, jax.Array], x: jax.Array, y: jax.Array) -> jax.Array:
    return jnp.mean((x @ params["w"] + params["b"] - y) ** 2)


@jax.jit
def train_step(params: dict[str, jax.Array], key: jax.Array) -> tuple[dict[str, jax.Array], jax.Array]:
    """One SGD step on a fresh batch drawn with ``key``; returns the new parameters and the next key."""
    key, batch_key = jax.random.split(key)
    x = jax.random.normal(batch_key, (32, 3))
    y = x @ TRUE_W + TRUE_B
    grads = jax.grad(loss_fn)(params, x, y)
    return jax.tree_util.tree_map(lambda p, g: p - LEARNING_RATE * g, params, grads), key


def initial_state() -> dict[str, Any]:
    return {"params": {"w": jnp.zeros(3), "b": jnp.zeros(())}, "rng": jax.random.key(0), "step": 0,
            "model": "linear-regression"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--save-every", type=int, default=5)
    parser.add_argument("--fail-at", type=int, action="append", default=[], help="fail one attempt at this step")
    parser.add_argument("--retries", type=int, default=3)
    parser.add_argument("--root", default=None, help="where checkpoints live (any fsspec URL)")
    args = parser.parse_args()
    failures = list(args.fail_at)

    @taskpoint.task(retries=args.retries, root=args.root)
    def train(steps: int) -> dict[str, jax.Array]:
        c = taskpoint.ctx()
        assert c is not None and c.checkpoints is not None
        manager = c.checkpoints
        state = initial_state()
        if manager.latest_step() is not None:
            # The initial state is the target: the restored tree gets its structure, dtypes and placement (the
            # newest step; a mismatch names the step and the manager's URI).
            state = load_pytree_sync(manager, target=state)
        print(f"attempt {c.attempt}: resumed at step {state['step']}", flush=True)
        params: dict[str, jax.Array] = state["params"]
        key: jax.Array = state["rng"]
        for step in range(state["step"], steps):
            if failures and step == failures[0]:
                failures.pop(0)
                raise RuntimeError(f"simulated failure at step {step}")
            params, key = train_step(params, key)
            if (step + 1) % args.save_every == 0:
                manager.save(PyTree({**state, "params": params, "rng": key, "step": step + 1}), step + 1)
        return params

    params = train(args.steps)
    print("final params:", " ".join(float(v).hex() for v in [*params["w"], params["b"]]))


if __name__ == "__main__":
    main()
