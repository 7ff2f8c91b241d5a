"""The clipped GRPO/PPO policy loss, KL estimators and the PPO baseline (the log-probs they
take are `grpo_jax.logprobs`').

Shapes: `R` rollouts (rows), `T` completion tokens, `V` vocabulary. `completion_mask [R, T]` is
1 on real completion tokens (up to and including EOS) and 0 elsewhere. Masked positions of every
`[R, T]` input may hold NaN/inf garbage: each function replaces them with `jnp.where` *before*
any arithmetic, so they change neither a value nor a gradient (multiplying by the mask would
not do: `NaN * 0 = NaN`).

Sources: Schulman et al. 2017, *PPO* (arXiv 1707.06347), Eq. 7 (clipped surrogate) and
Schulman et al. 2015, *GAE* (arXiv 1506.02438), Eq. 16; Shao et al. 2024, *DeepSeekMath*
(arXiv 2402.03300), Eq. 3 (GRPO objective, seq-mean-token-mean, k3 KL to the reference);
Yu et al. 2025, *DAPO* (arXiv 2503.14476), Eq. 8-12 (clip-higher `epsilon_high > epsilon_low`,
token-level loss); Liu et al. 2025, *Dr. GRPO* (arXiv 2503.20783), Eq. 3 (constant normaliser);
Ye et al. 2020 (dual clip, arXiv 1912.09729, Eq. 5); Zheng et al. 2025, *GSPO*
(arXiv 2507.18071), Eq. 7 (sequence-level ratio); Schulman 2020, "Approximating KL
divergence" (k1/k2/k3); MiniMax 2025, *MiniMax-M1* (arXiv 2506.13585), Sec. 3.1 (CISPO: clipped,
detached IS weight times the log-prob); Gao et al. 2025, *SAPO* (arXiv 2511.20347), Sec. 3 (soft
sigmoid gate instead of the hard clip); Yao et al. 2025, "Your efficient RL framework secretly
brings you off-policy RL training" (truncated importance sampling, TIS, for the sampler/trainer
mismatch); Yu et al. 2025, *DAPO*, Sec. 3.4 (overlong filtering).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import NamedTuple

import chex
import jax
import jax.numpy as jnp
from jax import lax

from grpo_jax.logprobs import _concrete, _f32, entropy_from_logits

LOSS_AGG_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)
RATIO_LEVELS = ("token", "sequence")
KL_KINDS = ("k1", "k2", "k3")
LOG_RATIO_CLAMP = 20.0


def _bool_mask(completion_mask) -> jax.Array:
    completion_mask = jnp.asarray(completion_mask)
    if completion_mask.dtype == jnp.bool_:
        return completion_mask
    return completion_mask > 0


# ----------------------------------------------------------------------------------------------
# KL estimators.
# ----------------------------------------------------------------------------------------------


def kl(logprobs: chex.Array, ref_logprobs: chex.Array, kind: str = "k3") -> jax.Array:
    """Per-token estimators of `KL(pi_theta || pi_ref)` from samples of `pi_theta` (Schulman 2020).

    With `delta = ref_logprobs - logprobs` (float32), clamped to `[-20, 20]`:
    `k1 = -delta`, `k2 = delta^2 / 2`, `k3 = exp(delta) - delta - 1` (>= 0; unbiased; low
    variance). The clamp is straight-through (`clip(sg(d)) + d - sg(d)`): values use the
    clamped `delta`, so neither `exp` nor its gradient can overflow, while the gradient still
    flows through `logprobs` (d delta / d logprobs = -1) also outside the clamp range. No
    masking here; `ref_logprobs` is not stop-gradiented (the caller's choice).

    Args:
      logprobs: `[...]` float, policy log-probs of the sampled tokens (nats).
      ref_logprobs: same shape, reference-policy log-probs.
      kind: `"k1"`, `"k2"` or `"k3"`.

    Returns:
      `[...]` float32 per-token KL estimates (nats).

    Raises:
      ValueError: unknown `kind`.
      AssertionError: (chex) shape mismatch.
    """
    if kind not in KL_KINDS:
        raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")
    logprobs = jnp.asarray(logprobs)
    ref_logprobs = jnp.asarray(ref_logprobs)
    chex.assert_equal_shape([logprobs, ref_logprobs])
    d = _f32(ref_logprobs) - _f32(logprobs)
    d_sg = lax.stop_gradient(d)
    d = jnp.clip(d_sg, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP) + (d - d_sg)
    if kind == "k1":
        return -d
    if kind == "k2":
        return 0.5 * d * d
    return jnp.exp(d) - d - 1.0


# ----------------------------------------------------------------------------------------------
# Aggregation.
# ----------------------------------------------------------------------------------------------


def _check_agg_mode(loss_agg_mode: str) -> None:
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode must be one of {LOSS_AGG_MODES}, got {loss_agg_mode!r}")


def loss_denominator(
    completion_mask: chex.Array, loss_agg_mode: str = "token-mean", *, max_len: int | None = None
) -> jax.Array:
    """The denominator of `loss_agg_mode` for this batch (float32 scalar); additive over rows.

    - `token-mean`: number of masked-in tokens `sum_{r,t} m`.
    - `seq-mean-token-mean`, `seq-mean-token-sum`: number of rows with at least one masked-in
      token (a fully masked row, e.g. padding or a truncated completion masked out, is not a
      sequence and does not dilute the mean; equals `R` when every row has a token).
    - `seq-mean-token-sum-norm` (Dr. GRPO): `R * max_len`, a constant (`max_len` defaults to
      `T`).

    Compute it on the full (mini-)batch and pass it as `denominator=` to every micro-batch call
    of `policy_loss`/`value_loss`; the micro-batch losses then sum to the full-batch loss.

    Args:
      completion_mask: `[R, T]` bool/int/float (> 0 means in).
      loss_agg_mode: one of `LOSS_AGG_MODES`.
      max_len: static int > 0, the constant `T_max` of `seq-mean-token-sum-norm`.

    Returns:
      float32 scalar.
    """
    _check_agg_mode(loss_agg_mode)
    m = _bool_mask(completion_mask)
    chex.assert_rank(m, 2)
    if loss_agg_mode == "token-mean":
        return jnp.sum(m).astype(jnp.float32)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        if max_len is None:
            max_len = m.shape[1]
        if _concrete(max_len) and not max_len > 0:
            raise ValueError(f"max_len must be > 0, got {max_len}")
        return jnp.asarray(m.shape[0] * max_len, jnp.float32)
    return jnp.sum(jnp.any(m, axis=1)).astype(jnp.float32)


def aggregate_loss(
    per_token_loss: chex.Array,
    completion_mask: chex.Array,
    loss_agg_mode: str = "token-mean",
    *,
    max_len: int | None = None,
    denominator: chex.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Reduce a per-token loss `[R, T]` to a scalar: `loss = loss_sum / denominator`.

    `loss_sum` (additive over rows, hence over micro-batches):
    - `token-mean`, `seq-mean-token-sum`, `seq-mean-token-sum-norm`: `sum_{r,t} m L`;
    - `seq-mean-token-mean`: `sum_r (sum_t m L / sum_t m)` (rows without tokens contribute 0).
    `denominator` is `loss_denominator(completion_mask, loss_agg_mode, max_len=max_len)` unless
    given (pass the full batch's to make micro-batch losses add up to the full-batch loss).
    A zero denominator gives loss 0. Masked entries of `per_token_loss` may be NaN/inf.

    Returns:
      `(loss, loss_sum, denominator)`, float32 scalars; `denominator` is always the *local*
      (this batch's) one, so summing it over micro-batches gives the full batch's.
    """
    _check_agg_mode(loss_agg_mode)
    m = _bool_mask(completion_mask)
    chex.assert_equal_shape([per_token_loss, m])
    lt = jnp.where(m, _f32(per_token_loss), 0.0)
    if loss_agg_mode == "seq-mean-token-mean":
        cnt = jnp.sum(m, axis=1).astype(jnp.float32)
        loss_sum = jnp.sum(jnp.sum(lt, axis=1) / jnp.maximum(cnt, 1.0))
    else:
        loss_sum = jnp.sum(lt)
    local = loss_denominator(m, loss_agg_mode, max_len=max_len)
    d = local if denominator is None else _f32(denominator)
    chex.assert_shape(d, ())
    loss = jnp.where(d > 0, loss_sum / jnp.where(d > 0, d, 1.0), 0.0)
    return loss, loss_sum, local


def _masked_mean(x, m):
    return jnp.sum(jnp.where(m, x, 0.0)) / jnp.maximum(jnp.sum(m), 1).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------
# Policy loss: its configuration, the registry of surrogates, and the loss.
# ----------------------------------------------------------------------------------------------


def _on(value) -> bool:
    """An off-able option (`dual_clip`, `tis_cap`) is on: non-zero, or traced (a jitted caller
    passing it as an argument has it on)."""
    return not _concrete(value) or bool(value)


def _number(name, value, lo=None, hi=None, *, lo_open=False, hi_open=False) -> None:
    """Raises ValueError "name=value must be a number in [lo, hi)" unless value is in range
    (traced values pass: they are checked where they are concrete)."""
    if not _concrete(value):
        return
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value == value
    if ok and lo is not None:
        ok = value > lo if lo_open else value >= lo
    if ok and hi is not None:
        ok = value < hi if hi_open else value <= hi
    if not ok:
        lo_s = "(-inf" if lo is None else ("(" if lo_open else "[") + f"{lo}"
        hi_s = "inf)" if hi is None else f"{hi}" + (")" if hi_open else "]")
        raise ValueError(f"{name}={value!r} must be a number in {lo_s}, {hi_s}")


@dataclasses.dataclass(frozen=True)
class PolicyLossConfig:
    """The options of `policy_loss` (frozen and hashable: a static argument of `jax.jit`).

    The one home of these fields' defaults: `config.algorithm` is generated from them
    (`grpo_jax.config_schema`) and read back with `from_config`.
      policy_loss_type: a registered surrogate (`SURROGATES`: "clip", "cispo", "sapo", ...).
      epsilon_low, epsilon_high: the clip range `[1 - epsilon_low, 1 + epsilon_high]` of
        "clip"; `epsilon_low` in [0, 1). Defaults 0.2 / 0.28: DAPO's clip-higher (Yu et al.
        2025, Sec. 3.1), which every run of the CLI has used; 0.2 / 0.2 is PPO's symmetric clip.
      dual_clip: 0 (off) or `c > 1` ("clip" only; Ye et al. 2020, Eq. 5).
      ratio_level: "token" or "sequence" (GSPO Eq. 7: the row's mean log-ratio per token).
      loss_agg_mode: one of `LOSS_AGG_MODES` (see `aggregate_loss`).
      max_len: `T_max` of "seq-mean-token-sum-norm" (None: the batch's `T`).
      kl_coef: >= 0, weight of the KL to the reference (needs `ref_logprobs` when > 0).
      kl_kind: "k1" | "k2" | "k3" (`kl`).
      kl_ratio_correction: the KL times the live importance ratio (TRL's
        `use_bias_correction_kl`; tests/test_kl_ratio_trl.py).
      tis_cap: 0 (off) or `C > 0`: truncated importance sampling against the sampler's
        log-probs (Yao et al. 2025; verl's default C = 2); on iff `sampler_logprobs` is given.
      (None is read as 0 for `dual_clip` and `tis_cap`.)
      cispo_epsilon_low, cispo_epsilon_high: CISPO's weight range `[1 - low, 1 + high]`
        (low None: no lower bound, the paper's setting; high >= 0).
      sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures (> 0) for `A > 0` / `A <= 0`.

    Raises:
      ValueError: in `__post_init__`, one line "field=value must ..." for an unknown choice or
        a value out of range, or `dual_clip` with a type other than "clip".
    """

    policy_loss_type: str = "clip"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    dual_clip: float = 0.0
    ratio_level: str = "token"
    loss_agg_mode: str = "token-mean"
    max_len: int | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    kl_ratio_correction: bool = False
    tis_cap: float = 0.0
    cispo_epsilon_low: float | None = None
    cispo_epsilon_high: float = 0.28
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05

    def __post_init__(self):
        for name in ("dual_clip", "tis_cap"):  # 0 = off; None (the older spelling) too
            if getattr(self, name) is None:
                object.__setattr__(self, name, 0.0)
        for name, choices in (
            ("policy_loss_type", tuple(SURROGATES)),
            ("ratio_level", RATIO_LEVELS),
            ("loss_agg_mode", LOSS_AGG_MODES),
            ("kl_kind", KL_KINDS),
        ):
            value = getattr(self, name)
            if value not in choices:
                raise ValueError(f"{name}={value!r} is not one of {choices}")
        _number("epsilon_low", self.epsilon_low, 0, 1, hi_open=True)
        _number("epsilon_high", self.epsilon_high, 0)
        _number("kl_coef", self.kl_coef, 0)
        _number("cispo_epsilon_high", self.cispo_epsilon_high, 0)
        _number("sapo_tau_pos", self.sapo_tau_pos, 0, lo_open=True)
        _number("sapo_tau_neg", self.sapo_tau_neg, 0, lo_open=True)
        if self.cispo_epsilon_low is not None:
            _number("cispo_epsilon_low", self.cispo_epsilon_low, 0, 1, hi_open=True)
        _number("tis_cap", self.tis_cap, 0)
        if self.max_len is not None and not (isinstance(self.max_len, int) and self.max_len > 0):
            raise ValueError(f"max_len={self.max_len!r} must be a positive integer or None")
        if _on(self.dual_clip):
            _number("dual_clip", self.dual_clip, 1, lo_open=True)
            if self.policy_loss_type != "clip":
                raise ValueError(
                    f"dual_clip={self.dual_clip} applies to policy_loss_type='clip' only, not "
                    f"{self.policy_loss_type!r}"
                )

    @classmethod
    def from_config(cls, algorithm, **overrides) -> PolicyLossConfig:
        """From a `config.algorithm` section (`ml_collections.ConfigDict` or any mapping): the
        fields it has, then `overrides`. Raises ValueError as `__post_init__` (saying that 0
        turns `dual_clip`/`tis_cap` off)."""
        kw = {f.name: algorithm[f.name] for f in dataclasses.fields(cls) if f.name in algorithm}
        off = ("dual_clip", "tis_cap")
        try:
            return cls(**{**kw, **overrides})
        except ValueError as e:
            hint = " (0 turns it off)" if str(e).startswith(tuple(f"{k}=" for k in off)) else ""
            raise ValueError(f"{e}{hint}") from None


class SurrogateInputs(NamedTuple):
    """What a surrogate sees, per token ([R, T] float32, 0 where masked, except `mask`).

    advantages: `A_t` (times `sample_weights` when given), constant. ratio: the importance
    ratio `rho_t = exp(l_t)` of `ratio_level`, live (differentiated). logprobs: the current
    policy's log-probs, live. mask: [R, T] bool, the completion tokens.
    """

    advantages: jax.Array
    ratio: jax.Array
    logprobs: jax.Array
    mask: jax.Array


Surrogate = Callable[[SurrogateInputs, PolicyLossConfig], tuple[jax.Array, jax.Array]]
# name -> surrogate(x, cfg) -> (per-token policy-gradient loss [R, T] float32, clipped [R, T]
# bool: the tokens whose gradient the surrogate cuts or caps, for the `clip_fraction` metric)
SURROGATES: dict[str, Surrogate] = {}


def register_surrogate(name: str) -> Callable[[Surrogate], Surrogate]:
    """Decorator: `@register_surrogate("mine")` makes `policy_loss_type="mine"` available (in
    `PolicyLossConfig` and `config.algorithm.policy_loss_type`). Raises ValueError when `name`
    is taken."""

    def register(fn: Surrogate) -> Surrogate:
        if name in SURROGATES:
            raise ValueError(f"surrogate {name!r} is already registered ({SURROGATES[name]})")
        SURROGATES[name] = fn
        return fn

    return register


@register_surrogate("clip")
def clip_surrogate(x: SurrogateInputs, cfg: PolicyLossConfig):
    """PPO Eq. 7 (DAPO clip-higher when `epsilon_high > epsilon_low`):
    `L_t = max(-A_t rho_t, -A_t clip(rho_t, 1 - epsilon_low, 1 + epsilon_high))`; with dual clip
    `c` (Ye et al. 2020, Eq. 5), `L_t = min(L_t, -c A_t)` for `A_t < 0`. Clipped: `A > 0` and
    `rho > 1 + epsilon_high`, or `A < 0` and `rho < 1 - epsilon_low`."""
    a, r = x.advantages, x.ratio
    lo, hi = 1.0 - cfg.epsilon_low, 1.0 + cfg.epsilon_high
    pg = jnp.maximum(-a * r, -a * jnp.clip(r, lo, hi))
    if _on(cfg.dual_clip):
        pg = jnp.where(a < 0, jnp.minimum(pg, -cfg.dual_clip * a), pg)
    r = lax.stop_gradient(r)
    return pg, ((a > 0) & (r > hi)) | ((a < 0) & (r < lo))


@register_surrogate("cispo")
def cispo_surrogate(x: SurrogateInputs, cfg: PolicyLossConfig):
    """MiniMax-M1 Sec. 3.1: `L_t = -sg(clip(rho_t, 1 - cispo_epsilon_low, 1 +
    cispo_epsilon_high)) A_t logprobs_t`: the weight is clipped and detached, so every token
    keeps the gradient `-w_t A_t grad(logprobs_t)`. Clipped: the weight, either side."""
    r = lax.stop_gradient(x.ratio)
    lo = 0.0 if cfg.cispo_epsilon_low is None else 1.0 - cfg.cispo_epsilon_low
    hi = 1.0 + cfg.cispo_epsilon_high
    return -jnp.clip(r, lo, hi) * x.advantages * x.logprobs, (r > hi) | (r < lo)


@register_surrogate("sapo")
def sapo_surrogate(x: SurrogateInputs, cfg: PolicyLossConfig):
    """SAPO Sec. 3: `L_t = -A_t f(rho_t)`, `f(x) = sigmoid(tau (x - 1)) 4 / tau`, `tau =
    sapo_tau_pos` if `A_t > 0` else `sapo_tau_neg`: gradient weight 1 at `rho = 1`, decaying
    smoothly off-policy. Nothing is clipped."""
    a = x.advantages
    tau = jnp.where(a > 0, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    return -a * jax.nn.sigmoid(tau * (x.ratio - 1.0)) * (4.0 / tau), jnp.zeros_like(x.mask)


def policy_loss(
    logprobs: chex.Array,
    old_logprobs: chex.Array,
    advantages: chex.Array,
    completion_mask: chex.Array,
    cfg: PolicyLossConfig = PolicyLossConfig(),
    *,
    ref_logprobs: chex.Array | None = None,
    sampler_logprobs: chex.Array | None = None,
    sample_weights: chex.Array | None = None,
    denominator: chex.Array | None = None,
    logits: chex.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Policy loss (GRPO, DAPO, Dr. GRPO, GSPO, CISPO, SAPO, ...) with optional KL and TIS.

    Per masked-in token, in float32, with `A_t = advantages * sample_weights`:
    - log-ratio `l_t = logprobs - old_logprobs` (`cfg.ratio_level="token"`) or the row's token
      mean broadcast to its tokens ("sequence", GSPO Eq. 7), clamped to [-20, 20];
      `rho_t = exp(l_t)`.
    - policy-gradient term `L_t = SURROGATES[cfg.policy_loss_type]`; with TIS
      (`sampler_logprobs`, `cfg.tis_cap`; Yao et al. 2025) times the detached
      `w_t = min(exp(old_logprobs - sampler_logprobs), tis_cap)`.
    - KL (`ref_logprobs`): `L_t += kl_coef c_t kl(logprobs, ref_logprobs, kl_kind)`, `c_t = 1`
      or the live `rho_t` with `kl_ratio_correction`. Not weighted by `sample_weights` or TIS.
    - `loss = aggregate_loss(L, mask, loss_agg_mode)`: token-mean (DAPO), seq-mean-token-mean
      (GRPO), seq-mean-token-sum, seq-mean-token-sum-norm (Dr. GRPO, `R * max_len`).

    `old_logprobs`, `ref_logprobs`, `sampler_logprobs` are constants (`stop_gradient`);
    `old_logprobs = logprobs` gives `rho = 1` and, for every built-in surrogate, the REINFORCE
    gradient `-A grad(logprobs)`. Micro-batches given the full mini-batch's `loss_denominator`
    sum to its loss and gradient. Masked positions of [R, T] inputs may be NaN/inf.

    Args:
      logprobs: [R, T] float, current-policy log-probs of the sampled tokens (differentiated).
      old_logprobs: [R, T] float, the log-probs the ratio is relative to.
      advantages: [R] float (broadcast over tokens) or [R, T] (per token, PPO/GAE).
      completion_mask: [R, T] bool/int/float, > 0 on completion tokens.
      cfg: `PolicyLossConfig`.
      ref_logprobs: [R, T] float, reference log-probs (needed when `cfg.kl_coef > 0`).
      sampler_logprobs: [R, T] float, the sampler's log-probs (given iff `cfg.tis_cap`).
      sample_weights: [R] float multiplying the advantages (Prompt-GDRO).
      denominator: float32 scalar overriding this batch's (micro-batching).
      logits: [R, T, V] completion logits at the sampling temperature, for `entropy` only.

    Returns:
      `(loss, aux)`: loss float32 []; aux float32 (no gradient): `loss_sum`, `denominator`,
      `num_tokens` (micro-batch bookkeeping), `pg_loss` (the policy-gradient part),
      `clip_fraction` (token mean of the surrogate's clipped flag), `approx_kl` (k3 between old
      and new policy), `ratio_mean`, `per_rollout_loss` [R] (each row's token mean of `L_t`
      with the unweighted advantages, TIS on, no KL; the Prompt-GDRO loss signal), and when
      they apply `kl` (before `kl_coef`), `entropy`, `tis_weight_mean`, `tis_clip_fraction`.

    Raises:
      ValueError: `kl_coef > 0` without `ref_logprobs`; only one of `sampler_logprobs` and
        `cfg.tis_cap`. AssertionError (chex): wrong ranks, shapes or dtypes.
    """
    logprobs, old_logprobs, advantages = _checked_policy_inputs(
        logprobs, old_logprobs, advantages, completion_mask, cfg, ref_logprobs, sampler_logprobs
    )
    m = _bool_mask(completion_mask)
    cnt = jnp.sum(m, axis=1).astype(jnp.float32)  # [R]
    sg = lax.stop_gradient

    def const(x):  # a constant [R, T] input: float32, 0 where masked
        x = jnp.asarray(x)
        chex.assert_equal_shape([logprobs, x])
        chex.assert_type(x, float)
        return jnp.where(m, sg(_f32(x)), 0.0)

    lp = jnp.where(m, _f32(logprobs), 0.0)
    old = const(old_logprobs)
    adv, adv_w = _token_advantages(advantages, sample_weights, m)

    ratio = _ratio(lp, old, m, cnt, cfg.ratio_level)
    tis_w = tis_raw = None
    if sampler_logprobs is not None:  # truncated importance sampling (Yao et al. 2025)
        tis_raw = jnp.exp(
            jnp.clip(old - const(sampler_logprobs), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        )
        tis_w = jnp.where(m, jnp.minimum(tis_raw, cfg.tis_cap), 0.0)

    surrogate = SURROGATES[cfg.policy_loss_type]

    def pg_terms(a):
        pg, clipped = surrogate(SurrogateInputs(a, ratio, lp, m), cfg)
        pg = pg if tis_w is None else pg * tis_w
        return jnp.where(m, pg, 0.0), clipped

    pg_t, clipped = pg_terms(adv_w)
    kl_t = None if ref_logprobs is None else _kl_term(lp, const(ref_logprobs), ratio, m, cfg)
    per_token = pg_t if kl_t is None else pg_t + cfg.kl_coef * kl_t

    agg = functools.partial(
        aggregate_loss,
        loss_agg_mode=cfg.loss_agg_mode,
        max_len=cfg.max_len,
        denominator=denominator,
    )
    loss, loss_sum, local_den = agg(per_token, m)
    pg_loss = agg(pg_t, m)[0]
    d_old = jnp.clip(sg(old - lp), -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    aux = {
        "loss_sum": sg(loss_sum),
        "denominator": local_den,
        "pg_loss": sg(pg_loss),
        "num_tokens": jnp.sum(cnt),
        "clip_fraction": _masked_mean(sg(clipped).astype(jnp.float32), m),
        "approx_kl": _masked_mean(jnp.exp(d_old) - d_old - 1.0, m),
        "ratio_mean": _masked_mean(sg(ratio), m),
        "per_rollout_loss": sg(jnp.sum(pg_terms(adv)[0], axis=1) / jnp.maximum(cnt, 1.0)),
    }
    if kl_t is not None:
        aux["kl"] = _masked_mean(sg(kl_t), m)
    if tis_w is not None:
        aux["tis_weight_mean"] = _masked_mean(tis_w, m)
        aux["tis_clip_fraction"] = _masked_mean((tis_raw > cfg.tis_cap).astype(jnp.float32), m)
    if logits is not None:
        aux["entropy"] = _entropy(logits, logprobs, m)
    return loss, aux


def _token_advantages(advantages, sample_weights, m) -> tuple[jax.Array, jax.Array]:
    """(advantages, advantages x sample_weights), both [R, T] float32, detached, 0 where the
    mask ``m`` [R, T] is off; [R] advantages are broadcast over the row's tokens."""
    adv = lax.stop_gradient(_f32(advantages))
    adv = jnp.where(m, adv[:, None] if adv.ndim == 1 else adv, 0.0)
    if sample_weights is None:
        return adv, adv
    sample_weights = jnp.asarray(sample_weights)
    chex.assert_shape(sample_weights, (m.shape[0],))
    return adv, adv * jnp.where(m, _f32(sample_weights)[:, None], 0.0)


def _kl_term(lp, ref, ratio, m, cfg: PolicyLossConfig) -> jax.Array:
    """Per-token KL to the reference [R, T] float32 (before `kl_coef`), times the live ratio
    with `kl_ratio_correction` (TRL's use_bias_correction_kl); 0 where masked."""
    kl_t = kl(lp, ref, cfg.kl_kind)
    if cfg.kl_ratio_correction:
        kl_t = kl_t * ratio
    return jnp.where(m, kl_t, 0.0)


def _ratio(lp, old, m, cnt, ratio_level: str) -> jax.Array:
    """The importance ratio [R, T] float32: per token, or (GSPO Eq. 7, "sequence") the row's
    token-mean log-ratio broadcast to its tokens; the log-ratio clamped to +-LOG_RATIO_CLAMP."""
    log_ratio = lp - old  # 0 where masked
    if ratio_level == "sequence":
        seq = jnp.sum(log_ratio, axis=1) / jnp.maximum(cnt, 1.0)
        log_ratio = jnp.where(m, seq[:, None], 0.0)
    return jnp.exp(jnp.clip(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _checked_policy_inputs(
    logprobs, old_logprobs, advantages, completion_mask, cfg, ref_logprobs, sampler_logprobs
):
    """`policy_loss`'s argument checks; returns (logprobs, old_logprobs, advantages) as arrays."""
    if ref_logprobs is None and _concrete(cfg.kl_coef) and float(cfg.kl_coef) != 0.0:
        raise ValueError(f"kl_coef = {cfg.kl_coef} needs ref_logprobs")
    if (sampler_logprobs is None) == _on(cfg.tis_cap):
        raise ValueError(
            "truncated importance sampling needs both sampler_logprobs and tis_cap (got "
            f"sampler_logprobs {'None' if sampler_logprobs is None else 'given'}, "
            f"tis_cap {cfg.tis_cap})"
        )
    logprobs, old_logprobs, advantages = map(jnp.asarray, (logprobs, old_logprobs, advantages))
    chex.assert_rank([logprobs, old_logprobs, advantages], [2, 2, {1, 2}])
    chex.assert_type([logprobs, old_logprobs, advantages], float)
    chex.assert_equal_shape([logprobs, old_logprobs, completion_mask])
    r, t = logprobs.shape
    chex.assert_shape(advantages, (r,) if advantages.ndim == 1 else (r, t))
    return logprobs, old_logprobs, advantages


def _entropy(logits, logprobs, m) -> jax.Array:
    """Token-mean entropy of ``logits`` [R, T, V] over the mask ``m`` [R, T] (no gradient)."""
    logits = jnp.asarray(logits)
    chex.assert_rank(logits, 3)
    chex.assert_equal_shape_prefix([logits, logprobs], 2)
    return _masked_mean(entropy_from_logits(lax.stop_gradient(logits)), m)


def overlong_filter(completion_mask: chex.Array, truncated: chex.Array) -> jax.Array:
    """Overlong filtering (DAPO Sec. 3.4): zero the completion-mask rows of truncated samples.

    A truncated completion (it hit the generation limit without EOS) has no reliable reward;
    with its mask row all zero it drops out of the loss *and* of the denominator of
    `token-mean`, `seq-mean-token-mean` and `seq-mean-token-sum` (`loss_denominator` counts
    tokens, or rows with at least one token). The constant normaliser of
    `seq-mean-token-sum-norm` (`R * max_len`) still counts the row, by definition. Apply it
    before computing the mini-batch denominator, so micro-batches see the same mask.

    Args:
      completion_mask: `[R, T]` bool/int/float.
      truncated: `[R]` bool (or int/float, > 0 means truncated).

    Returns:
      `[R, T]` mask of `completion_mask`'s dtype, rows with `truncated` set to 0.

    Raises:
      AssertionError: (chex) wrong ranks/shapes.
    """
    completion_mask = jnp.asarray(completion_mask)
    truncated = jnp.asarray(truncated)
    chex.assert_rank([completion_mask, truncated], [2, 1])
    chex.assert_shape(truncated, completion_mask.shape[:1])
    tr = truncated if truncated.dtype == jnp.bool_ else truncated > 0
    return jnp.where(tr[:, None], jnp.zeros((), completion_mask.dtype), completion_mask)


# ----------------------------------------------------------------------------------------------
# PPO baseline: GAE, whitening, clipped value loss.
# ----------------------------------------------------------------------------------------------


def gae(
    rewards: chex.Array,
    values: chex.Array,
    completion_mask: chex.Array,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
) -> tuple[jax.Array, jax.Array]:
    """Generalised advantage estimation over the masked-in tokens (Schulman et al. 2015, Eq. 16).

    `delta_t = r_t + gamma V_{t'} - V_t`, `A_t = delta_t + gamma lam A_{t'}`, where `t'` is the
    next masked-in position after `t` (masked positions are skipped, so a gap in the mask is
    transparent) and `V, A` after the last masked-in token are 0. Returns `G_t = A_t + V_t`.
    Computed by a reverse `lax.scan` over `T`. Masked outputs are 0; masked inputs may be
    NaN/inf.

    Args:
      rewards: `[R, T]` float per-token rewards (e.g. the outcome reward on the last token,
        minus `kl_coef * k1_t`).
      values: `[R, T]` float critic values `V(s_t)`.
      completion_mask: `[R, T]` bool/int/float.
      gamma: discount; lam: GAE lambda.

    Returns:
      `(advantages [R, T], returns [R, T])`, float32, constants (no gradient).
    """
    rewards, values = jnp.asarray(rewards), jnp.asarray(values)
    chex.assert_rank([rewards, values], 2)
    chex.assert_equal_shape([rewards, values, completion_mask])
    m = _bool_mask(completion_mask)
    rw = jnp.where(m, lax.stop_gradient(_f32(rewards)), 0.0)
    v = jnp.where(m, lax.stop_gradient(_f32(values)), 0.0)
    r = rw.shape[0]

    def step(carry, x):
        next_v, next_a = carry
        rt, vt, mt = x
        delta = rt + gamma * next_v - vt
        a = delta + gamma * lam * next_a
        a = jnp.where(mt, a, 0.0)
        new_carry = (jnp.where(mt, vt, next_v), jnp.where(mt, a, next_a))
        return new_carry, a

    init = (jnp.zeros((r,), jnp.float32), jnp.zeros((r,), jnp.float32))
    _, adv = lax.scan(step, init, (rw.T, v.T, m.T), reverse=True)
    adv = adv.T
    returns = jnp.where(m, adv + v, 0.0)
    return adv, returns


def whiten(
    x: chex.Array, mask: chex.Array, shift_mean: bool = True, eps: float = 1e-8
) -> jax.Array:
    """Whiten `x` over its masked-in entries: `(x - mean) / sqrt(var + eps)` (PPO practice).

    Mean and unbiased variance (Bessel, `n - 1`; `n = 1` uses `n`) are taken over entries with
    `mask > 0`; with `shift_mean=False` the mean is added back. Masked entries return 0 and may
    hold NaN/inf. Returns float32 of `x`'s shape.
    """
    x = jnp.asarray(x)
    chex.assert_equal_shape([x, mask])
    m = _bool_mask(mask)
    xf = jnp.where(m, _f32(x), 0.0)
    n = jnp.sum(m).astype(jnp.float32)
    mean = jnp.sum(xf) / jnp.maximum(n, 1.0)
    c = jnp.where(m, xf - mean, 0.0)
    var = jnp.sum(c * c) / jnp.maximum(n - 1.0, 1.0)
    out = c * lax.rsqrt(var + eps)
    if not shift_mean:
        out = out + mean
    return jnp.where(m, out, 0.0)


def value_loss(
    values: chex.Array,
    old_values: chex.Array,
    returns: chex.Array,
    completion_mask: chex.Array,
    *,
    clip_range: float | None = 0.2,
    loss_agg_mode: str = "token-mean",
    max_len: int | None = None,
    denominator: chex.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Clipped value loss (PPO2 practice): `L_t = max((V-G)^2, (clip(V, V_old ± eps) - G)^2) / 2`.

    Aggregated like `policy_loss` (`loss_agg_mode`, `max_len`, `denominator`). `old_values` and
    `returns` are constants. `clip_range=None` disables the clipped term.

    Args:
      values: `[R, T]` float, current critic values (differentiated).
      old_values: `[R, T]` float, values at sampling time.
      returns: `[R, T]` float, GAE returns `G`.
      completion_mask: `[R, T]` bool/int/float.

    Returns:
      `(loss, aux)` with `aux`: `loss_sum`, `denominator`, `clip_fraction` (tokens where the
      clipped term is the larger one), `values_mean`, `returns_mean`.
    """
    _check_agg_mode(loss_agg_mode)
    values, old_values, returns = map(jnp.asarray, (values, old_values, returns))
    chex.assert_rank([values, old_values, returns], 2)
    chex.assert_equal_shape([values, old_values, returns, completion_mask])
    if clip_range is not None and _concrete(clip_range) and not float(clip_range) > 0:
        raise ValueError(f"clip_range must be > 0 or None, got {clip_range}")
    m = _bool_mask(completion_mask)
    v = jnp.where(m, _f32(values), 0.0)
    v_old = jnp.where(m, lax.stop_gradient(_f32(old_values)), 0.0)
    g = jnp.where(m, lax.stop_gradient(_f32(returns)), 0.0)
    l1 = jnp.square(v - g)
    if clip_range is not None:
        vc = v_old + jnp.clip(v - v_old, -clip_range, clip_range)
        l2 = jnp.square(vc - g)
        lt = 0.5 * jnp.maximum(l1, l2)
        clipfrac = _masked_mean((l2 > l1).astype(jnp.float32), m)
    else:
        lt = 0.5 * l1
        clipfrac = jnp.zeros((), jnp.float32)
    loss, loss_sum, local = aggregate_loss(
        lt, m, loss_agg_mode, max_len=max_len, denominator=denominator
    )
    aux = {
        "loss_sum": lax.stop_gradient(loss_sum),
        "denominator": local,
        "clip_fraction": lax.stop_gradient(clipfrac),
        "values_mean": _masked_mean(lax.stop_gradient(v), m),
        "returns_mean": _masked_mean(g, m),
    }
    return loss, aux
