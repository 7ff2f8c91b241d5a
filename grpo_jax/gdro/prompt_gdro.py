"""Prompt-GDRO: the data adversary (exponential weights over difficulty bins).

Source: Panaganti et al., arXiv 2601.19280 (2026), Eq. 7-9 (game), 12 (frequency debiasing),
13 (EMA), 14-15 (weights), 16 (application); spec: shared/spec/gdro.md s.2 and s.4.

Per step, for the bins present in the batch (bins of the rollouts, from ``classify``):

1. ``l_b`` = mean over the bin's rollouts of the loss signal (``loss_signal``: ``1 - correct``,
   the default, or the paper's token-mean clipped surrogate with unweighted advantages).
2. Paper only (``share_division=True``): debias by the bin's share of the batch's rollouts,
   ``l_b / max(share_b, share_floor)`` (Eq. 12). The signal is already a per-bin *mean*, so the
   division makes the score ~ 1 / count: bins with 1-2 prompts take most of the weight (spec
   s.7). Default: no division.
3. EMA ``S_b <- (1 - beta) S_b + beta l_b``; the first observation sets ``S_b = l_b``; bins absent
   this step keep their score; never-seen bins have ``S = 0`` (Eq. 13).
4. ``q_b = (1 - gamma) softmax(eta clip(S, -C, C))_b + gamma / B_active`` over the active bins,
   0 elsewhere (Eq. 14-15; the softmax is the normalised ``omega_b = exp(eta S_b)``, computed
   stably).
5. ``advantage_weight``: per rollout ``w_i = q_{b(i)} R / sum_i' q_{b(i')}`` (mean 1), then
   ``min(w_i, weight_cap)``; the loss multiplies the *advantages* by ``w`` (never the KL term).
   Default (``renormalise_informative=True``): the mean-1 normalisation runs over the
   *informative* rollouts only (non-zero advantage; all-equal groups carry no gradient, so
   letting them absorb weight mass only shrinks the effective step). Rollouts of unseen prompts
   (bin marker ``B``, see ``classifier``) get weight 1 and enter no bin score.
   ``resample``: weights are 1 and the next batch is drawn by bin with ``q``
   (``sample_prompts_by_bin``); the signal stays a per-bin mean, so the sampler is not biased
   by bin frequency.

Order in the trainer: ``w = prompt_gdro_weights(state, bins, advantages=adv)`` before the
update (uses the scores of past steps), ``prompt_gdro_update(state, bins, signal,
advantages=adv)`` after it (its diagnostics then include the weights' effective sample size and
whether the cap bound).

``mode="paper"`` sets ``share_division=True``, ``renormalise_informative=False`` and
``signal="surrogate_loss"``; an explicitly given field wins over the mode.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import flax
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.gdro.classifier import _config_from_dict, _resolve_mode

APPLY_MODES = ("advantage_weight", "resample")
SIGNALS = ("surrogate_loss", "failure_rate", "informative")


@dataclasses.dataclass(frozen=True)
class PromptGDROConfig:
    """Static configuration of Prompt-GDRO (hashable: a jit static arg).

    Attributes:
      eta: ``eta_q``, exponential-weights step size (0.65), >= 0. ``eta = 0`` is GRPO exactly in
        both apply modes (unit weights; the uniform prompt stream). With the failure-rate signal
        (scores in [0, 1]) the tilt between bins is at most ``exp(eta)``: 0.65 gives <= 1.9x and
        weights that hardly move (reports/gdro_first_run/gdro_vs_grpo.md); tilts that act need eta ~ 2-6.
      gamma: uniform mixing over the active bins (0.01), in [0, 1].
      beta: EMA rate of the bin scores (0.12), in (0, 1].
      share_floor: floor on a bin's batch share in the Eq. 12 division (1e-3), > 0; used only
        with ``share_division``.
      score_clip: ``C``, scores clipped to [-C, C] before the exponential; 0 = no clip (None
        is read as 0).
      weight_cap: cap on the per-rollout advantage weights (15), >= 1.
      apply: ``"advantage_weight"`` (paper) or ``"resample"``.
      signal: loss signal, ``"failure_rate"`` (default: ``1 - correct``), ``"surrogate_loss"``
        (paper: per-rollout token-mean clipped surrogate with the unweighted advantages,
        detached, no KL; exactly 0 with one on-policy update per step, spec s.7: needs >= 2
        mini-batches per step) or ``"informative"`` (a learnability signal: 1 for a rollout of
        a group with non-zero advantages, so a bin's score is its share of informative
        rollouts). None: from ``mode``.
      share_division: divide a bin's mean signal by its batch share (Eq. 12). Default False,
        paper True. None: from ``mode``.
      renormalise_informative: mean-1 weights over the rollouts with non-zero advantage
        (default True) instead of over all rollouts (paper False). None: from ``mode``.
      population_weighted: ``resample`` draws a bin with probability proportional to its
        population times its weight, i.e. a prompt with probability ``∝ q_{b(i)}`` (default
        True: ``eta = 0`` is the uniform sampler); False: bins drawn with ``q`` itself, so a
        bin of one prompt is drawn as often as a bin of 500 (the earlier reading; paper mode).
        None: from ``mode``.
      mode: ``"corrected"`` (default) or ``"paper"``: the value of every switch left at None.

    Raises:
      ValueError naming the field for out-of-range values or unknown modes.
    """

    eta: float = 0.65
    gamma: float = 0.01
    beta: float = 0.12
    share_floor: float = 1e-3
    score_clip: float = 0.0
    weight_cap: float = 15.0
    apply: str = "advantage_weight"
    signal: str | None = None
    share_division: bool | None = None
    renormalise_informative: bool | None = None
    population_weighted: bool | None = None
    mode: str = "corrected"

    def __post_init__(self):
        _resolve_mode(
            self,
            {
                "signal": ("failure_rate", "surrogate_loss"),
                "share_division": (False, True),
                "renormalise_informative": (True, False),
                "population_weighted": (True, False),
            },
        )
        for name in ("share_division", "renormalise_informative", "population_weighted"):
            object.__setattr__(self, name, bool(getattr(self, name)))
        for name in ("eta", "gamma", "beta", "share_floor", "weight_cap"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "score_clip", float(self.score_clip or 0.0))
        self.validate()

    def validate(self) -> None:
        if not self.eta >= 0:
            raise ValueError(f"PromptGDROConfig.eta must be >= 0; got {self.eta}")
        if not 0.0 <= self.gamma <= 1.0:
            raise ValueError(f"PromptGDROConfig.gamma must be in [0, 1]; got {self.gamma}")
        if not 0.0 < self.beta <= 1.0:
            raise ValueError(f"PromptGDROConfig.beta must be in (0, 1]; got {self.beta}")
        if not self.share_floor > 0:
            raise ValueError(f"PromptGDROConfig.share_floor must be > 0; got {self.share_floor}")
        if not self.score_clip >= 0:
            raise ValueError(
                f"PromptGDROConfig.score_clip must be >= 0 (0 = no clip); got {self.score_clip}"
            )
        if not self.weight_cap >= 1.0:
            raise ValueError(f"PromptGDROConfig.weight_cap must be >= 1; got {self.weight_cap}")
        if self.apply not in APPLY_MODES:
            raise ValueError(
                f"PromptGDROConfig.apply must be one of {APPLY_MODES}; got {self.apply!r}"
            )
        if self.signal not in SIGNALS:
            raise ValueError(
                f"PromptGDROConfig.signal must be one of {SIGNALS}; got {self.signal!r}"
            )

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> PromptGDROConfig:
        """Builds from a mapping (dict / ml_collections.ConfigDict); unknown keys raise ValueError."""
        return _config_from_dict(cls, d)


@flax.struct.dataclass
class PromptGDROState:
    """Prompt-GDRO state (a pytree; checkpoints with Orbax).

    Attributes:
      score: ``[B]`` float32, EMA scores ``S_b`` (Eq. 13).
      seen: ``[B]`` bool, bin has been observed at least once.
      step: ``[]`` int32, number of updates.
    """

    score: jax.Array
    seen: jax.Array
    step: jax.Array


def prompt_gdro_init(config: PromptGDROConfig, num_bins: int) -> PromptGDROState:
    """Zero scores for ``num_bins`` bins."""
    del config
    if int(num_bins) < 1:
        raise ValueError(f"num_bins must be >= 1; got {num_bins}")
    return PromptGDROState(
        score=jnp.zeros((num_bins,), jnp.float32),
        seen=jnp.zeros((num_bins,), bool),
        step=jnp.zeros((), jnp.int32),
    )


def loss_signal(config, per_rollout_loss=None, correct=None, advantages=None) -> jax.Array:
    """The per-rollout loss signal ``[R]`` float32 selected by ``config.signal``.

    Works for ``PromptGDROConfig`` and ``RolloutGDROConfig``.

    Args:
      per_rollout_loss: ``[R]`` float, token-mean clipped surrogate per rollout computed with the
        unweighted advantages (``signal="surrogate_loss"``).
      correct: ``[R]`` bool, rollout correctness (``signal="failure_rate"``: returns ``1 - correct``).
      advantages: ``[R]`` float, the unweighted advantages (``signal="informative"``: returns
        ``1[advantage != 0]``).

    Raises:
      ValueError when the array the config asks for is missing.
    """
    if config.signal == "surrogate_loss":
        if per_rollout_loss is None:
            raise ValueError("signal='surrogate_loss' needs per_rollout_loss [R]")
        return jnp.asarray(per_rollout_loss, jnp.float32)
    if config.signal == "informative":
        if advantages is None:
            raise ValueError("signal='informative' needs advantages [R]")
        return (jnp.asarray(advantages) != 0).astype(jnp.float32)
    if correct is None:
        raise ValueError("signal='failure_rate' needs correct [R]")
    return 1.0 - jnp.asarray(correct).astype(jnp.float32)


def _valid(bins, valid):
    return (
        jnp.ones(jnp.shape(bins), jnp.float32)
        if valid is None
        else jnp.asarray(valid).astype(jnp.float32)
    )


def _informative(bins, advantages, informative):
    """``[R]`` float32 mask of rollouts with a policy gradient (``advantages != 0``, or the given
    mask); all ones when neither is given."""
    if informative is not None:
        return jnp.asarray(informative).astype(jnp.float32)
    if advantages is not None:
        return (jnp.asarray(advantages) != 0).astype(jnp.float32)
    return jnp.ones(jnp.shape(bins), jnp.float32)


def _q_from_present(config: PromptGDROConfig, score: jax.Array, present: jax.Array) -> jax.Array:
    s = score if not config.score_clip else jnp.clip(score, -config.score_clip, config.score_clip)
    logits = jnp.where(present, config.eta * s, -jnp.inf)
    soft = jax.nn.softmax(jnp.where(jnp.any(present), logits, 0.0))
    n_active = jnp.maximum(jnp.sum(present), 1).astype(jnp.float32)
    q = (1.0 - config.gamma) * soft + config.gamma / n_active
    return jnp.where(present, q, 0.0)


@functools.partial(jax.jit, static_argnames="config")
def prompt_gdro_q(
    config: PromptGDROConfig,
    state: PromptGDROState,
    bins: jax.Array,
    valid: jax.Array | None = None,
) -> jax.Array:
    """Bin weights ``q [B]`` float32 over the bins that occur in ``bins`` (Eq. 14-15).

    ``q`` is on the simplex, 0 on absent bins, and every active bin has ``q_b >= gamma/B_active``.

    Args:
      bins: ``[N]`` int bins whose distinct values are the active set: the batch's rollout bins
        (advantage weighting) or ``classify`` over all dataset prompts (``resample``).
      valid: optional ``[N]`` bool; invalid entries do not make a bin active.
    """
    b = state.score.shape[0]
    present = jax.ops.segment_sum(_valid(bins, valid), jnp.asarray(bins, jnp.int32), b) > 0
    return _q_from_present(config, state.score, present)


@functools.partial(jax.jit, static_argnames="config")
def _weights(config, state, bins_per_rollout, valid, advantages, informative):
    """(capped weights, uncapped weights, informative mask), all ``[R]`` float32."""
    v = _valid(bins_per_rollout, valid)
    inf = _informative(bins_per_rollout, advantages, informative) * v
    if config.apply == "resample" or config.eta == 0:  # eta = 0: GRPO's unit weights exactly
        return v, v, inf
    b = state.score.shape[0]
    bins = jnp.asarray(bins_per_rollout, jnp.int32)
    if not config.renormalise_informative:  # paper: mean 1 over the batch (Eq. 16)
        q = prompt_gdro_q(config, state, bins, valid)
        qi = q[bins] * v
        w = qi * jnp.sum(v) / jnp.maximum(jnp.sum(qi), 1e-30)
        seen = (bins < b).astype(jnp.float32)
        w = jnp.where(seen > 0, w, v)  # unseen marker: weight 1 (never produced in paper mode)
        return jnp.minimum(w, config.weight_cap), w, inf
    seen = (bins < b).astype(jnp.float32) * v
    q = prompt_gdro_q(config, state, bins, seen)
    qi = q[jnp.clip(bins, 0, b - 1)] * seen
    inf_seen = inf * seen
    norm = jnp.where(jnp.sum(qi * inf_seen) > 0, inf_seen, seen)  # none informative: all seen
    w = qi * jnp.sum(norm) / jnp.maximum(jnp.sum(qi * norm), 1e-30)
    w = jnp.where(seen > 0, w, v)  # unseen prompts: weight 1
    return jnp.minimum(w, config.weight_cap), w, inf


def prompt_gdro_weights(
    config: PromptGDROConfig,
    state: PromptGDROState,
    bins_per_rollout: jax.Array,
    valid: jax.Array | None = None,
    *,
    advantages: jax.Array | None = None,
    informative: jax.Array | None = None,
) -> jax.Array:
    """Per-rollout advantage weights ``[R]`` float32 (Eq. 16). Jittable.

    ``w_i = min(q_{b(i)} N / sum_{i' in S} q_{b(i')}, weight_cap)``: mean 1 before the cap over the
    set ``S`` of ``N`` normalising rollouts. Paper (``renormalise_informative=False``): ``S`` =
    all valid rollouts. Default: ``S`` = the valid, seen, informative rollouts (``advantages !=
    0`` or ``informative``; all seen rollouts if none is given or none is informative).
    Zero-advantage rollouts get their bin's weight too; it multiplies a zero advantage, so it
    carries no gradient. Rollouts of unseen prompts (bin ``B`` = ``state.score.shape[0]``) get
    weight 1; invalid rows 0. Multiply the advantages by ``w`` in the clipped surrogate only,
    never the KL term (``losses.policy_loss(..., sample_weights=w)``). With ``apply="resample"``
    the weights are 1 (0 on invalid rows).

    Args:
      bins_per_rollout: ``[R]`` int32 in ``[0, B]``, the bin of each rollout's own prompt (this
        step's ``classify`` gathered by ``segment_ids``).
      valid: optional ``[R]`` bool.
      advantages: optional ``[R]`` float, the (unweighted) advantages; informative = non-zero.
      informative: optional ``[R]`` bool, overrides ``advantages``.
    """
    return _weights(config, state, bins_per_rollout, valid, advantages, informative)[0]


def weight_diagnostics(weights, informative=None, *, weight_cap=None) -> dict[str, Any]:
    """Effective sample size and cap use of advantage weights, as host numpy.

    Keys: ``gdro/weight_ess`` = ``(sum w)^2 / (n sum w^2)`` over the ``n`` informative rollouts
    (Kish's effective sample size as a fraction, in (0, 1]; 1 = uniform weights; NaN when no
    rollout is informative), ``gdro/weight_max``, ``gdro/weight_ratio`` (max / min weight over
    the informative rollouts: the tilt that acts on the gradient; NaN when none is informative
    or the smallest is 0), and with ``weight_cap``:
    ``gdro/weight_cap_bound`` (1 when some weight reached the cap this step, else 0) and
    ``gdro/weight_capped_fraction`` (fraction of informative rollouts at the cap).

    Args:
      weights: ``[R]`` float, the weights used (after the cap).
      informative: optional ``[R]`` bool (default: all rollouts).
      weight_cap: the cap the weights were computed with.
    """
    w = np.asarray(weights, np.float64)
    m = np.ones(w.shape, bool) if informative is None else np.asarray(informative, bool)
    wi = w[m]
    out: dict[str, Any] = {"gdro/weight_max": float(w.max()) if w.size else float("nan")}
    den = wi.size * float(np.sum(wi**2))
    out["gdro/weight_ess"] = float(np.sum(wi)) ** 2 / den if den > 0 else float("nan")
    lo = float(wi.min()) if wi.size else 0.0
    out["gdro/weight_ratio"] = float(wi.max()) / lo if lo > 0 else float("nan")
    if weight_cap is not None:
        at_cap = w >= float(np.float32(weight_cap))
        out["gdro/weight_cap_bound"] = int(bool(np.any(at_cap)))
        out["gdro/weight_capped_fraction"] = float(np.mean(at_cap[m])) if wi.size else 0.0
    return out


def prompt_gdro_weight_diagnostics(
    config: PromptGDROConfig,
    state: PromptGDROState,
    bins_per_rollout,
    valid=None,
    *,
    advantages=None,
    informative=None,
) -> dict[str, Any]:
    """``weight_diagnostics`` of the weights ``prompt_gdro_weights`` gives for the same inputs
    (same state: call with the pre-update state)."""
    w, _, inf = _weights(config, state, bins_per_rollout, valid, advantages, informative)
    return weight_diagnostics(w, np.asarray(inf) > 0, weight_cap=config.weight_cap)


@functools.partial(jax.jit, static_argnames="config")
def _update(config: PromptGDROConfig, state: PromptGDROState, bins_per_rollout, signal, valid):
    b = state.score.shape[0]
    bins = jnp.asarray(bins_per_rollout, jnp.int32)
    v = _valid(bins, valid)
    count = jax.ops.segment_sum(v, bins, b)
    present = count > 0
    q_used = _q_from_present(config, state.score, present)  # the q of this step's weights
    mean = jax.ops.segment_sum(jnp.asarray(signal, jnp.float32) * v, bins, b) / jnp.maximum(
        count, 1.0
    )
    if config.share_division:
        share = count / jnp.maximum(jnp.sum(v), 1.0)
        debiased = mean / jnp.maximum(share, config.share_floor)  # Eq. 12
    else:
        debiased = mean
    ema = jnp.where(
        state.seen, (1.0 - config.beta) * state.score + config.beta * debiased, debiased
    )  # Eq. 13
    new = PromptGDROState(
        score=jnp.where(present, ema, state.score), seen=state.seen | present, step=state.step + 1
    )
    return new, q_used


def prompt_gdro_update(
    config: PromptGDROConfig,
    state: PromptGDROState,
    bins_per_rollout,
    loss_signal,
    valid=None,
    *,
    rewards=None,
    advantages=None,
    informative=None,
) -> tuple[PromptGDROState, dict[str, Any]]:
    """One Prompt-GDRO score update (Eq. 12-13; Eq. 12 only with ``share_division``); returns
    ``(state, diagnostics)``.

    Args:
      config: ``PromptGDROConfig``.
      state: ``PromptGDROState``.
      bins_per_rollout: ``[R]`` int32 in ``[0, B]``, bins of the rollouts' own prompts (same as
        for the weights); the unseen marker ``B`` enters no bin score.
      loss_signal: ``[R]`` float32, per-rollout loss signal (see ``loss_signal()``); detached.
      valid: optional ``[R]`` bool; invalid rows are ignored.
      rewards: optional ``[R]`` float, for the per-bin mean reward diagnostic.
      advantages, informative: optional ``[R]``, as given to ``prompt_gdro_weights``; with either
        (or ``config.apply == "advantage_weight"``) the diagnostics include
        ``prompt_gdro_weight_diagnostics`` of this step's weights (pre-update state).

    Returns:
      The new state and a flat dict of host numpy diagnostics (``prompt_gdro_diagnostics``) with
      ``gdro/q`` = the weights this step used (pre-update scores) and ``gdro/score`` = the updated
      scores. The numeric core is jitted; this wrapper moves the diagnostics to the host.
    """
    new, q_used = _update(config, state, bins_per_rollout, loss_signal, valid)
    diag = prompt_gdro_diagnostics(
        int(state.score.shape[0]),
        bins_per_rollout,
        q=q_used,
        score=new.score,
        rewards=rewards,
        valid=valid,
    )
    if config.apply == "advantage_weight" or advantages is not None or informative is not None:
        diag.update(
            prompt_gdro_weight_diagnostics(
                config,
                state,
                bins_per_rollout,
                valid,
                advantages=advantages,
                informative=informative,
            )
        )
    return new, diag


def _entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    return float(-np.sum(p * np.log(p)))


def prompt_gdro_diagnostics(
    num_bins: int, bins_per_rollout, *, q=None, score=None, rewards=None, valid=None
) -> dict[str, Any]:
    """Per-step curriculum diagnostics (spec s.4) as host numpy, keys prefixed ``gdro/``.

    Works without a controller too (GRPO baseline: only ``bins_per_rollout`` and ``rewards``).

    Rollouts of unseen prompts (bin marker ``B``) are left out of every per-bin key (shares are
    over the seen rollouts) and counted in ``gdro/unseen_share`` (fraction of all rollouts).

    Keys: ``gdro/bin_share [B]`` (share of the batch's rollouts, ``q_hat``), ``gdro/mean_bin``
    (``sum_b b q_hat_b``), ``gdro/mass_ge3``, ``gdro/mass_ge8`` (``q_hat`` mass in bins >= 3, >= 8),
    ``gdro/entropy_share`` (nats); with ``q``: ``gdro/q [B]``, ``gdro/entropy_q``, ``gdro/lead_lag``
    (``sum_b b q_b - sum_b b q_hat_b``), ``gdro/mean_bin_q``; with ``score``: ``gdro/score [B]``;
    with ``rewards``: ``gdro/bin_reward [B]`` (mean reward per bin, NaN for absent bins).
    """
    bins = np.asarray(bins_per_rollout, np.int64)
    v = np.ones(bins.shape, np.float64) if valid is None else np.asarray(valid, np.float64)
    all_count = np.bincount(bins, weights=v, minlength=num_bins)
    count = all_count[:num_bins]
    share = count / max(count.sum(), 1.0)
    idx = np.arange(num_bins)
    out: dict[str, Any] = {
        "gdro/unseen_share": float(all_count[num_bins:].sum() / max(all_count.sum(), 1.0)),
        "gdro/bin_share": share.astype(np.float32),
        "gdro/mean_bin": float(np.sum(idx * share)),
        "gdro/mass_ge3": float(share[3:].sum()),
        "gdro/mass_ge8": float(share[8:].sum()),
        "gdro/entropy_share": _entropy(share),
    }
    if q is not None:
        qn = np.asarray(q, np.float64)
        out["gdro/q"] = qn.astype(np.float32)
        out["gdro/entropy_q"] = _entropy(qn)
        out["gdro/mean_bin_q"] = float(np.sum(idx * qn))
        out["gdro/lead_lag"] = float(np.sum(idx * qn) - np.sum(idx * share))
    if score is not None:
        out["gdro/score"] = np.asarray(score, np.float32)
    if rewards is not None:
        r = np.bincount(bins, weights=np.asarray(rewards, np.float64) * v, minlength=num_bins)
        with np.errstate(invalid="ignore", divide="ignore"):
            out["gdro/bin_reward"] = np.where(count > 0, r[:num_bins] / count, np.nan).astype(
                np.float32
            )
    return out


@functools.partial(jax.jit, static_argnames="config")
def resample_q(
    config: PromptGDROConfig, state: PromptGDROState, dataset_bins: jax.Array
) -> jax.Array:
    """Bin-drawing probabilities ``[B + 1]`` float32 for ``apply="resample"`` over all dataset
    prompts, slot ``B`` = unseen prompts.

    ``population_weighted`` (default): ``P(b) = N_b u_b / N`` with ``u_b = q_b / (sum_b' N_b'
    q_b' / N_seen)`` the per-prompt weight of seen bin ``b`` (mean 1 over the seen prompts) and
    ``u = 1`` for unseen prompts, so a prompt is drawn with probability ``∝ u_{b(i)}``; with
    equal ``q`` (``eta = 0``) that is the uniform sampler. Otherwise (the earlier reading):
    ``P(unseen) = N_u / N``, ``P(b) = (1 - N_u / N) q_b``; without unseen prompts (paper mode)
    ``prompt_gdro_q`` with a 0 appended. ``q`` is ``prompt_gdro_q`` over the seen bins. Feed it
    with ``dataset_bins`` to ``sample_prompts_by_bin`` or ``PromptSource.next_by_bin``.

    Args:
      dataset_bins: ``[N]`` int32 in ``[0, B]``, ``classify`` over all ids ``0 .. N-1``.
    """
    b = state.score.shape[0]
    bins = jnp.asarray(dataset_bins, jnp.int32)
    seen = bins < b
    q = prompt_gdro_q(config, state, jnp.where(seen, bins, 0), seen)
    frac_unseen = 1.0 - jnp.mean(seen.astype(jnp.float32))
    if config.population_weighted:
        size = jax.ops.segment_sum(seen.astype(jnp.float32), jnp.where(seen, bins, 0), b)
        n_seen = jnp.sum(size)
        u = q * n_seen / jnp.maximum(jnp.sum(size * q), 1e-30)
        p = size * u / jnp.maximum(n_seen, 1.0) * (1.0 - frac_unseen)
        return jnp.concatenate([p, frac_unseen[None]])
    q = jnp.where(jnp.any(seen), q * (1.0 - frac_unseen), q)
    return jnp.concatenate([q, frac_unseen[None]])


@functools.partial(jax.jit, static_argnames="num_prompts")
def sample_prompts_by_bin(
    q: jax.Array, dataset_bins: jax.Array, key: jax.Array, num_prompts: int
) -> jax.Array:
    """Draws ``num_prompts`` dataset ids: a bin from ``q``, then a prompt uniformly in that bin.

    For ``apply="resample"``. Bins with no dataset prompts get their mass renormalised away (if
    ``q`` has no mass on any non-empty bin, bins are drawn in proportion to their size, i.e. the
    uniform sampler). Draws are independent (with replacement); ``classifier_update`` merges
    duplicate ids.

    Args:
      q: ``[B]`` float bin probabilities (``prompt_gdro_q`` over ``dataset_bins``), or ``[B + 1]``
        from ``resample_q`` when ``dataset_bins`` holds the unseen marker ``B``.
      dataset_bins: ``[N]`` int32, ``classify`` over all ids ``0 .. N-1``.
      key: PRNG key.
      num_prompts: ``P`` (static).

    Returns:
      ``[P]`` int32 dataset ids.
    """
    b = q.shape[0]
    bins = jnp.asarray(dataset_bins, jnp.int32)
    size = jax.ops.segment_sum(jnp.ones(bins.shape, jnp.float32), bins, b)
    qe = jnp.where(size > 0, jnp.maximum(jnp.asarray(q, jnp.float32), 0.0), 0.0)
    qe = jnp.where(jnp.sum(qe) > 0, qe, size)
    k_bin, k_item = jax.random.split(key)
    chosen = jax.random.categorical(k_bin, jnp.log(qe), shape=(num_prompts,))
    order = jnp.argsort(bins, stable=True)
    size_i = size.astype(jnp.int32)
    offset = jnp.cumsum(size_i) - size_i
    within = jax.random.randint(k_item, (num_prompts,), 0, jnp.maximum(size_i[chosen], 1))
    return order[offset[chosen] + within].astype(jnp.int32)


__all__ = [
    "PromptGDROConfig",
    "PromptGDROState",
    "prompt_gdro_init",
    "prompt_gdro_q",
    "prompt_gdro_weights",
    "prompt_gdro_weight_diagnostics",
    "weight_diagnostics",
    "prompt_gdro_update",
    "prompt_gdro_diagnostics",
    "sample_prompts_by_bin",
    "resample_q",
    "loss_signal",
    "APPLY_MODES",
    "SIGNALS",
]
