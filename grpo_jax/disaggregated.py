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

Keys under ``grpo_jax/run/<name>/``: ``config`` (the trainer's, which the generator must
match), ``first`` (the generation group's first order number), ``order/<n>`` (JSON ``{"rows",
"key", "version"}``), and each side's ``end/<role>`` and ``signal/<role>`` (`Peer`). At a
checkpoint the trainer receives the batches already ordered (`GenerationGroup.complete`), so
the checkpoint holds them in ``RunState.in_flight`` exactly as a single-host run's does; a
resumed run republishes version t and orders from t + k on. Supported: one training process
and one generation process (a group-wide publisher is not built).

Ends, failures and signals (`Peer`; docs/disaggregated.md, "Failure handling"): every wait on
the other side polls in slices (`weight_channel.wait_for_key`), checking the other side's end
key and (on the trainer) the generator's heartbeat. The trainer's run ends (finished, stopped
by a signal, failed) with ``end/train``; the generator then leaves at once, and the trainer
waits for it to go before its coordination service does. A generator that fails writes
``end/generate``; the trainer's next wait raises `PeerEnded` (one ``error:`` line; the last
checkpoint intact), and so does a generator whose heartbeat stops (killed). A signal to the
generator is passed on (``signal/generate``): the trainer stops at its next safe point as if
signalled itself, and the generator generates what is ordered until then.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import config_utils, rollout_queue, train, weight_channel
from grpo_jax.errors import ConfigError
from grpo_jax.state import RunState

_ROOT = "grpo_jax/run"


class PeerEnded(RuntimeError):
    """The other group's process ended, or stopped answering, while this side waited for it."""


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
    leave_timeout_s: float = 300.0  # seconds the trainer's end waits for the generator to leave
    stale_s: float = 100.0  # seconds without the generator's heartbeat before it counts as dead

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
        return GenerationGroup(exp, self)

    def peer(self, role: str) -> Peer:
        """This process's (``role``'s) view of the other group."""
        return Peer(self, role)


class Peer:
    """One side of a two-group run facing the other, through the key-value store.

    - ``end/<role>``: a side's last word, JSON ``{"status", "message"}``; status "done" (the
      trainer's run finished; the generator's loop ended with it), "stopped" (a signal) or
      "failed". `leave` writes it. The trainer's `check` raises `PeerEnded` on the
      generator's; to the generator the trainer's end is its stop (`generate`).
    - ``beat/generate``: a counter the generation process's thread raises every `BEAT_S`
      (`start`). The trainer counts the generator dead when it stops changing for
      ``stale_s``: JAX's own liveness query (`get_live_nodes`) is a barrier every live process
      must enter, so it cannot be asked by one side alone. (A process whose coordination
      service goes away aborts, so the generator needs no such watch of the trainer's.)
    - ``signal/generate``: the name of a signal the generation process received
      (`pass_signal`); the trainer's thread (`start`) delivers it to the trainer.
    """

    BEAT_S = 1.0

    def __init__(self, groups: Groups, role: str):
        self._kv = weight_channel.coordination_client()
        self._ns = f"{_ROOT}/{groups.name}"
        self.role, self.other = role, "generate" if role == "train" else "train"
        self._leave_timeout_s, self._stale_s = groups.leave_timeout_s, groups.stale_s
        self._thread_stop: threading.Event | None = None
        self._beat: tuple[str | None, float] | None = None  # (last beat seen, when)

    def _try_get(self, key: str) -> str | None:
        return weight_channel.try_get(self._kv, f"{self._ns}/{key}")

    def start(self) -> None:
        """This side's thread until `leave`: the generator's heartbeat (``beat/generate``); the
        trainer's relay of the generator's signal to its own main thread (once), so the run
        stops at its next safe point as on one host."""
        self._thread_stop = stop = threading.Event()
        if self.role == "generate":

            def beat():
                n = 0
                while n == 0 or not stop.wait(self.BEAT_S):  # the first beat at once
                    n += 1
                    try:
                        self._kv.key_value_set(
                            f"{self._ns}/beat/generate", str(n), allow_overwrite=True
                        )
                    except Exception:  # the service is going: the run is ending
                        return

            target = beat
        else:
            main = threading.main_thread().ident

            def relay():
                while not stop.wait(weight_channel.SLICE_S):
                    try:
                        name = self._try_get("signal/generate")
                    except Exception:  # the service is going: the run is ending
                        return
                    if name is not None:
                        print(f"the generation process received {name}: passed on", flush=True)
                        signal.pthread_kill(main, getattr(signal, name, signal.SIGTERM))
                        return

            target = relay
        threading.Thread(target=target, name=f"peer-{self.role}", daemon=True).start()

    def their_end(self) -> dict | None:
        """The other side's ``end`` (``{"status", "message"}``), or None while it runs."""
        text = self._try_get(f"end/{self.other}")
        return None if text is None else json.loads(text)

    def generator_alive(self) -> bool:
        """Training side: False once ``beat/generate`` has not changed for ``stale_s``
        (counted from this side's first look)."""
        beat, now = self._try_get("beat/generate"), time.monotonic()
        if self._beat is None or beat != self._beat[0]:
            self._beat = (beat, now)
        return now - self._beat[1] <= self._stale_s

    def check(self) -> None:
        """The training side's check between wait slices.

        Raises:
          PeerEnded: the generation process ended, or its heartbeat stopped.
        """
        end = self.their_end()
        if end is not None:
            why = end["message"] or end["status"]
            raise PeerEnded(f"the generation process ended before the training run did ({why})")
        if not self.generator_alive():
            raise PeerEnded(
                f"the generation process stopped answering (no heartbeat for {self._stale_s:g} "
                "s, --distributed_heartbeat_s: killed, or its host lost)"
            )

    def pass_signal(self, name: str) -> None:
        """Generation side: tells the trainer this process received signal ``name``."""
        self._kv.key_value_set(f"{self._ns}/signal/{self.role}", name, allow_overwrite=True)

    def leave(self, status: str, message: str = "", wait: bool = True) -> None:
        """This side's last word (``end/<role>``): the generator's caller exits right after
        (`os._exit`, no shutdown: nothing of its own to save, and no call left in flight when
        the trainer's coordination service goes); the trainer first waits (``wait``; False
        when the generator is known gone) up to ``Groups.leave_timeout_s`` for the generator's
        end or its heartbeat to stop, since a process whose coordination service goes away
        aborts. (Both joined the job before either runs this, so the generator is there.)
        Never raises (a service already gone has nobody to tell)."""
        if self._thread_stop is not None:
            self._thread_stop.set()
        end = json.dumps({"status": status, "message": message})
        with contextlib.suppress(Exception):
            self._kv.key_value_set(f"{self._ns}/end/{self.role}", end, allow_overwrite=True)
        if self.role == "generate" or not wait:
            return
        start, said = time.monotonic(), False
        with contextlib.suppress(Exception):
            while self.their_end() is None and self.generator_alive():
                waited = time.monotonic() - start
                if waited > self._leave_timeout_s:
                    break
                if not said and waited > 5:
                    print("waiting for the generation process to leave", file=sys.stderr)
                    said = True
                time.sleep(0.05)


class _TrainerEnded(Exception):
    """Raised by the generation side's checks: the trainer wrote its end (``end``)."""

    def __init__(self, end: dict):
        super().__init__(end["status"])
        self.end = end


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
    `complete` before a checkpoint, `close` at the end. Its waits raise `PeerEnded` when the
    generation process ends or stops answering (`Peer.check`).
    """

    def __init__(self, exp, groups: Groups):
        self._exp, self._k = exp, exp.run.rollout.max_staleness
        self._kv = weight_channel.coordination_client()
        name, host = groups.name, groups.host
        self._ns = f"{_ROOT}/{name}"
        self._publisher = weight_channel.WeightPublisher(
            f"{name}/policy", keep=self._k + 1, host=host
        )
        self._like = _batch_like(exp)
        self._shardings = jax.tree.map(lambda s: s.sharding, self._like)
        self._receiver = weight_channel.BatchReceiver(
            f"{name}/rollouts",
            self._like,
            timeout_s=groups.timeout_s,
            host=host,
            check=groups.peer("train").check,  # the generation process ended: PeerEnded
        )
        # the generation process checks its config against this one before it generates
        self._kv.key_value_set(f"{self._ns}/config", _config_text(exp.config), allow_overwrite=True)
        self._queue: list[rollout_queue.Generated] = []
        self._next = None  # the next work order's number (= the step its batch trains)
        self._published = -1

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
                try:
                    version, batch = self._receiver.get(self._shardings)
                except ConnectionError as e:  # killed while its batch was on the wire
                    raise PeerEnded(f"the generation process stopped answering ({e})") from None
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
        """Stops serving weights (the generation group stops at the trainer's `Peer.leave`)."""
        self._publisher.close()


def generate(exp, fns, groups: Groups, sig=None) -> tuple[int, dict]:
    """The generation group's loop (one process): work orders in, rollout batches out, until the
    trainer's end (`Peer.leave`). Holds no run state: a restarted job starts at the order the
    trainer names.

    Args:
      exp, fns: this group's experiment (its mesh: this group's devices) and step programs.
      groups: the job's split (its channel name, timeouts, this process's address).
      sig: this process's `preemption.Preemption` (or None): a signal is passed to the trainer
        (`Peer.pass_signal`) and generation goes on until the trainer stops.

    Returns: (the number of batches generated, the trainer's end ``{"status", "message"}``).

    Raises:
      ConfigError: this process's config differs from the training process's.
      TimeoutError: the trainer wrote no order, published no version or took no batch within
        ``groups.timeout_s``.
    """
    kv, ns = weight_channel.coordination_client(), f"{_ROOT}/{groups.name}"
    peer, passed = Peer(groups, "generate"), False

    def check():  # between the slices of every wait
        nonlocal passed
        if sig is not None and sig.requested and not passed:
            peer.pass_signal(sig.name)
            passed = True
            print(f"{sig.name}: passed to the training process (it stops at its next safe point)")
        if (end := peer.their_end()) is not None:
            raise _TrainerEnded(end)

    def wait(key, what):
        return weight_channel.wait_for_key(kv, f"{ns}/{key}", groups.timeout_s, what, check)

    done = 0
    try:
        check_same_config(wait("config", "the training process's config"), exp.config)
        like = exp.abstract_state.params
        shardings = jax.tree.map(lambda s: s.sharding, like)
        name, host, timeout_s = groups.name, groups.host, groups.timeout_s
        weights = weight_channel.WeightSubscriber(
            f"{name}/policy", like, timeout_s=timeout_s, host=host, check=check
        )
        sender = weight_channel.BatchSender(
            f"{name}/rollouts",
            capacity=exp.run.rollout.max_staleness + 1,
            timeout_s=timeout_s,
            host=host,
            check=check,
        )
        n, held, params = int(wait("first", "the first work order's number")), None, None
        while True:
            order = json.loads(wait(f"order/{n}", f"work order {n}"))
            if order["version"] != held:  # max(n - k, 0): a new version every order after the fill
                params, held = weights.fetch(order["version"], shardings), order["version"]
            key = jax.device_put(np.asarray(order["key"], np.uint32))
            rows = np.asarray(order["rows"], np.int32)
            rollouts, util = train.dispatch_samples(exp, fns, params, rows, key)
            batch = {"rollouts": rollouts, "utilisation": jnp.stack(util) if util else None}
            sender.put(batch, held)
            kv.key_value_delete(f"{ns}/order/{n}")
            n, done = n + 1, done + 1
    except _TrainerEnded as e:
        return done, e.end
