"""GDRO controllers: the online difficulty classifier, Prompt-GDRO and Rollout-GDRO.

Source: Panaganti et al., arXiv 2601.19280 (2026); spec: shared/spec/gdro.md. All state is
``flax.struct.dataclass`` pytrees (checkpoint with Orbax); configs are frozen, hashable
dataclasses (jit static args) that validate on construction.

One step of the trainer::

  bins = classify(ccfg, cstate, ids)               # [P] in [0, B]; B = unseen (default), past only
  alloc = allocate(rcfg, rstate, bins, bin_success(ccfg, cstate, ids, bins), prompt_ids=ids)
  #       (or fixed_allocation(bins, n_bar, B))  -> alloc.segment_ids [R], R = P * n_bar
  rollout_bins = bins[alloc.segment_ids]                               # each rollout's own bin
  ... generate, reward, advantages adv [R] ...
  w = prompt_gdro_weights(pcfg, pstate, rollout_bins, advantages=adv)  # [R], multiplies adv
  ... update (per_rollout_loss from losses.policy_loss) ...
  signal = loss_signal(pcfg, per_rollout_loss=per_rollout_loss, correct=correct)
  pstate, diag = prompt_gdro_update(pcfg, pstate, rollout_bins, signal, rewards=rewards,
                                    advantages=adv)                    # + weight ESS, cap use
  rstate, diag = rollout_gdro_update(rcfg, rstate, alloc, bins, signal, rewards)
  cstate = classifier_update(ccfg, cstate, ids, visit_outcome(ccfg, correct, alloc.segment_ids, P))

Every config has ``mode = "corrected"`` (default) or ``"paper"``; ``paper_configs()`` gives the
three paper / released-code configs. Departures and fields: docs/gdro.md.

``apply="resample"``: ``all_bins = classify(ccfg, cstate, all_ids)``,
``q = resample_q(pcfg, pstate, all_bins)`` (``[B + 1]``, slot ``B`` = unseen),
``ids = sample_prompts_by_bin(q, all_bins, key, P)``.
"""

from grpo_jax.gdro import evidence
from grpo_jax.gdro.classifier import (
    MODES,
    ClassifierConfig,
    ClassifierState,
    bin_success,
    classifier_init,
    classifier_update,
    classify,
    success_estimate,
    visit_outcome,
)
from grpo_jax.gdro.prompt_gdro import (
    PromptGDROConfig,
    PromptGDROState,
    loss_signal,
    prompt_gdro_diagnostics,
    prompt_gdro_init,
    prompt_gdro_q,
    prompt_gdro_update,
    prompt_gdro_weight_diagnostics,
    prompt_gdro_weights,
    resample_q,
    sample_prompts_by_bin,
    weight_diagnostics,
)
from grpo_jax.gdro.rollout_gdro import (
    Allocation,
    RolloutGDROConfig,
    RolloutGDROState,
    allocate,
    arm_probs,
    evidence_update,
    fixed_allocation,
    rollout_gdro_diagnostics,
    rollout_gdro_init,
    rollout_gdro_update,
    solve_arms_dp,
    sqrt_allocation,
)


def paper_configs(
    classifier: dict | None = None,
    prompt_gdro: dict | None = None,
    rollout_gdro: dict | None = None,
) -> tuple[ClassifierConfig, PromptGDROConfig, RolloutGDROConfig]:
    """The paper / released-code settings of all three controllers (``mode="paper"``).

    Args:
      classifier, prompt_gdro, rollout_gdro: optional extra fields for each config (e.g.
        ``{"delta": 0.0}``, ``{"n_bar": 4}``); they win over the mode.

    Returns:
      ``(ClassifierConfig, PromptGDROConfig, RolloutGDROConfig)``.

    Raises:
      ValueError from the configs' validation.
    """
    return (
        ClassifierConfig(**{"mode": "paper", **(classifier or {})}),
        PromptGDROConfig(**{"mode": "paper", **(prompt_gdro or {})}),
        RolloutGDROConfig(**{"mode": "paper", **(rollout_gdro or {})}),
    )


__all__ = [
    "MODES",
    "evidence",
    "paper_configs",
    "ClassifierConfig",
    "ClassifierState",
    "classifier_init",
    "classify",
    "classifier_update",
    "success_estimate",
    "visit_outcome",
    "bin_success",
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
    "RolloutGDROConfig",
    "RolloutGDROState",
    "Allocation",
    "rollout_gdro_init",
    "evidence_update",
    "allocate",
    "arm_probs",
    "solve_arms_dp",
    "sqrt_allocation",
    "fixed_allocation",
    "rollout_gdro_update",
    "rollout_gdro_diagnostics",
]
