"""Orbax checkpoints of everything a run needs to continue exactly where it stopped.

One checkpoint = ``state`` (a pytree: TrainState with params, optimizer state, RNG and step,
plus the controller states) saved with ``StandardSave``, and ``meta`` (JSON: data-pipeline
position, the config, evaluation results so far) saved with ``JsonSave``. Orbax writes each
step into a temporary directory and renames it when complete, so a crash mid-save leaves the
previous checkpoints intact; a latest checkpoint that is unreadable (truncated, corrupted)
is reported and the next older one is used.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
  """Thin wrapper over ``orbax.checkpoint.CheckpointManager`` for (state, meta) pairs.

  Args:
    directory: ``<workdir>/checkpoints``; created if missing.
    keep: how many of the newest checkpoints to keep.
  """

  def __init__(self, directory: str, keep: int = 3):
    self.directory = os.path.abspath(directory)
    self.manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True,
                                             enable_async_checkpointing=False),
        item_names=("state", "meta"))

  def all_steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: Any, meta: dict) -> None:
    """Saves synchronously (every process must call it on multi-host runs).

    Global arrays are written shard by shard by the processes that own them; host-local
    arrays (the controllers, identical on every process) are written as numpy by process 0.
    """
    state = jax.tree.map(lambda x: np.asarray(x) if _host_local(x) else x, state)
    self.manager.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)), force=True)
    self.manager.wait_until_finished()

  def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
    """Restores the newest readable checkpoint.

    Args:
      abstract_state: a pytree of ``jax.ShapeDtypeStruct`` (with shardings) shaped like the
        saved state; restored arrays take these shardings.

    Returns:
      ``(step, state, meta)``, or None when the directory holds no checkpoint.

    Raises:
      RuntimeError: checkpoints exist but none of them can be read.
    """
    steps = self.all_steps()
    if not steps:
      return None
    errors = []
    for step in reversed(steps):
      try:
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()))
      except Exception as e:  # noqa: BLE001 -- any unreadable checkpoint falls back
        msg = f"checkpoint {step} in {self.directory} is unreadable ({type(e).__name__}: {e}); trying an older one"
        log.warning(msg)
        print(f"WARNING: {msg}", flush=True)
        errors.append(f"step {step}: {type(e).__name__}: {str(e)[:200]}")
        continue
      # host-local leaves (numpy templates, see abstract_like) come back as local arrays
      tree = jax.tree.map(lambda t, x: jnp.asarray(x) if isinstance(t, np.ndarray) else x,
                          abstract_state, restored["state"])
      return step, tree, restored["meta"]
    raise RuntimeError(f"no readable checkpoint in {self.directory}: " + "; ".join(errors))

  def close(self) -> None:
    self.manager.close()


def _host_local(x) -> bool:
  """A single-process array in a multi-process run (not a global array Orbax can shard)."""
  return isinstance(x, jax.Array) and jax.process_count() > 1 and x.is_fully_addressable


def abstract_like(tree: Any) -> Any:
  """``jax.ShapeDtypeStruct`` (with sharding) for every array leaf of ``tree``.

  In a multi-process run a host-local array becomes a numpy template instead (restored on
  every process from the copy process 0 wrote).
  """
  def one(x):
    if _host_local(x):
      return np.zeros(x.shape, x.dtype)
    if isinstance(x, jax.Array):
      return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
    return x
  return jax.tree.map(one, tree)
