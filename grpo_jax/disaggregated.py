"""The two-group run: one process trains, another generates (docs/disaggregated.md).

One `jax.distributed` job of N processes: processes ``[0, T)`` form the training group, ``[T, N)``
the generation group, each with a mesh of its own processes' devices (`Groups`). With
``rollout.max_staleness = k >= 1`` the single-host schedule (`grpo_jax.train._sample_in_flight`)
splits into two loops that follow it step for step:

- training, step t (`GenerationGroup.sample`, in `grpo_jax.train.rl_step`): decide batch t + k
  (`train.decide_round`: draw, classify, allocate with the controllers of now) and write its
  *work order* (the rollouts' prompt rows, the sampling key, version t) to the key-value store;
  publish the parameters as version t (`weight_channel.WeightPublisher`, ``keep = k + 1``);
  receive batch t (`weight_channel.BatchReceiver`), then score, train and update the
  controllers as the single-host step does.
- generation, order n (`generate`): fetch version v = max(n - k, 0) unless held, sample the
  order's rows with its key (`train.dispatch_samples`, the run's generation layout), put the
  rollouts (`weight_channel.BatchSender`).

Work orders live under ``grpo_jax/run/<name>/``: ``first`` (the generation group's first
order number), ``order/<n>`` (JSON ``{"rows", "key", "version"}``, or ``"stop"``). At a
checkpoint the trainer receives the batches already ordered (`GenerationGroup.complete`), so
the checkpoint holds them in ``RunState.in_flight`` exactly as a single-host run's does; a
resumed run republishes version t and orders from t + k on. Supported: one training process
and one generation process (a group-wide publisher is not built).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import config_utils, rollout_queue, train, weight_channel
from grpo_jax.errors import ConfigError
from grpo_jax.state import RunState

_ROOT = "grpo_jax/run"
STOP = "stop"  # the work order that ends the generation loop


@dataclasses.dataclass(frozen=True)
class Groups:
    """The split of a ``num_processes``-process job: ``[0, train_processes)`` train, the rest
    generate.

    Raises (`check`):
      ConfigError: a split other than one training and one generation process, or a config
        without rollouts in flight (``rollout.max_staleness`` 0: nothing to overlap).
    """

    train_processes: int
    num_processes: int
    name: str = "run"
    timeout_s: float = 3600.0  # seconds a side waits for the other (an order, a batch, weights)
    host: str | None = None  # this process's address for the channels (`weight_channel`)

    def check(self, config) -> None:
        T, N = self.train_processes, self.num_processes
        if not 1 <= T < N:
            raise ConfigError(
                f"--train_processes={T} must leave a generation group: 1 <= T < --num_processes={N}"
            )
        if (T, N) != (1, 2):
            raise ConfigError(
                f"a two-group run is one training and one generation process, got {T} and "
                f"{N - T} (a group-wide weight publisher is not built: docs/disaggregated.md)"
            )
        if not config.rollout.max_staleness:
            raise ConfigError(
                "a two-group run needs rollouts in flight: set config.rollout.max_staleness >= 1 "
                "(and config.algorithm.tis_cap)"
            )

    def role(self, process: int) -> str:
        """``"train"`` or ``"generate"``: the group of ``process``."""
        return "train" if process < self.train_processes else "generate"

    @property
    def processes(self) -> tuple[int, ...]:
        """The training group's process indices."""
        return tuple(range(self.train_processes))

    @property
    def devices(self) -> list:
        """This process's group's devices (the mesh of `build_experiment`)."""
        train_side = jax.process_index() < self.train_processes
        return [d for d in jax.devices() if (d.process_index < self.train_processes) == train_side]

    def connect(self, exp) -> GenerationGroup:
        """The training group's handle on the generation group (`train.train_and_evaluate`)."""
        return GenerationGroup(exp, name=self.name, timeout_s=self.timeout_s, host=self.host)

    def release(self) -> None:
        """The training process's last word, whatever ended its run: when it never started the
        generation group (a refused config, a signal during the set-up), tells it there is no
        order (``first`` = -1) so it exits too. Otherwise `GenerationGroup.close` has sent the
        stop order and this does nothing."""
        # without overwrite: refused (ALREADY_EXISTS) when `GenerationGroup.start` / `close` set
        # it; a service already gone has nobody to tell
        with contextlib.suppress(Exception):
            weight_channel.coordination_client().key_value_set(f"{_ROOT}/{self.name}/first", "-1")


def _config_text(config) -> str:
    """The run's config as sorted JSON, without ``mesh`` (each group lays out its own devices):
    what the two groups compare."""
    tree = json.loads(config.to_json_best_effort(sort_keys=True))
    tree.pop("mesh", None)
    return json.dumps(tree, sort_keys=True)


def check_same_config(train_text: str, config) -> None:
    """Refuses a generation process whose config differs from the training process's
    (``train_text``: its `_config_text`): its rollouts would come from other settings (a
    temperature, a model, a seed) while the training side records its own.

    Raises:
      ConfigError: naming the first differing field.
    """
    theirs, ours = json.loads(train_text), json.loads(_config_text(config))
    if theirs != ours:
        raise ConfigError(
            "the generation process's config differs from the training process's ("
            f"{config_utils.first_difference(theirs, ours)}, train -> generate): run both "
            "groups with the same --config and overrides"
        )


def _batch_like(exp):
    """A received batch's template: ``{"rollouts", "utilisation"}`` as `rollout_queue.park`
    lays them out (shapes, dtypes, shardings of `rollout_queue.abstract`)."""
    template = rollout_queue.abstract(exp)[0]
    return {"rollouts": template.rollouts, "utilisation": template.utilisation}


class GenerationGroup:
    """The training process's end of a two-group run: work orders out, parameters published,
    batches in (the steps of the module docstring).

    Holds the batches in flight oldest first: each a `rollout_queue.Generated` whose
    bookkeeping (version, ids, placement) the trainer decided and whose rollouts are None until
    received. `start` before the first step, `sample` as `rl_step`'s ``sample_in_flight``,
    `complete` before a checkpoint, `close` at the end (the stop order).
    """

    def __init__(self, exp, *, name: str = "run", timeout_s: float = 3600.0, host=None):
        self._exp, self._k = exp, exp.run.rollout.max_staleness
        self._kv = weight_channel.coordination_client()
        self._ns = f"{_ROOT}/{name}"
        self._publisher = weight_channel.WeightPublisher(
            f"{name}/policy", keep=self._k + 1, host=host
        )
        self._like = _batch_like(exp)
        self._shardings = jax.tree.map(lambda s: s.sharding, self._like)
        self._receiver = weight_channel.BatchReceiver(
            f"{name}/rollouts", self._like, timeout_s=timeout_s, host=host
        )
        # the generation process checks its config against this one before it generates
        self._kv.key_value_set(f"{self._ns}/config", _config_text(exp.config), allow_overwrite=True)
        self._queue: list[rollout_queue.Generated] = []
        self._next = None  # the next work order's number (= the step its batch trains)
        self._published = -1
        self._closed = False

    def start(self, run: RunState, source) -> RunState:
        """Before this process's first step t: a restored ``run``'s batches in flight (t .. t+k-1,
        complete) are kept and orders go on from t + k; a new run writes the k orders of
        `train.fill_in_flight` (its keys, version t). Then publishes version t and tells the
        generation group its first order. Returns ``run`` without batches in flight (they are
        held here; `complete` puts them back)."""
        t, k = int(run.train.step), self._k
        self._next = t
        if run.in_flight is None:
            keys = [rollout_queue.fill_key(run.train.rng, i) for i in range(k)]
            for i, key in enumerate(keys):
                self._queue.append(self._order(run, source, t + i, key, {}))
            first = t
        else:
            self._queue = [rollout_queue.unpark(g) for g in run.in_flight]
            self._next, first = t + k, t + k
        self._publish(run)
        self._kv.key_value_set(f"{self._ns}/first", str(first), allow_overwrite=True)
        return run.replace(in_flight=None)

    def _order(self, run, source, step: int, key, times: dict) -> rollout_queue.Generated:
        """Decides the batch for ``step`` and writes its work order (number ``step``: the orders
        are written in step order, from `start` on)."""
        gen = train.decide_round(self._exp, run, source, step, times)
        order = {
            "rows": gen.ids[gen.placement.segment_ids].tolist(),
            "key": np.asarray(jax.device_get(key)).tolist(),  # uint32 [2]: the sampling key
            "version": int(gen.version),
        }
        self._kv.key_value_set(f"{self._ns}/order/{step}", json.dumps(order))
        self._next += 1
        return gen

    def _publish(self, run: RunState) -> None:
        version = int(run.train.step)
        if version > self._published:  # once per version (a resumed run's first is republished)
            self._publisher.publish(run.train.params, version)
            self._published = version

    def _receive(self, i: int) -> rollout_queue.Generated:
        """Batch ``i`` of the queue with its rollouts (received in order when not yet)."""
        for j in range(i + 1):
            gen = self._queue[j]
            if gen.rollouts is None:
                version, batch = self._receiver.get(self._shardings)
                if version != int(gen.version):
                    raise RuntimeError(
                        f"two-group run: a batch of version {version} arrived for the order of "
                        f"version {int(gen.version)}"
                    )
                self._queue[j] = gen.replace(
                    rollouts=batch["rollouts"], utilisation=batch["utilisation"]
                )
        return self._queue[i]

    def sample(self, exp, fns, run: RunState, source, key):
        """`rl_step`'s steps 1-4 (``sample_in_flight``): orders the batch for step t + k with
        ``key``, publishes version t, receives and scores batch t. ``times["generate"]`` is the
        wait for it. Returns ([its Round], None: the batches in flight are held here)."""
        del fns
        t, times = int(run.train.step), {}
        new = self._order(run, source, t + self._k, key, times)
        self._publish(run)
        t0 = time.perf_counter()
        oldest = self._receive(0)
        times["generate"] = time.perf_counter() - t0
        self._queue = [*self._queue[1:], new]
        version = {"policy_version": int(oldest.version), "staleness": t - int(oldest.version)}
        return [train.score_round(exp, run, oldest, times, version)], None

    def complete(self, run: RunState) -> RunState:
        """``run`` with its batches in flight, every one received (waits for the generation
        group) and laid out as `rollout_queue.park` does: what a checkpoint holds."""
        self._receive(len(self._queue) - 1)
        return run.replace(
            in_flight=tuple(rollout_queue.park(self._exp.mesh, g) for g in self._queue)
        )

    def close(self) -> None:
        """Writes the stop order (the generation loop ends after its batches) and stops serving
        weights. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._next is not None:
            self._kv.key_value_set(f"{self._ns}/order/{self._next}", STOP)
        else:  # stopped before `start`: the generation group's first order is the stop
            self._kv.key_value_set(f"{self._ns}/first", "0", allow_overwrite=True)
            self._kv.key_value_set(f"{self._ns}/order/0", STOP)
        self._publisher.close()


def generate(exp, fns, *, name: str = "run", timeout_s: float = 3600.0, host=None) -> int:
    """The generation group's loop (one process): work orders in, rollout batches out, until
    the stop order. Holds no run state: a restarted job starts at the order the trainer names.

    Args:
      exp, fns: this group's experiment (its mesh: this group's devices) and step programs.
      name: the run's channel prefix (as `Groups.name`).
      timeout_s: seconds to wait for an order, a version or room in the stream.
      host: this process's address for the channels (default: its host name's address).

    Returns: the number of batches generated (0 when the trainer stopped before ordering any).

    Raises:
      ConfigError: this process's config differs from the training process's.
      TimeoutError: the trainer wrote no order, published no version or took no batch in time.
    """
    kv, ns, ms = weight_channel.coordination_client(), f"{_ROOT}/{name}", int(timeout_s * 1000)
    check_same_config(kv.blocking_key_value_get(f"{ns}/config", ms), exp.config)
    like = exp.abstract_state.params
    shardings = jax.tree.map(lambda s: s.sharding, like)
    weights = weight_channel.WeightSubscriber(
        f"{name}/policy", like, timeout_s=timeout_s, host=host
    )
    sender = weight_channel.BatchSender(
        f"{name}/rollouts",
        capacity=exp.run.rollout.max_staleness + 1,
        timeout_s=timeout_s,
        host=host,
    )
    n, held, params, done = int(kv.blocking_key_value_get(f"{ns}/first", ms)), None, None, 0
    while n >= 0 and (text := kv.blocking_key_value_get(f"{ns}/order/{n}", ms)) != STOP:
        order = json.loads(text)
        if order["version"] != held:  # max(n - k, 0): a new version every order after the fill
            params, held = weights.fetch(order["version"], shardings), order["version"]
        key = jax.device_put(np.asarray(order["key"], np.uint32))
        rows = np.asarray(order["rows"], np.int32)
        rollouts, util = train.dispatch_samples(exp, fns, params, rows, key)
        batch = {"rollouts": rollouts, "utilisation": jnp.stack(util) if util else None}
        sender.put(batch, held)
        kv.key_value_delete(f"{ns}/order/{n}")
        n, done = n + 1, done + 1
    return done
