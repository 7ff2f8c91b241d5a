"""Prompt input pipeline: seeded epoch-wise shuffling, per-host sharding, exact resume.

`PromptSource` serves the training prompts of each step. It is deliberately plain NumPy (prompts
are a few thousand small dicts; the expensive work is generation), deterministic given
``(examples, seed, state)`` and identical on every host, so that host ``h`` of ``H`` can take
its contiguous share of the *global* batch without communication.

Uniform mode (`next`): the global stream is the concatenation of per-epoch permutations
``perm_e = default_rng([seed, e]).permutation(N)``; a step takes the next ``prompts_per_step``
positions of that stream (crossing epoch boundaries when needed), and host ``h`` keeps positions
``[h*P/H, (h+1)*P/H)`` of the step. The state is the global position (examples consumed).

Bin mode (`next_by_bin`, Prompt-GDRO ``apply=resample``, spec/gdro.md §2): each of the step's
``P`` slots draws a bin ``b ~ q`` (renormalised over bins that have at least one example), then an
example uniformly within the bin, without replacement inside a step while the bin has enough
examples. The draw uses ``default_rng([seed, 1, bin_steps])`` (``bin_steps`` counts calls), so it
too resumes exactly from `get_state`. Both modes can be mixed; each has its own counter.

Ids: every example's ``"id"`` must equal its index in `examples` (the loaders in
`grpo_jax.data.datasets` and `make_arithmetic` guarantee it); the GDRO classifier indexes its
``[num_prompts, H]`` state by that id. Use `reindex` to renumber a filtered list.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["PromptSource", "reindex"]

_BIN_STREAM = 1  # second seed word of the bin-mode generator (uniform mode uses the epoch)


def reindex(examples: Sequence[dict]) -> list[dict]:
    """Shallow copies of `examples` with ``id`` = position (keeps the old id as ``source_id``)."""
    out = []
    for i, ex in enumerate(examples):
        ex = dict(ex)
        if "id" in ex and "source_id" not in ex:
            ex["source_id"] = ex["id"]
        ex["id"] = i
        out.append(ex)
    return out


class PromptSource:
    """Seeded, epoch-aware prompt sampler with per-host sharding and an exact checkpointable state.

    Args:
      examples: example dicts; ``examples[i]["id"] == i`` is required (ValueError otherwise).
      prompts_per_step: global number of prompts per step ``P`` (over all hosts).
      seed: shuffling seed.
      process_index: this host's index ``h`` (``jax.process_index()``).
      process_count: number of hosts ``H`` (``jax.process_count()``); must divide ``P``.

    Attributes:
      num_examples: ``N = len(examples)``.
      local_prompts_per_step: ``P // H``, the length of the lists `next` returns.

    Raises:
      ValueError: empty examples, ids not equal to indices, ``P < 1``, bad host index/count.
    """

    def __init__(
        self,
        examples: Sequence[dict],
        prompts_per_step: int,
        *,
        seed: int,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if len(examples) == 0:
            raise ValueError("PromptSource: examples is empty")
        for i, ex in enumerate(examples):
            if ex.get("id") != i:
                raise ValueError(
                    f"PromptSource: examples[{i}]['id'] = {ex.get('id')!r}, expected {i} "
                    "(ids must equal list positions; use grpo_jax.data.pipeline.reindex)"
                )
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if process_count < 1 or not 0 <= process_index < process_count:
            raise ValueError(f"bad process_index/process_count: {process_index}/{process_count}")
        if prompts_per_step % process_count:
            raise ValueError(
                f"prompts_per_step ({prompts_per_step}) must be divisible by process_count "
                f"({process_count})"
            )
        self._examples = list(examples)
        self.num_examples = len(self._examples)
        self.prompts_per_step = int(prompts_per_step)
        self.seed = int(seed)
        self.process_index = int(process_index)
        self.process_count = int(process_count)
        self.local_prompts_per_step = self.prompts_per_step // self.process_count
        self._position = 0  # global examples consumed in uniform mode
        self._bin_steps = 0  # calls of next_by_bin
        self._perm_cache: dict[int, np.ndarray] = {}

    # ---------------------------------------------------------------- uniform mode
    def _perm(self, epoch: int) -> np.ndarray:
        perm = self._perm_cache.get(epoch)
        if perm is None:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_examples)
            self._perm_cache = {epoch: perm}  # keep one epoch (a step spans at most a few)
        return perm

    def global_ids(self, position: int, count: int) -> np.ndarray:
        """Ids at global stream positions ``[position, position+count)``, int64 [count]."""
        out = np.empty(count, dtype=np.int64)
        n = self.num_examples
        k = 0
        while k < count:
            epoch, offset = divmod(position + k, n)
            take = min(count - k, n - offset)
            out[k : k + take] = self._perm(epoch)[offset : offset + take]
            k += take
        return out

    def _local(self, ids: np.ndarray) -> list[dict]:
        lo = self.process_index * self.local_prompts_per_step
        return [self._examples[int(i)] for i in ids[lo : lo + self.local_prompts_per_step]]

    def next(self) -> list[dict]:
        """The next step's prompts for this host: ``P // H`` example dicts (not copies)."""
        ids = self.global_ids(self._position, self.prompts_per_step)
        self._position += self.prompts_per_step
        return self._local(ids)

    @property
    def epoch(self) -> int:
        """Current epoch of the uniform stream (``position // N``)."""
        return self._position // self.num_examples

    # ---------------------------------------------------------------- bin mode
    def next_by_bin(
        self, q: np.ndarray, bins_by_id: np.ndarray, rng: np.random.Generator | int | None = None
    ) -> list[dict]:
        """Prompt-GDRO resampling: per slot draw a bin from `q`, then an example in that bin.

        Args:
          q: float [B] bin probabilities (non-negative, positive total over non-empty bins; they
            are renormalised over the bins that hold at least one example).
          bins_by_id: int [num_examples], the current bin of each example id (0 <= bin < B).
          rng: None (default) = the internal generator ``default_rng([seed, 1, bin_steps])``,
            which makes the draw resume exactly from `get_state`; an int seed or a Generator
            overrides it (then the caller owns reproducibility). Every host must pass the same.

        Returns:
          This host's ``P // H`` example dicts of the globally drawn batch.

        Raises:
          ValueError: on shape mismatches, bins out of range, or no probability mass on any
            non-empty bin.
        """
        q = np.asarray(q, dtype=np.float64)
        bins_by_id = np.asarray(bins_by_id)
        if q.ndim != 1 or q.size == 0:
            raise ValueError(f"q must be a non-empty 1-D array, got shape {q.shape}")
        if bins_by_id.shape != (self.num_examples,):
            raise ValueError(
                f"bins_by_id must have shape ({self.num_examples},), got {bins_by_id.shape}"
            )
        if not np.issubdtype(bins_by_id.dtype, np.integer):
            raise ValueError(f"bins_by_id must be integer, got {bins_by_id.dtype}")
        if bins_by_id.min() < 0 or bins_by_id.max() >= q.size:
            raise ValueError(f"bins_by_id values must lie in [0, {q.size})")
        if not np.all(np.isfinite(q)) or np.any(q < 0):
            raise ValueError(f"q must be finite and >= 0, got {q}")
        sizes = np.bincount(bins_by_id, minlength=q.size)
        p = np.where(sizes > 0, q, 0.0)
        if p.sum() <= 0:
            raise ValueError("q puts no mass on any bin that holds examples")
        p = p / p.sum()

        if rng is None:
            gen = np.random.default_rng([self.seed, _BIN_STREAM, self._bin_steps])
        elif isinstance(rng, np.random.Generator):
            gen = rng
        else:
            gen = np.random.default_rng(int(rng))
        self._bin_steps += 1

        slot_bins = gen.choice(q.size, size=self.prompts_per_step, p=p)
        ids = np.empty(self.prompts_per_step, dtype=np.int64)
        order = np.argsort(bins_by_id, kind="stable")
        starts = np.concatenate([[0], np.cumsum(sizes)])
        for b in np.unique(slot_bins):
            slots = np.nonzero(slot_bins == b)[0]
            members = order[starts[b] : starts[b + 1]]
            ids[slots] = gen.choice(members, size=slots.size, replace=slots.size > members.size)
        return self._local(ids)

    # ---------------------------------------------------------------- state
    def get_state(self) -> dict[str, int]:
        """Exact resume state (plain ints; checkpoint it with the train state)."""
        return {
            "position": self._position,
            "bin_steps": self._bin_steps,
            "seed": self.seed,
            "num_examples": self.num_examples,
            "prompts_per_step": self.prompts_per_step,
        }

    def set_state(self, state: dict) -> None:
        """Restore a `get_state` dict. Raises ValueError if seed / dataset size / P differ."""
        for key in ("seed", "num_examples", "prompts_per_step"):
            if key in state and int(state[key]) != getattr(self, key):
                raise ValueError(
                    f"PromptSource.set_state: {key}={int(state[key])} in the checkpoint but "
                    f"{getattr(self, key)} now"
                )
        self._position = int(state["position"])
        self._bin_steps = int(state.get("bin_steps", 0))

    def __len__(self) -> int:
        return self.num_examples
