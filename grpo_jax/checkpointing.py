"""Orbax checkpoints of everything a run needs to continue exactly where it stopped.

One checkpoint = ``state`` (a pytree: TrainState with params, optimizer state, RNG and step,
plus the controller states) saved with ``StandardSave``, and ``meta`` (JSON: data-pipeline
position, the config, evaluation results so far, and a checksum of every array of ``state``)
saved with ``JsonSave``.

What survives what:

* a crash or SIGKILL mid-save: Orbax writes each step into ``<step>.orbax-checkpoint-tmp`` and
  renames it when complete, so the previous checkpoints are intact. The next start reports the
  interrupted save, removes its temporary directory and resumes from the last complete step.
* a truncated or corrupted checkpoint (unreadable files, or arrays whose checksum no longer
  matches, e.g. flipped bits that Orbax would read back silently): reported with a warning and
  the next older checkpoint is used. At the next save the unreadable ones are moved aside to
  ``<step>.unreadable`` (kept for inspection, out of Orbax's way), so that step can be saved
  again.
* no readable checkpoint at all: `CheckpointError` (never a silent fresh start).
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

TMP_MARK = ".orbax-checkpoint-tmp"  # Orbax's suffix for a step directory still being written
UNREADABLE_SUFFIX = ".unreadable"  # where unreadable checkpoints are moved (see module docstring)


class CheckpointError(RuntimeError):
    """Checkpoints exist but none can be read. The message is one line and says what to do."""


def _warn(msg: str) -> None:
    log.warning(msg)
    if jax.process_index() == 0:
        print(f"WARNING: {msg}", flush=True)


class Checkpointer:
    """Thin wrapper over ``orbax.checkpoint.CheckpointManager`` for (state, meta) pairs.

    Args:
      directory: ``<workdir>/checkpoints``; created if missing. Temporary directories left by
        an interrupted save are reported and removed.
      keep: how many of the newest checkpoints to keep.
    """

    def __init__(self, directory: str, keep: int = 3):
        self.directory = os.path.abspath(directory)
        self._unreadable: list[int] = []
        if os.path.isdir(self.directory):
            partial = sorted(n for n in os.listdir(self.directory) if TMP_MARK in n)
            if partial:
                _warn(
                    f"{len(partial)} incomplete checkpoint(s) in {self.directory} from an interrupted save "
                    f"({', '.join(partial)}); discarding them, the last complete checkpoint is used"
                )
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(
                max_to_keep=keep,
                create=True,
                enable_async_checkpointing=False,
                cleanup_tmp_directories=True,
            ),
            item_names=("state", "meta"),
        )

    def all_steps(self) -> list[int]:
        return sorted(self.manager.all_steps())

    def save(self, step: int, state: Any, meta: dict) -> None:
        """Saves synchronously (every process must call it on multi-host runs).

        Global arrays are written shard by shard by the processes that own them; host-local
        arrays (the controllers, identical on every process) are written as numpy by process 0.
        ``meta`` gets a ``"fingerprint"`` entry (see `fingerprint`), checked on restore.
        """
        self._set_aside_unreadable()
        state = jax.tree.map(lambda x: np.asarray(x) if _host_local(x) else x, state)
        meta = {**meta, "fingerprint": fingerprint(state)}
        self.manager.save(
            step,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)
            ),
            force=True,
        )
        self.manager.wait_until_finished()

    def restore_latest(self, abstract_state: Any) -> tuple[int, Any, dict] | None:
        """Restores the newest readable checkpoint (read-only: nothing on disk changes).

        Args:
          abstract_state: a pytree of ``jax.ShapeDtypeStruct`` (with shardings) shaped like the
            saved state; restored arrays take these shardings.

        Returns:
          ``(step, state, meta)``, or None when the directory holds no checkpoint. A newer
          checkpoint that cannot be read, or whose arrays do not match the checksums saved with
          it, is reported (warning) and skipped.

        Raises:
          CheckpointError: checkpoints exist but none of them can be read.
        """
        steps = self.all_steps()
        if not steps:
            return None
        errors, unreadable = [], []
        for step in reversed(steps):
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(
                        state=ocp.args.StandardRestore(abstract_state), meta=ocp.args.JsonRestore()
                    ),
                )
                meta = dict(restored["meta"])
                expected = meta.pop("fingerprint", None)
                if expected is not None:
                    _check_fingerprint(expected, fingerprint(restored["state"]))
            except Exception as e:
                reason = f"{type(e).__name__}: {' '.join(str(e).split())[:200]}"
                older = [s for s in steps if s < step]
                _warn(
                    f"checkpoint {step} in {self.directory} is unreadable ({reason}); "
                    + (
                        f"falling back to checkpoint {older[-1]}"
                        if older
                        else "no older checkpoint"
                    )
                )
                errors.append(f"step {step}: {reason}")
                unreadable.append(step)
                continue
            if unreadable:
                _warn(
                    f"resuming from checkpoint {step}, not from the newer unreadable "
                    f"checkpoint(s) {unreadable}; they are moved to <step>{UNREADABLE_SUFFIX} at the next save"
                )
            self._unreadable = unreadable
            # host-local leaves (numpy templates, see abstract_like) come back as local arrays
            tree = jax.tree.map(
                lambda t, x: jnp.asarray(x) if isinstance(t, np.ndarray) else x,
                abstract_state,
                restored["state"],
            )
            return step, tree, meta
        raise CheckpointError(
            f"no readable checkpoint in {self.directory} ({'; '.join(errors)}); move the directory "
            "away (or pass --config.checkpoint.overwrite=True) to start over"
        )

    def _set_aside_unreadable(self) -> None:
        """Moves the checkpoints `restore_latest` skipped to ``<step>.unreadable[.N]``."""
        if not self._unreadable:
            return
        if jax.process_index() == 0:
            for step in self._unreadable:
                src = os.path.join(self.directory, str(step))
                if not os.path.isdir(src):
                    continue
                dst, n = src + UNREADABLE_SUFFIX, 1
                while os.path.exists(dst):
                    dst, n = f"{src}{UNREADABLE_SUFFIX}.{n}", n + 1
                os.rename(src, dst)
                _warn(f"moved unreadable checkpoint {step} to {dst}")
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("grpo_jax.checkpointing.set_aside")
        self._unreadable = []
        self.manager.reload()

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


# ----------------------------------------------------------------------------- checksums

_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint32}


def _words(x, xp):
    """The array's bits as uint32 words (8-byte types give a trailing axis of 2)."""
    if jnp.issubdtype(x.dtype, jax.dtypes.prng_key):
        x = jax.random.key_data(x)
    if x.dtype == np.bool_:
        x = x.astype(np.uint8)
    u = _UINT[np.dtype(x.dtype).itemsize]
    if xp is np:
        w = np.ascontiguousarray(x).reshape(-1).view(u)
        shape = (*x.shape, 2) if np.dtype(x.dtype).itemsize == 8 else x.shape
        return w.reshape(shape).astype(np.uint32)
    return jax.lax.bitcast_convert_type(x, u).astype(jnp.uint32)


@jax.jit
def _device_sums(x):
    """[2] uint32: the two checksums of one array (see `fingerprint`), computed where it lives."""
    w = _words(x, jnp)
    idx, stride = jnp.zeros(w.shape, jnp.uint32), 1
    for d in reversed(range(w.ndim)):  # row-major flat index mod 2^32, without a reshape
        idx = idx + jax.lax.broadcasted_iota(jnp.uint32, w.shape, d) * jnp.uint32(stride)
        stride = (stride * w.shape[d]) % 2**32
    return jnp.stack(
        [
            jnp.sum(w, dtype=jnp.uint32),
            jnp.sum(w * (idx * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32),
        ]
    )


def _host_sums(x) -> tuple[int, int]:
    w = _words(np.asarray(x), np)
    idx = (np.arange(w.size, dtype=np.uint64) % 2**32).astype(np.uint32).reshape(w.shape)
    odd = np.add(np.multiply(idx, np.uint32(2), dtype=np.uint32), np.uint32(1), dtype=np.uint32)
    return (
        int(np.sum(w, dtype=np.uint32)),
        int(np.sum(np.multiply(w, odd, dtype=np.uint32), dtype=np.uint32)),
    )


def fingerprint(tree: Any) -> dict[str, str]:
    """Checksums of every array leaf: ``{key path: 16 hex digits}``.

    Two sums of the leaf's bits as uint32 words, modulo 2^32: the plain sum and the sum weighted
    by ``2 * flat_index + 1`` (odd weights, so changing any one word changes both). Integer sums
    are exact and order-free, so the result does not depend on the sharding; global arrays are
    summed where they live (jitted per leaf: one small compile per distinct shape, dtype and
    sharding, so a deep model's identical layers share it), host arrays in numpy. Detects corruption that Orbax reads back without an error (e.g. flipped bits).
    """
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    flat = [
        (jax.tree_util.keystr(p), x)
        for p, x in flat
        if isinstance(x, (jax.Array, np.ndarray, np.generic))
    ]
    on_device = {
        k: _device_sums(x) for k, x in flat if isinstance(x, jax.Array) and not _host_local(x)
    }
    result = {}
    for key, x in flat:
        if key in on_device:
            a, b = np.asarray(on_device[key].addressable_data(0)).tolist()
        else:
            a, b = _host_sums(x)
        result[key] = f"{a:08x}{b:08x}"
    return result


def _check_fingerprint(expected: dict, actual: dict) -> None:
    bad = [k for k in expected if actual.get(k) != expected[k]]
    if bad or set(actual) != set(expected):
        raise ValueError(
            f"checksum mismatch (corrupted data) in {len(bad)} array(s), first "
            f"{bad[0] if bad else sorted(set(actual) ^ set(expected))[0]}"
        )
