"""The GDRO curricula (Panaganti et al., arXiv 2601.19280; spec: shared/spec/gdro.md).

`PromptGDRO` shifts training signal toward hard bins (advantage weights, Eq. 16, or drawing
prompts by bin); `RolloutGDRO` moves rollouts between bins at a fixed mean budget (Eq. 17-21).
The controllers' math is in `grpo_jax.gdro`; these classes only say when the trainer calls it.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from grpo_jax import gdro
from grpo_jax import transfer as xfer
from grpo_jax.algorithms.base import Curriculum, CurriculumState, Placement, StepOutcome


@dataclasses.dataclass(frozen=True)
class PromptGDRO(Curriculum):
    """Prompt-GDRO: exponential weights over difficulty bins (Eq. 12-16).

    ``apply="advantage_weight"``: each rollout's advantage is multiplied by its bin's weight;
    ``apply="resample"``: prompts are drawn by bin with the weights, rollouts weigh 1.
    """

    prompt_config: gdro.PromptGDROConfig = gdro.PromptGDROConfig()
    hysteresis = 0.03  # the classifier's default margin delta for this curriculum (spec s.1)

    @classmethod
    def config_kwargs(cls, run) -> dict:
        return {**super().config_kwargs(run), "prompt_config": run.gdro.prompt}

    def init_controller(self):
        return gdro.prompt_gdro_init(self.prompt_config, self.num_bins)

    def draw(self, state: CurriculumState, source, step: int) -> list[dict]:
        # eta = 0: every bin weighs alike, so the population-weighted draw is uniform; take
        # GRPO's own stream (same prompts, same order)
        if self.prompt_config.apply != "resample" or step == 0 or self.prompt_config.eta == 0:
            return source.next()
        with xfer.controllers():
            all_ids = jnp.arange(self.num_prompts, dtype=jnp.int32)
            all_bins = np.asarray(gdro.classify(self.classifier_config, state.classifier, all_ids))
            # slot B of q: never-seen prompts (their share of the pool; corrected mode)
            q = np.asarray(gdro.resample_q(self.prompt_config, state.controller, all_bins))
        return source.next_by_bin(q, all_bins)

    def weights(
        self, state: CurriculumState, placement: Placement, advantages: np.ndarray
    ) -> np.ndarray:
        if self.prompt_config.apply != "advantage_weight":
            return super().weights(state, placement, advantages)
        rollout_bins = placement.bins[placement.segment_ids]
        with xfer.controllers():
            w = gdro.prompt_gdro_weights(
                self.prompt_config, state.controller, rollout_bins, advantages=advantages
            )
            return np.asarray(w)

    def update_controller(self, controller, outcome: StepOutcome):
        signal = gdro.loss_signal(
            self.prompt_config,
            per_rollout_loss=jnp.asarray(outcome.per_rollout_loss),
            correct=jnp.asarray(outcome.correct),
            advantages=jnp.asarray(outcome.advantages),
        )
        rollout_bins = outcome.placement.bins[outcome.placement.segment_ids]
        return gdro.prompt_gdro_update(
            self.prompt_config,
            controller,
            jnp.asarray(rollout_bins),
            signal,
            rewards=jnp.asarray(outcome.rewards),
            advantages=jnp.asarray(outcome.advantages),
        )


@dataclasses.dataclass(frozen=True)
class RolloutGDRO(Curriculum):
    """Rollout-GDRO: rollouts per prompt by bin at a fixed mean budget n_bar (Eq. 17-21),
    with the bandit allocator (the paper's) or the closed-form square-root rule."""

    rollout_config: gdro.RolloutGDROConfig = gdro.RolloutGDROConfig()
    fixed_group_size = False
    rollout_budget = True

    @classmethod
    def config_kwargs(cls, run) -> dict:
        n_bar = run.rollout.rollouts_per_prompt  # the mean budget (checked against n_min, n_max)
        return {
            **super().config_kwargs(run),
            "rollout_config": dataclasses.replace(run.gdro.rollout, n_bar=n_bar),
        }

    def init_controller(self):
        return gdro.rollout_gdro_init(self.rollout_config, self.num_bins, self.num_prompts)

    def allocate(self, state: CurriculumState, ids: np.ndarray) -> Placement:
        bins, success = self.classify(state, ids)
        with xfer.controllers():
            alloc = gdro.allocate(
                self.rollout_config, state.controller, bins, success, prompt_ids=ids
            )
        return Placement(bins=bins, success=success, allocation=alloc)

    def update_controller(self, controller, outcome: StepOutcome):
        signal = gdro.loss_signal(
            self.rollout_config,
            per_rollout_loss=jnp.asarray(outcome.per_rollout_loss),
            correct=jnp.asarray(outcome.correct),
        )
        p = outcome.placement
        new, diag = gdro.rollout_gdro_update(
            self.rollout_config,
            controller,
            p.allocation,
            p.bins,
            signal,
            outcome.rewards,
            p.segment_ids,
            bin_success=p.success,
            prompt_ids=outcome.visits[-1].ids if outcome.visits else None,
        )
        for v in outcome.visits:  # the shrunk allocator's per-prompt counts (no-op otherwise)
            new = gdro.evidence_update(self.rollout_config, new, v.ids, v.correct, v.segment_ids)
        return new, diag
