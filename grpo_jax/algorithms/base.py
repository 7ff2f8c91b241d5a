"""The two strategy protocols an algorithm is made of.

A **curriculum** decides *what* a step trains on: which prompts to draw, how many rollouts each
gets, how much each rollout weighs, and how its own state learns from the step's outcome. The
base `Curriculum` is GRPO's (uniform draws, fixed group size, unit weights); it still runs the
online difficulty classifier so every algorithm logs the same per-bin diagnostics (GRPO is the
baseline of the GDRO figures).

A **learner** decides *how* the policy is trained from the rows: the base `Learner` is the
critic-free one (group-relative advantages from `grpo_jax.advantages`, the clipped policy loss);
PPO (`grpo_jax.algorithms.ppo`) adds a critic with its own state and batch fields.

Hooks are called by `grpo_jax.train.rl_step` in this order: ``draw`` -> ``allocate`` ->
(generate, reward, advantages) -> ``weights`` -> (reference pass) -> ``learner.finish_batch``
-> (update) -> ``update``.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import flax
import jax
import numpy as np

from grpo_jax import gdro
from grpo_jax import transfer as xfer
from grpo_jax.state import Batch, TrainState


@flax.struct.dataclass
class CurriculumState:
    """A curriculum's state (a pytree, checkpointed with the run).

    Attributes:
      classifier: `gdro.ClassifierState`, every prompt's recent visits.
      controller: the curriculum's own state (`gdro.PromptGDROState`, ...); None for GRPO.
    """

    classifier: Any
    controller: Any = None


@flax.struct.dataclass
class Placement:
    """Where a step's rollouts go (host arrays; a pytree, so it can be checkpointed with the
    rollouts in flight, `grpo_jax.rollout_queue`).

    Attributes:
      bins: [P] int32, each prompt's difficulty bin (from past visits only).
      success: [B] float32, the classifier's success estimate per bin.
      allocation: `gdro.Allocation` (rollouts per prompt, segment ids [R], R fixed).
    """

    bins: np.ndarray
    success: Any
    allocation: Any

    @property
    def segment_ids(self) -> np.ndarray:
        """[R] int32: the prompt (position in the step's P) of each rollout."""
        return np.asarray(self.allocation.segment_ids, np.int32)


@dataclasses.dataclass(frozen=True)
class Visit:
    """One sampling round's prompts and their rollouts' correctness (host arrays):
    ``ids`` [P] int32, ``correct`` [R] bool, ``segment_ids`` [R] int32."""

    ids: np.ndarray
    correct: np.ndarray
    segment_ids: np.ndarray


@dataclasses.dataclass(frozen=True)
class StepOutcome:
    """What a curriculum learns from after the update (host arrays).

    Attributes:
      placement: the batch's `Placement`.
      rewards: [R] float32; correct: [R] bool; per_rollout_loss: [R] float32 (first pass's
        token-mean surrogate with unweighted advantages, detached); advantages: [R] float32.
      visits: every sampling round of the step (dynamic sampling may have drawn several): all of
        them update the classifier, also the groups that were dropped.
    """

    placement: Placement
    rewards: np.ndarray
    correct: np.ndarray
    per_rollout_loss: np.ndarray
    advantages: np.ndarray
    visits: tuple[Visit, ...]


@dataclasses.dataclass(frozen=True)
class Curriculum:
    """GRPO's curriculum: uniform prompts, ``n_bar`` rollouts each, unit weights.

    Subclass and override any of ``init_controller`` / ``draw`` / ``allocate`` / ``weights`` /
    ``update_controller`` to make another (docs/architecture.md has a worked example); register
    it with `grpo_jax.algorithms.register`.

    Attributes:
      classifier_config: `gdro.ClassifierConfig`.
      num_prompts: size of the training pool (prompt ids are ``0 .. num_prompts - 1``).
      prompts_per_step: P; rollouts_per_prompt: n_bar (R = P * n_bar rollouts per step).
    """

    classifier_config: gdro.ClassifierConfig
    num_prompts: int
    prompts_per_step: int
    rollouts_per_prompt: int

    # False when group sizes vary between prompts (shared-prompt forward and DAPO dynamic
    # sampling need equal groups).
    fixed_group_size = True
    # the classifier's hysteresis margin when config.gdro.classifier.delta is None
    hysteresis = 0.0
    # True: the curriculum allocates rollouts with config.gdro.rollout, whose mean budget n_bar
    # is the run's rollout.rollouts_per_prompt (set by `config_schema.typed`)
    rollout_budget = False
    # True: after generation the step keeps only the groups `keep_groups` accepts and samples
    # more rounds until it has P (DAPO dynamic sampling and its relatives; grpo_jax/train.py)
    filters_groups = False

    @classmethod
    def from_config(cls, run, num_prompts: int) -> Curriculum:
        """Builds from the typed run config (`config_schema.typed`: its ``gdro`` /
        ``curricula`` sections and ``rollout``).

        Raises: ValueError (from the controllers' configs) naming the bad field.
        """
        return cls(
            **cls.config_kwargs(run),
            num_prompts=num_prompts,
            prompts_per_step=run.rollout.prompts_per_step,
            rollouts_per_prompt=run.rollout.rollouts_per_prompt,
        )

    @classmethod
    def config_kwargs(cls, run) -> dict:
        """The dataclass fields this curriculum takes from the typed run config (override to
        add its own section; the classifier's margin is already this curriculum's)."""
        return {"classifier_config": run.gdro.classifier}

    @property
    def num_bins(self) -> int:
        return len(self.classifier_config.edges) + 1

    # ----------------------------------------------------------------- hooks
    def init(self) -> CurriculumState:
        """The initial state (every prompt unseen)."""
        return CurriculumState(
            classifier=gdro.classifier_init(self.classifier_config, self.num_prompts),
            controller=self.init_controller(),
        )

    def init_controller(self) -> Any:
        return None

    def draw(self, state: CurriculumState, source, step: int) -> list[dict]:
        """The step's P prompts (example dicts with ``id``) from a `data.PromptSource`."""
        del state, step
        return source.next()

    def classify(self, state: CurriculumState, ids: np.ndarray) -> tuple[np.ndarray, Any]:
        """(bins [P] int32, per-bin success [B] float32) of prompts ``ids`` [P] from past visits."""
        ccfg, ids = self.classifier_config, xfer.put(np.asarray(ids, np.int32))
        bins = gdro.classify(ccfg, state.classifier, ids)
        success = gdro.bin_success(ccfg, state.classifier, ids, bins, self.num_bins)
        return xfer.to_host((bins, success))

    def allocate(self, state: CurriculumState, ids: np.ndarray) -> Placement:
        """Bins, then rollouts per prompt (R = P * n_bar fixed, so shapes never change)."""
        bins, success = self.classify(state, ids)
        alloc = gdro.fixed_allocation(bins, self.rollouts_per_prompt, self.num_bins)
        return Placement(bins=bins, success=success, allocation=alloc)

    def keep_groups(
        self,
        state: CurriculumState,
        ids: np.ndarray,
        rewards: np.ndarray,
        correct: np.ndarray,
        segment_ids: np.ndarray,
    ) -> np.ndarray:
        """[P] bool: the groups a group-filtering step keeps (read when ``filters_groups`` or
        ``config.algorithm.dynamic_sampling``). Default, DAPO's (Yu et al. 2025, Eq. 11): the
        group's rewards [R] float32 are not all equal. ``ids`` [P] int32, ``correct`` [R] bool,
        ``segment_ids`` [R] int32 (host arrays) are for subclasses."""
        del state, correct
        P = len(ids)
        hi, lo = np.full(P, -np.inf, np.float32), np.full(P, np.inf, np.float32)
        np.maximum.at(hi, segment_ids, rewards)
        np.minimum.at(lo, segment_ids, rewards)
        return hi > lo

    def weights(
        self, state: CurriculumState, placement: Placement, advantages: np.ndarray
    ) -> np.ndarray:
        """Per-rollout weights [R] float32 (host) multiplying the advantages (ones for GRPO),
        from the step's (unweighted) advantages [R] float32 (host)."""
        del state, advantages
        return np.ones(placement.segment_ids.shape, np.float32)

    def update(self, state: CurriculumState, outcome: StepOutcome) -> tuple[CurriculumState, dict]:
        """Learns from the step: the classifier takes every round's visits, then the controller.

        Returns (state, diagnostics dict of host scalars / lists for the metrics row).
        """
        ccfg, cls_state = self.classifier_config, state.classifier
        for v in outcome.visits:
            ids, correct, seg = xfer.put((v.ids, v.correct, v.segment_ids))
            visit = gdro.visit_outcome(ccfg, correct, seg, len(v.ids))
            cls_state = gdro.classifier_update(ccfg, cls_state, ids, visit)
        rollout_bins = outcome.placement.bins[outcome.placement.segment_ids]
        diagnostics = gdro.prompt_gdro_diagnostics(
            self.num_bins, rollout_bins, rewards=outcome.rewards
        )
        # a controller's pure functions (grpo_jax.gdro) move its small arrays themselves
        crossing = xfer.controllers() if state.controller is not None else contextlib.nullcontext()
        with crossing:
            controller, extra = self.update_controller(state.controller, outcome)
        diagnostics.update(extra)
        return CurriculumState(classifier=cls_state, controller=controller), diagnostics

    def update_controller(self, controller: Any, outcome: StepOutcome) -> tuple[Any, dict]:
        del outcome
        return controller, {}


@dataclasses.dataclass(frozen=True)
class Learner:
    """The critic-free learner: the state is a plain `TrainState`, the batch a plain `Batch`.

    Subclasses (PPO) add state fields (``init_extra`` / ``extra_shardings``), fill extra batch
    fields (``finish_batch``) and train extra parameters (``extra_update``).

    Class attributes: ``kl_in_choices`` where the KL to the reference may go
    (``config.algorithm.kl_in``; the critic-free learner has no per-token rewards, so "loss"),
    ``default_kl_in`` (when the field is None). ``kl_in`` and ``needs_policy_logprobs`` (the
    learner's ``finish_batch`` reads ``Batch.old_logprobs`` also on-policy, so `rl_step` computes
    them) may be overridden per instance.
    """

    state_cls = TrainState
    per_token_advantages = False
    kl_in_choices = ("loss",)
    default_kl_in = "loss"
    kl_in = "loss"
    needs_policy_logprobs = False

    @classmethod
    def resolve_kl_in(cls, config) -> str:
        """``config.algorithm.kl_in``, or the learner's default when it is None."""
        return config.algorithm.kl_in or cls.default_kl_in

    @classmethod
    def from_config(cls, run, model_config, total_updates: int, prompt_len: int = 0) -> Learner:
        """Builds from the typed run config (`config_schema.typed`); ``prompt_len`` is the
        padded prompt length Lp."""
        del run, model_config, total_updates, prompt_len
        return cls()

    def init_extra(self) -> dict:
        """Extra `TrainState` fields (pure, run under ``jax.jit``); {} for GRPO."""
        return {}

    def extra_shardings(self, shapes, mesh) -> dict:
        """Shardings of the extra fields, keyed like ``init_extra``."""
        del shapes, mesh
        return {}

    def finish_batch(self, state: TrainState, batch: Batch, rewards: jax.Array) -> Batch:
        """The batch the update trains on (jitted; GRPO's is complete already)."""
        del state, rewards
        return batch

    def extra_update(self, state: TrainState, batch: Batch, accumulate) -> tuple[TrainState, dict]:
        """Updates the extra fields after the policy update (jitted inside it)."""
        del batch, accumulate
        return state, {}
