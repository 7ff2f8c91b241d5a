"""Channels between the training and generation process groups of one `jax.distributed` job.

Two channels, both over JAX's own cross-process transfer engine (`jax.experimental.transfer`:
a `TransferServer` per process, pulls over sockets/DCN) for the bytes and over the key-value
store of the coordination service that `jax.distributed.initialize` already runs for the small
control messages. No Ray, no home-made RPC. The design around them (staleness, controllers,
checkpoints) is in docs/disaggregated.md.

- Weights, training -> generation: `WeightPublisher.publish(params, version)` once per step;
  `WeightSubscriber.latest()` fetches the newest version when the generator wants one. Keys
  under ``grpo_jax/channels/<name>/``: the publisher sets ``address`` once and ``version`` +
  ``signature`` on each publish; a subscriber takes a request id from the atomic counter
  ``next``, writes ``request/<id>`` and blocks on ``offer/<id>``; the publisher's serving thread
  answers each request by scheduling one pull of its newest copy under that id
  (`TransferServer.await_pull`) and writing the copy's version to ``offer/<id>``. A version
  nobody asks for is never offered, so skipped versions hold no memory on the publisher.
- Rollout batches, generation -> training: `BatchSender.put(batch, version)` /
  `BatchReceiver.get()`, in order, each batch received exactly once, at most ``capacity``
  unreceived.

Both ends of a channel lay the arrays out in the same *wire layout* (`wire_layout`): each leaf
split along its first axis over the first ``wire_devices`` local devices where that axis
divides, else whole on the first one. The transfer engine moves shard to matching shard and
cannot reshard on receive, so the sender copies into the wire layout (from any layout) and the
receiver `jax.device_put`s into its own.
"""

from __future__ import annotations

import hashlib
import socket
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import transfer
from jax.sharding import NamedSharding, PartitionSpec, SingleDeviceSharding

from grpo_jax.distributed import coordination_client

_ROOT = "grpo_jax/channels"


SLICE_S = 0.25  # seconds a wait blocks before it runs its ``check`` (and Python's signal handlers)


def try_get(kv, key: str) -> str | None:
    """The value of ``key`` in the key-value store, or None when it is not set.

    Raises:
      the store's other errors (a service gone) as JAX raises them (a bare XlaRuntimeError).
    """
    try:
        return kv.key_value_try_get(key)
    except Exception as e:  # JAX raises a bare XlaRuntimeError(NOT_FOUND) for a missing key
        if "NOT_FOUND" in str(e):
            return None
        raise


def wait_for_key(kv, key: str, timeout_s: float, what: str, check=None) -> str:
    """The value of ``key`` in the key-value store, waiting for it in slices of `SLICE_S`.

    Between slices ``check()`` runs (it raises to stop the wait: the other side ended, a signal)
    and so do the process's Python signal handlers: one long blocking call would delay both
    until it returned.

    Raises:
      TimeoutError: ``what`` did not come within ``timeout_s``.
      Whatever ``check`` raises; the store's own errors (a service gone) as JAX raises them.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        if check is not None:
            check()
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"{what} did not come in {timeout_s:g} s")
        try:
            return kv.blocking_key_value_get(key, max(1, int(min(SLICE_S, left) * 1000)))
        except Exception as e:  # a bare XlaRuntimeError; DEADLINE_EXCEEDED: the slice ran out
            if "DEADLINE_EXCEEDED" not in str(e):
                raise


def wire_layout(tree, devices) -> object:
    """The agreed transfer layout: a pytree of `jax.ShapeDtypeStruct` with shardings.

    Args:
      tree: a pytree of arrays or `jax.ShapeDtypeStruct` (only shapes and dtypes are read).
      devices: this process's wire devices (the same count on both sides of a channel).

    A leaf whose first axis divides by ``len(devices)`` is split along it
    (``PartitionSpec("wire")``); any other leaf (scalars included) sits whole on ``devices[0]``.
    """
    devices = list(devices)
    mesh = jax.sharding.Mesh(np.array(devices), ("wire",))

    def one(x):
        shape, dtype = tuple(x.shape), x.dtype
        if len(devices) > 1 and shape and shape[0] % len(devices) == 0:
            sharding = NamedSharding(mesh, PartitionSpec("wire"))
        else:
            sharding = SingleDeviceSharding(devices[0])
        return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)

    return jax.tree.map(one, tree)


def signature(tree) -> str:
    """A short digest of a pytree's structure, leaf shapes and dtypes (both sides compare it)."""
    leaves, treedef = jax.tree.flatten(tree)
    text = repr(treedef) + "".join(f"|{tuple(x.shape)}:{np.dtype(x.dtype).name}" for x in leaves)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


_copy = jax.jit(jnp.copy)  # a copy primitive inside jit is never forwarded to its input


def _wire_copy(tree, devices) -> list:
    """The leaves of ``tree`` copied into the wire layout over ``devices`` (fresh buffers)."""
    layout = wire_layout(tree, devices)
    # `device_put` may alias a shard it does not move (even with may_alias=False when it
    # narrows a replicated array to one device), and a donated or deleted training array
    # would then take the served copy with it; the jitted copy owns fresh buffers.
    moved = jax.tree.map(lambda x, s: jax.device_put(x, s.sharding), tree, layout)
    return jax.block_until_ready([_copy(x) for x in jax.tree.leaves(moved)])


def _local_host() -> str:
    return socket.gethostbyname(socket.gethostname())


def _server(host: str, n_devices: int):
    client = jax.local_devices()[0].client
    return transfer.start_transfer_server(client, f"{host}:0", [f"{host}:0"] * n_devices)


class WeightPublisher:
    """The training group's end: holds the newest published copy and serves pulls of it.

    Args:
      name: the channel's name (both ends use the same).
      wire_devices: how many of this process's local devices carry the wire layout (default 1).
      host: the address other hosts reach this process at (default: this host name's address;
        on a real cluster pass the interface the generation hosts can route to).
      keep: how many of the newest versions stay fetchable by number (`WeightSubscriber.fetch`;
        1 = the newest only). Each one held is a copy of the parameters on the wire devices.
      poll_s: seconds between the serving thread's looks at the request keys.

    Call `close` before ``jax.distributed.shutdown()``: the serving thread polls the
    coordination service, and a process that shuts the service down (or exits) under it can
    abort (seen as SIGABRT, "exception not rethrown", in a two-process test).

    Raises:
      RuntimeError: outside a `jax.distributed` job.
      ValueError: ``keep`` < 1.
    """

    def __init__(self, name: str, *, wire_devices=1, host=None, keep: int = 1, poll_s=0.005):
        if keep < 1:
            raise ValueError(f"weight channel: keep must be >= 1, got {keep}")
        self._kv = coordination_client()
        self._ns = f"{_ROOT}/{name}"
        self._devices = jax.local_devices()[:wire_devices]
        self._server = _server(host or _local_host(), len(self._devices))
        self._kv.key_value_set(f"{self._ns}/address", self._server.address(), allow_overwrite=True)
        self._lock = threading.Lock()
        self._held: dict[int, list] = {}  # version -> flat wire arrays, the `keep` newest
        self._keep = keep
        self._signature: str | None = None
        self.served = 0  # pulls scheduled so far
        self._error: Exception | None = None
        self._stop = threading.Event()
        self._poll_s = poll_s
        self._thread = threading.Thread(target=self._serve, name=f"weights-{name}", daemon=True)
        self._thread.start()

    def publish(self, params, version: int) -> None:
        """Makes ``params`` (any layout, any local devices) the copy served from now on.

        The arrays are copied into the wire layout, so the caller may donate or delete its
        ``params`` afterwards. Returns once the copy is made (not when anyone has pulled it).

        Raises:
          ValueError: ``version`` not larger than the last one, or a different tree structure.
        """
        version = int(version)
        sig = signature(params)
        if self._held and version <= max(self._held):
            raise ValueError(
                f"weight channel: version {version} is not newer than {max(self._held)}"
            )
        if self._signature is not None and sig != self._signature:
            raise ValueError("weight channel: the published tree's structure/shapes/dtypes changed")
        if self._error is not None:
            raise RuntimeError("weight channel: the serving thread failed") from self._error
        flat = _wire_copy(params, self._devices)
        with self._lock:
            self._held[version] = flat
            for old in sorted(self._held)[: -self._keep]:
                del self._held[old]  # pulls already scheduled keep their own references
            self._signature = sig
        self._kv.key_value_set(f"{self._ns}/signature", sig, allow_overwrite=True)
        self._kv.key_value_set(f"{self._ns}/version", str(version), allow_overwrite=True)

    def _serve(self) -> None:
        prefix = f"{self._ns}/request/"
        while not self._stop.wait(self._poll_s):
            with self._lock:
                held = dict(self._held)
            if not held:
                continue
            try:
                for key, want in self._kv.key_value_dir_get(prefix):
                    self._answer(int(key.rsplit("/", 1)[1]), want, held, key)
            except Exception as e:  # e.g. the coordination service went away: `publish` says so
                self._error = e
                return

    def _answer(self, uuid: int, want: str, held: dict, key: str) -> None:
        """Serves request ``uuid`` for version ``want`` ("newest" or a number) if it can."""
        version = max(held) if want == "newest" else int(want)
        if version > max(held):
            return  # not published yet: the request waits
        if version in held:
            self._server.await_pull(uuid, held[version])
            self.served += 1
        self._kv.key_value_delete(key)
        self._kv.key_value_set(f"{self._ns}/offer/{uuid}", str(version if version in held else -1))

    def close(self) -> None:
        """Stops serving new requests (pulls already scheduled keep their arrays alive)."""
        self._stop.set()
        self._thread.join()


class WeightSubscriber:
    """The generation group's end: asks for the newest version and receives it.

    Args:
      name: the channel's name (as the publisher's).
      like: a pytree of arrays or `jax.ShapeDtypeStruct` with the published tree's structure,
        shapes and dtypes (e.g. `jax.eval_shape` of the model's init).
      wire_devices: as the publisher's (the same count).
      host: this process's reachable address (as for `WeightPublisher`).
      timeout_s: seconds `latest` waits for the publisher before raising.
      check: called between the slices of every wait (`wait_for_key`); raises to stop it.
    """

    def __init__(
        self, name: str, like, *, wire_devices: int = 1, host=None, timeout_s=60.0, check=None
    ):
        self._kv = coordination_client()
        self._ns = f"{_ROOT}/{name}"
        self._like = like
        self._signature = signature(like)
        self._layout = wire_layout(like, jax.local_devices()[:wire_devices])
        self._server = _server(host or _local_host(), wire_devices)
        self._timeout_s, self._check = timeout_s, check
        self._connection = None

    def latest_version(self) -> int | None:
        """The newest published version (None before the first publish); a cheap key lookup."""
        version = try_get(self._kv, f"{self._ns}/version")
        return None if version is None else int(version)

    def wait_for_version(self, version: int, timeout_s: float | None = None) -> int:
        """Blocks until a version >= ``version`` is published; returns the newest version.

        Raises:
          TimeoutError: none within ``timeout_s`` (default: the subscriber's timeout).
        """
        deadline = time.monotonic() + (self._timeout_s if timeout_s is None else timeout_s)
        while (newest := self.latest_version()) is None or newest < version:
            if time.monotonic() > deadline:
                raise TimeoutError(f"weight channel {self._ns}: no version >= {version} published")
            time.sleep(0.005)
        return newest

    def latest(self, shardings=None) -> tuple[int, object]:
        """Pulls the newest published copy: ``(version, params)``.

        Args:
          shardings: optional pytree of target shardings (the generation layout); the received
            wire-layout arrays are `jax.device_put` there. None returns the wire layout.

        Raises:
          TimeoutError: the publisher did not answer within the subscriber's timeout.
          ValueError: the publisher's tree differs from ``like`` (structure, shapes or dtypes).
        """
        return self._request("newest", shardings)

    def fetch(self, version: int, shardings=None) -> object:
        """Pulls exactly ``version`` (waiting for it to be published): its params.

        The exact-staleness schedule: the batch for step t + k generated from version t, as the
        single-host ``rollout.max_staleness = k`` step does (docs/disaggregated.md).

        Raises:
          KeyError: ``version`` is older than the publisher's ``keep`` newest (or was skipped).
          TimeoutError, ValueError: as for `latest`.
        """
        got, params = self._request(str(int(version)), shardings)
        if got < 0:
            raise KeyError(f"weight channel {self._ns}: version {version} is no longer held")
        return params

    def _wait(self, key: str, what: str) -> str:
        return wait_for_key(self._kv, f"{self._ns}/{key}", self._timeout_s, what, self._check)

    def _request(self, want: str, shardings) -> tuple[int, object]:
        kv = self._kv
        published = self._wait("signature", f"weight channel {self._ns}: a first version")
        if published != self._signature:
            raise ValueError(
                f"weight channel {self._ns}: the published tree differs from the expected one "
                f"(signature {published} != {self._signature})"
            )
        if self._connection is None:
            address = self._wait("address", f"weight channel {self._ns}: the address")
            self._connection = self._server.connect(address)
        uuid = kv.key_value_increment(f"{self._ns}/next", 1)
        kv.key_value_set(f"{self._ns}/request/{uuid}", want)
        what = f"weight channel {self._ns}: the answer to request {uuid} (version {want})"
        version = int(self._wait(f"offer/{uuid}", what))
        kv.key_value_delete(f"{self._ns}/offer/{uuid}")
        if version < 0:
            return version, None
        params = jax.block_until_ready(self._connection.pull(uuid, self._layout))
        if shardings is not None:
            params = jax.device_put(params, shardings)
        return version, params


class BatchSender:
    """The generation group's end of a rollout stream: every batch is received exactly once.

    Batch n (from 1) is offered under transfer id n as soon as it is put, with its policy
    version in the key ``item/<n>``; `put` blocks while ``capacity`` batches are unreceived.
    Keys under ``grpo_jax/channels/<name>/`` (a name distinct from every other channel's).

    Args:
      name: the stream's name (both ends use the same).
      capacity: the most batches put and not yet received (the queue bound).
      wire_devices, host: as for `WeightPublisher`.
      timeout_s: seconds `put` waits for room before raising `TimeoutError`.
      check: called every `SLICE_S` while `put` waits; raises to stop it.
    """

    def __init__(
        self, name: str, *, capacity=2, wire_devices=1, host=None, timeout_s=60.0, check=None
    ):
        if capacity < 1:
            raise ValueError(f"batch stream: capacity must be >= 1, got {capacity}")
        self._kv = coordination_client()
        self._ns = f"{_ROOT}/{name}"
        self._devices = jax.local_devices()[:wire_devices]
        self._server = _server(host or _local_host(), len(self._devices))
        self._kv.key_value_set(f"{self._ns}/address", self._server.address(), allow_overwrite=True)
        self._capacity, self._timeout_s, self._check = capacity, timeout_s, check
        self._next = 1

    def _received(self) -> int:
        return int(try_get(self._kv, f"{self._ns}/received") or 0)  # none before the first `get`

    def put(self, batch, version: int) -> int:
        """Offers ``batch`` (a pytree of arrays, any local layout) tagged with the policy
        ``version`` that generated it; returns its sequence number.

        Raises:
          TimeoutError: the receiver left ``capacity`` batches unreceived for ``timeout_s``.
        """
        deadline = time.monotonic() + self._timeout_s
        checked = -float("inf")
        while self._next - self._received() > self._capacity:
            now = time.monotonic()
            if now > deadline:
                raise TimeoutError(f"batch stream {self._ns}: the receiver took none for a while")
            if self._check is not None and now - checked >= SLICE_S:
                self._check()
                checked = now
            time.sleep(0.005)
        n = self._next
        self._server.await_pull(n, _wire_copy(batch, self._devices))
        self._kv.key_value_set(f"{self._ns}/item/{n}", f"{int(version)} {signature(batch)}")
        self._next += 1
        return n


class BatchReceiver:
    """The training group's end of a rollout stream: `get` returns the batches in order.

    Args:
      name: the stream's name (as the sender's).
      like: a pytree of arrays or `jax.ShapeDtypeStruct`, the batches' structure/shapes/dtypes.
      wire_devices, host: as the sender's.
      timeout_s: seconds `get` waits for the next batch before raising `TimeoutError`.
      check: called between the slices of `get`'s wait (`wait_for_key`); raises to stop it.
    """

    def __init__(self, name: str, like, *, wire_devices=1, host=None, timeout_s=60.0, check=None):
        self._kv = coordination_client()
        self._ns = f"{_ROOT}/{name}"
        self._signature = signature(like)
        self._layout = wire_layout(like, jax.local_devices()[:wire_devices])
        self._server = _server(host or _local_host(), wire_devices)
        self._timeout_s, self._check = timeout_s, check
        self._connection = None
        self._next = 1

    def get(self, shardings=None) -> tuple[int, object]:
        """The next batch in order: ``(version, batch)``, in ``shardings`` if given.

        Raises:
          TimeoutError: no batch within the receiver's timeout.
          ValueError: the batch's structure/shapes/dtypes differ from ``like``.
          ConnectionError: the transfer broke (the sender's process went away).
        """
        n, kv = self._next, self._kv
        what = f"batch stream {self._ns}: batch {n}"
        meta = wait_for_key(kv, f"{self._ns}/item/{n}", self._timeout_s, what, self._check)
        version, sig = meta.split()
        if sig != self._signature:
            raise ValueError(
                f"batch stream {self._ns}: batch {n} differs from the expected tree "
                f"(signature {sig} != {self._signature})"
            )
        if self._connection is None:
            where = f"batch stream {self._ns}: the address"
            address = wait_for_key(kv, f"{self._ns}/address", self._timeout_s, where, self._check)
            self._connection = self._server.connect(address)
        try:
            batch = jax.block_until_ready(self._connection.pull(n, self._layout))
        except jax.errors.JaxRuntimeError as e:  # e.g. "SocketServer: Connection closed"
            message = " ".join(str(e).split())
            raise ConnectionError(f"{what}'s transfer broke: {message}") from e
        kv.key_value_delete(f"{self._ns}/item/{n}")
        kv.key_value_set(f"{self._ns}/received", str(n), allow_overwrite=True)
        self._next += 1
        if shardings is not None:
            batch = jax.device_put(batch, shardings)
        return int(version), batch
