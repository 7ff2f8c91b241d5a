"""Online difficulty classifier shared by Prompt-GDRO and Rollout-GDRO.

Source: Panaganti et al., *Group Distributionally Robust Optimization-Driven Reinforcement
Learning for LLM Reasoning*, arXiv 2601.19280 (2026), Eq. 10-11; spec: shared/spec/gdro.md s.1.

Each prompt (a stable integer id in ``[0, num_prompts)``) keeps a ring buffer of its last
``history`` visits. A visit stores one number ``c`` (``statistic``):

* ``"success_rate"`` (default): the fraction of that visit's rollouts that were correct, so the
  window mean is a window estimate of the per-sample success (pass@1). Float32 buffer: float16
  has ~3 significant digits (0.3 would be stored as 0.2998 and fall below the 0.3 edge); the
  14k x 50 buffer is 2.8 MB.
* ``"any_correct"`` (paper): ``1[any rollout correct]`` (int8 buffer). With n = 8 rollouts it is
  almost always 1 once p >= 0.25, so most prompts pile into the top bin (spec s.7).
* ``"pass_at_k"``: the unbiased pass@k of that visit (float32 buffer).

The success estimate ``p_hat`` is the mean of the stored visits (Eq. 10); bins come from the
inner edges ``a_1 < ... < a_{B-1}`` (Eq. 11), with ``p_hat = 1`` in the top bin.

Never-seen prompts. Default (``separate_unseen=True``): ``classify`` returns the marker
``B = num_bins`` ("unseen", ``config.unseen_index``), one past the last bin, so they are not
mixed with never-solved prompts (spec s.7). Both controllers accept it: Prompt-GDRO gives such
rollouts weight 1 and keeps them out of every bin score, Rollout-GDRO gives them ``n_bar``
rollouts; ``bin_success`` and the per-bin diagnostics leave them out. Paper
(``separate_unseen=False``): ``p_hat = 0`` and bin ``unseen_bin`` (0).

``mode="paper"`` sets ``statistic="any_correct"`` and ``separate_unseen=False`` (the paper and
released patch); an explicitly given field wins over the mode.

Hysteresis (margin ``delta``, both directions). For two adjacent bins with edge ``e`` between
them, a prompt moves up only when ``p_hat >= e + delta`` and down only when
``p_hat <= e - delta`` (spec s.1). For any jump we use the dead-band form of the same rule:
``new = clip(previous_bin, bin(p_hat - delta), bin(p_hat + delta))`` - the prompt keeps its bin
if that bin is within ``delta`` of ``p_hat``, otherwise it goes to the nearest bin that is. This
equals the spec's rule for adjacent bins; for jumps of several bins the literal rule ("cross the
upper edge of the lower bin by delta") would keep a prompt at bin 9 with ``p_hat = 0.29``, which
we do not want. The patch's defect (a prompt never moves down with uniform edges and
``delta > 0``) cannot occur: the clip bounds always contain the raw bin.

Order within a step: ``classify`` before generation (past visits only), ``classifier_update``
after, with this step's outcomes. The "previous bin" used by the hysteresis is the bin the prompt
was classified into at its last visit (``update`` recomputes it from the pre-visit state, so the
caller does not pass bins around).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp

STATISTICS = ("success_rate", "any_correct", "pass_at_k")
MODES = ("corrected", "paper")
_TOL = 1e-6  # float32 slack so that p_hat exactly on e +/- delta counts as crossed (spec: >=, <=)


def _config_from_dict(cls, d: Mapping[str, Any]):
    d = dict(d)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        raise ValueError(f"{cls.__name__}: unknown field(s) {unknown}; known: {sorted(names)}")
    return cls(**d)


def _resolve_mode(config, defaults: Mapping[str, tuple[Any, Any]]) -> None:
    """Fills the fields left at ``None`` from ``config.mode``: ``defaults[name] = (corrected,
    paper)``. Raises ValueError for an unknown mode."""
    name = type(config).__name__
    if config.mode not in MODES:
        raise ValueError(f"{name}.mode must be one of {MODES}; got {config.mode!r}")
    for field, (corrected, paper) in defaults.items():
        if getattr(config, field) is None:
            object.__setattr__(config, field, paper if config.mode == "paper" else corrected)


@dataclasses.dataclass(frozen=True)
class ClassifierConfig:
    """Static configuration of the online difficulty classifier (hashable: a jit static arg).

    Attributes:
      edges: inner bin edges ``a_1 < ... < a_{B-1}``, each in (0, 1); ``B = len(edges) + 1`` bins,
        bin 0 = lowest success rate (hardest). Default 0.1 ... 0.9 (B = 10, paper Eq. 11).
      history: ``H``, visits kept per prompt (paper: 50; 100 for runs with >= 6 bins).
      delta: hysteresis margin in success-rate units, in [0, 0.5). None (default): the
        curriculum's own margin, `Curriculum.hysteresis` (Prompt-GDRO 0.03 and 0 for
        Rollout-GDRO, as the paper; 0 for the others), resolved by the run's typed config
        (`config_schema.typed`); a classifier built alone applies 0 (`margin`).
      unseen_bin: bin of never-visited prompts when ``separate_unseen=False`` (paper: 0, i.e.
        ``p_hat = 0``); unused otherwise.
      statistic: per-visit statistic: ``"success_rate"`` (default: fraction of the visit's
        rollouts correct, float32 buffer), ``"any_correct"`` (paper; int8 buffer) or
        ``"pass_at_k"`` (unbiased pass@k when the visit has ``n >= pass_k`` rollouts, else
        any-correct; float32 buffer). None: from ``mode``.
      pass_k: ``k`` for ``statistic="pass_at_k"`` (>= 1).
      separate_unseen: never-visited prompts get the marker ``B`` instead of ``unseen_bin``
        (default True, paper False). None: from ``mode``.
      mode: ``"corrected"`` (default) or ``"paper"``: the value of every switch left at None.

    Build from a config section with ``ClassifierConfig(**section)`` or ``from_dict(section)``.

    Raises:
      ValueError naming the field, for unsorted edges, edges outside (0, 1), ``history < 1``,
      ``delta`` outside [0, 0.5), ``unseen_bin`` outside [0, B), unknown statistic or mode,
      ``pass_k < 1``.
    """

    edges: tuple[float, ...] = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)
    history: int = 50
    delta: float | None = None
    unseen_bin: int = 0
    statistic: str | None = None
    pass_k: int = 4
    separate_unseen: bool | None = None
    mode: str = "corrected"

    def __post_init__(self):
        edges = tuple(float(e) for e in self.edges)
        object.__setattr__(self, "edges", edges)
        if self.delta is not None:  # None: the curriculum's margin; alone, 0 (`margin`)
            object.__setattr__(self, "delta", float(self.delta))
        _resolve_mode(
            self,
            {"statistic": ("success_rate", "any_correct"), "separate_unseen": (True, False)},
        )
        object.__setattr__(self, "separate_unseen", bool(self.separate_unseen))
        self.validate()

    def validate(self) -> None:
        e = self.edges
        if any(not (0.0 < x < 1.0) for x in e):
            raise ValueError(f"ClassifierConfig.edges must lie strictly inside (0, 1); got {e}")
        if any(b <= a for a, b in zip(e, e[1:])):
            raise ValueError(f"ClassifierConfig.edges must be strictly increasing; got {e}")
        if int(self.history) != self.history or self.history < 1:
            raise ValueError(
                f"ClassifierConfig.history must be an integer >= 1; got {self.history}"
            )
        if not (0.0 <= self.margin < 0.5):
            raise ValueError(f"ClassifierConfig.delta must be in [0, 0.5); got {self.delta}")
        if not (0 <= self.unseen_bin < self.num_bins):
            raise ValueError(
                f"ClassifierConfig.unseen_bin must be in [0, {self.num_bins}); "
                f"got {self.unseen_bin}"
            )
        if self.statistic not in STATISTICS:
            raise ValueError(
                f"ClassifierConfig.statistic must be one of {STATISTICS}; got {self.statistic!r}"
            )
        if int(self.pass_k) != self.pass_k or self.pass_k < 1:
            raise ValueError(f"ClassifierConfig.pass_k must be an integer >= 1; got {self.pass_k}")

    @property
    def margin(self) -> float:
        """The hysteresis margin the classifier applies: ``delta``, or 0 while it is None (a
        classifier built alone; a run's typed config holds the curriculum's margin)."""
        return 0.0 if self.delta is None else self.delta

    @property
    def num_bins(self) -> int:
        return len(self.edges) + 1

    @property
    def unseen_index(self) -> int:
        """What ``classify`` returns for a never-visited prompt: ``B`` or ``unseen_bin``."""
        return self.num_bins if self.separate_unseen else int(self.unseen_bin)

    @property
    def buffer_dtype(self):
        return jnp.int8 if self.statistic == "any_correct" else jnp.float32

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ClassifierConfig:
        """Builds from a mapping (dict / ml_collections.ConfigDict); unknown keys raise ValueError."""
        return _config_from_dict(cls, d)


@flax.struct.dataclass
class ClassifierState:
    """Per-prompt visit history (a pytree; checkpoints with Orbax).

    Attributes:
      buffer: ``[num_prompts, H]`` float32 (success rate, pass@k) or int8 (any-correct); ring
        buffer of visits, unwritten slots are 0.
      write_index: ``[num_prompts]`` int32, next slot to write in ``[0, H)``.
      count: ``[num_prompts]`` int32, visits stored (``min(visits, H)``).
      last_bin: ``[num_prompts]`` int32, bin assigned at the last visit (hysteresis anchor;
        ``B`` = the prompt was unseen then, no anchor); meaningless while ``count == 0``.
    """

    buffer: jax.Array
    write_index: jax.Array
    count: jax.Array
    last_bin: jax.Array


def classifier_init(config: ClassifierConfig, num_prompts: int) -> ClassifierState:
    """Empty state for ``num_prompts`` dataset prompts (ids ``0 .. num_prompts-1``)."""
    if int(num_prompts) < 1:
        raise ValueError(f"num_prompts must be >= 1; got {num_prompts}")
    n = int(num_prompts)
    return ClassifierState(
        buffer=jnp.zeros((n, config.history), config.buffer_dtype),
        write_index=jnp.zeros((n,), jnp.int32),
        count=jnp.zeros((n,), jnp.int32),
        last_bin=jnp.full((n,), config.unseen_index, jnp.int32),
    )


@functools.partial(jax.jit, static_argnames="config")
def success_estimate(
    config: ClassifierConfig, state: ClassifierState, prompt_ids: jax.Array
) -> jax.Array:
    """``p_hat [P]`` float32: mean of the stored visits (Eq. 10); 0 for never-seen prompts.

    Args:
      prompt_ids: ``[P]`` int, dataset ids in ``[0, num_prompts)`` (out-of-range ids are clamped).
    """
    ids = jnp.asarray(prompt_ids, jnp.int32)
    total = jnp.sum(state.buffer[ids].astype(jnp.float32), axis=-1)
    return total / jnp.maximum(state.count[ids], 1).astype(jnp.float32)


def _raw_bin(edges: jax.Array, p: jax.Array) -> jax.Array:
    return jnp.searchsorted(edges, p, side="right").astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="config")
def classify(config: ClassifierConfig, state: ClassifierState, prompt_ids: jax.Array) -> jax.Array:
    """Bins ``[P]`` int32 of the given prompts, from past visits only: in ``[0, B)`` for visited
    prompts, ``config.unseen_index`` for never-visited ones (``B`` with ``separate_unseen``,
    else ``unseen_bin``).

    Pure: does not change the state (``classifier_update`` records the bin used). A prompt id that
    appears twice gets the same bin twice. A prompt whose anchor is the unseen marker (first
    classification after its first visit) gets its raw bin.

    Args:
      config: static ``ClassifierConfig``.
      state: ``ClassifierState``.
      prompt_ids: ``[P]`` int dataset ids.
    """
    ids = jnp.asarray(prompt_ids, jnp.int32)
    p = success_estimate(config, state, ids)
    edges = jnp.asarray(config.edges, jnp.float32)
    if config.margin > 0:
        tol = min(_TOL, config.margin / 2)
        lo = _raw_bin(edges, p - config.margin + tol)  # highest bin reachable from below
        hi = _raw_bin(edges, p + config.margin - tol)  # lowest bin reachable from above
        prev = state.last_bin[ids]
        if config.separate_unseen:  # no anchor yet: the raw bin
            prev = jnp.where(prev >= config.num_bins, _raw_bin(edges, p), prev)
        bins = jnp.clip(prev, lo, hi)
    else:
        bins = _raw_bin(edges, p)
    return jnp.where(state.count[ids] > 0, bins, config.unseen_index).astype(jnp.int32)


@functools.partial(jax.jit, static_argnames="config")
def classifier_update(
    config: ClassifierConfig, state: ClassifierState, prompt_ids: jax.Array, outcome: jax.Array
) -> ClassifierState:
    """Records one visit per distinct prompt id and its bin; returns the new state.

    Call after the step, with the ids classified before generation. Duplicate ids in one batch are
    combined into one visit, so the result does not depend on their order: the mean outcome for
    ``success_rate`` (equal group sizes: the pooled success rate), the maximum otherwise
    (``any()`` for indicators; the paper code's rule).

    Args:
      config: static ``ClassifierConfig``.
      state: ``ClassifierState``.
      prompt_ids: ``[P]`` int dataset ids (ids outside ``[0, num_prompts)`` are ignored).
      outcome: ``[P]`` float success rates / pass@k values in [0, 1], or bool / 0-1
        any-correct indicators (``visit_outcome``).
    """
    ids = jnp.asarray(prompt_ids, jnp.int32)
    n, h = state.buffer.shape
    num = ids.shape[0]
    bins = classify(config, state, ids)  # the bin used this step
    val = jnp.asarray(outcome).astype(jnp.float32)
    if config.statistic == "any_correct":
        val = (val > 0).astype(jnp.float32)
    if config.statistic == "success_rate":
        tot = jnp.zeros((n,), jnp.float32).at[ids].add(val, mode="drop")
        dup = jnp.zeros((n,), jnp.float32).at[ids].add(1.0, mode="drop")
        combined = (tot / jnp.maximum(dup, 1.0))[jnp.clip(ids, 0, n - 1)]
    else:
        combined = jnp.zeros((n,), jnp.float32).at[ids].max(val, mode="drop")
        combined = combined[jnp.clip(ids, 0, n - 1)]
    pos = jnp.arange(num, dtype=jnp.int32)
    first_pos = jnp.full((n,), num, jnp.int32).at[ids].min(pos, mode="drop")
    is_first = (ids >= 0) & (ids < n) & (first_pos[jnp.clip(ids, 0, n - 1)] == pos)
    rows = jnp.where(is_first, ids, n)  # n: out of bounds -> dropped
    safe = jnp.clip(ids, 0, n - 1)
    cols = state.write_index[safe]
    return ClassifierState(
        buffer=state.buffer.at[rows, cols].set(combined.astype(state.buffer.dtype), mode="drop"),
        write_index=state.write_index.at[rows].set((cols + 1) % h, mode="drop"),
        count=state.count.at[rows].set(jnp.minimum(state.count[safe] + 1, h), mode="drop"),
        last_bin=state.last_bin.at[rows].set(bins, mode="drop"),
    )


@functools.partial(jax.jit, static_argnames=("config", "num_prompts"))
def visit_outcome(
    config: ClassifierConfig, correct: jax.Array, segment_ids: jax.Array, num_prompts: int
) -> jax.Array:
    """Per-prompt visit statistic ``[P]`` float32 from per-rollout correctness.

    ``success_rate``: ``c / n`` (``c`` of the prompt's ``n`` rollouts correct; 0 when ``n = 0``).
    ``any_correct``: ``1[c > 0]``. ``pass_at_k``: the unbiased estimator
    ``1 - C(n-c, k) / C(n, k)`` (Chen et al. 2021, Eq. 1) when ``n >= k``, otherwise any-correct.

    Args:
      correct: ``[R]`` bool, rollout is correct.
      segment_ids: ``[R]`` int32 rollout -> prompt position in ``[0, num_prompts)``.
      num_prompts: ``P`` (static).
    """
    c = jax.ops.segment_sum(jnp.asarray(correct).astype(jnp.float32), segment_ids, num_prompts)
    nn = jax.ops.segment_sum(
        jnp.ones(jnp.shape(segment_ids), jnp.float32), segment_ids, num_prompts
    )
    any_c = (c > 0).astype(jnp.float32)
    if config.statistic == "success_rate":
        return c / jnp.maximum(nn, 1.0)
    if config.statistic == "any_correct":
        return any_c
    k = config.pass_k
    fail = jnp.ones_like(c)  # C(n-c, k) / C(n, k) = prod_j (n-c-j)/(n-j)
    for j in range(k):
        num = nn - c - j
        fail = fail * jnp.where(num > 0, num / jnp.maximum(nn - j, 1.0), 0.0)
    return jnp.where(nn >= k, 1.0 - fail, any_c)


@functools.partial(jax.jit, static_argnames=("config", "num_bins"))
def bin_success(
    config: ClassifierConfig,
    state: ClassifierState,
    prompt_ids,
    bins,
    num_bins: int | None = None,
) -> jax.Array:
    """Per-bin success rate ``[B]`` float32: mean ``p_hat`` of this batch's prompts in each bin.

    Input of the Rollout-GDRO ``sqrt`` allocator (``v_b = p_b (1 - p_b) + v_floor``, Thm 4.2).
    With the default statistic ``p_hat`` is the window per-sample success (pass@1), so ``v_b``
    is the Bernoulli variance of one rollout's reward; with ``any_correct`` (paper) it is the
    any-of-n rate. Bins without prompts get 0 (they receive no rollouts, so the value is
    unused); unseen prompts (marker ``B``) are left out.

    Args:
      prompt_ids: ``[P]`` int dataset ids; bins: ``[P]`` int their bins (from ``classify``).
      num_bins: ``B`` (default ``config.num_bins``).
    """
    b = config.num_bins if num_bins is None else int(num_bins)
    p = success_estimate(config, state, jnp.asarray(prompt_ids, jnp.int32))
    bins = jnp.asarray(bins, jnp.int32)
    total = jax.ops.segment_sum(p, bins, b)
    count = jax.ops.segment_sum(jnp.ones_like(p), bins, b)
    return total / jnp.maximum(count, 1.0)


__all__ = [
    "ClassifierConfig",
    "ClassifierState",
    "classifier_init",
    "classify",
    "classifier_update",
    "success_estimate",
    "visit_outcome",
    "bin_success",
    "STATISTICS",
    "MODES",
]
