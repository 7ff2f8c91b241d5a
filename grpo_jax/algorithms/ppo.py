"""PPO with a learned critic: the baseline GRPO removes (Schulman et al. 2017; GAE: Schulman et
al. 2016, Eq. 16). The critic is a copy of the policy's architecture with a scalar value head
(`models.transformer.CriticModel`); the outcome reward sits on each completion's last token,
advantages are whitened over tokens.

The KL to the reference (``algorithm.kl_coef > 0``) is paid once, where ``algorithm.kl_in``
says: ``"reward"`` (PPO's default; Ouyang et al. 2022, Eq. 2; TRL's PPOTrainer; verl's
``use_kl_in_reward``) subtracts ``kl_coef * kl_t`` from each token's reward, with ``kl_t`` the
``algorithm.kl_kind`` estimator between the sampling policy's and the reference's log-probs;
``"loss"`` adds it to the policy loss instead (as GRPO does), the rewards are the outcome only.
The critic is trained like the policy: AdamW on a float32 master copy when its parameters are
stored in a lower precision (`state.master_weights`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax
from flax import nnx

from grpo_jax import losses, sharding
from grpo_jax.algorithms.base import Learner
from grpo_jax.models import transformer
from grpo_jax.models.transformer import positions_from_mask
from grpo_jax.state import Batch, TrainState, apply_optimizer, make_optimizer


@flax.struct.dataclass
class PPOState(TrainState):
    """`TrainState` plus the critic's parameters and optimizer state."""

    critic_params: Any = None
    critic_opt_state: Any = None


@flax.struct.dataclass
class PPOBatch(Batch):
    """`Batch` plus the critic's targets: ``returns`` and ``old_values`` [R, Lc] float32
    (``advantages`` are per token, [R, Lc])."""

    returns: jax.Array = None
    old_values: jax.Array = None


def _abstract_critic(model_config):
    with nnx.use_eager_sharding(False):
        return nnx.eval_shape(lambda: transformer.CriticModel(model_config, rngs=nnx.Rngs(0)))


def _low_precision(abstract_params) -> bool:
    """True when any floating-point parameter is stored in less than float32 (bfloat16)."""
    return any(
        jnp.issubdtype(x.dtype, jnp.floating) and jnp.finfo(x.dtype).bits < 32
        for x in jax.tree.leaves(abstract_params)
    )


@dataclasses.dataclass(frozen=True)
class PPO(Learner):
    """The PPO learner (fields from ``config.ppo``; KL from ``config.algorithm.kl_coef``).

    Attributes:
      gamma, lam: GAE discount and lambda; value_clip: value-loss clip range; vf_coef: value-loss
      coefficient; critic_lr: critic learning rate; kl_coef, kl_kind: the KL penalty to the
      reference; kl_in: ``"reward"`` (per-token reward penalty) or ``"loss"`` (policy loss).
    """

    model_config: Any = None
    critic_graphdef: Any = None
    prompt_len: int = 0
    seed: int = 0
    critic_tx: Any = None
    gamma: float = 1.0
    lam: float = 0.95
    value_clip: float = 0.2
    vf_coef: float = 0.5
    critic_lr: float = 1e-4
    kl_coef: float = 0.0
    kl_kind: str = "k3"
    kl_in: str = "reward"

    state_cls = PPOState
    per_token_advantages = True
    kl_in_choices = ("reward", "loss")
    default_kl_in = "reward"

    @property
    def needs_policy_logprobs(self) -> bool:
        """The reward penalty reads the sampling policy's log-probs, also on-policy."""
        return self.kl_coef > 0 and self.kl_in == "reward"

    @classmethod
    def from_config(cls, run, model_config, total_updates: int, prompt_len: int = 0) -> PPO:
        p = run.ppo
        graphdef, abstract = nnx.split(_abstract_critic(model_config), nnx.Param)
        return cls(
            model_config=model_config,
            critic_graphdef=graphdef,
            prompt_len=prompt_len,
            seed=run.seed,
            # bfloat16 critic parameters train through a float32 master copy, like the policy's
            critic_tx=make_optimizer(
                run.optimizer,
                total_updates,
                learning_rate=p.critic_lr,
                master=_low_precision(abstract),
            ),
            gamma=p.gamma,
            lam=p.lam,
            value_clip=p.value_clip,
            vf_coef=p.vf_coef,
            critic_lr=p.critic_lr,
            kl_coef=run.algorithm.kl_coef,
            kl_kind=run.algorithm.kl_kind,
            kl_in=cls.resolve_kl_in(run),
        )

    def init_extra(self) -> dict:
        with nnx.use_eager_sharding(False):
            critic = transformer.CriticModel(self.model_config, rngs=nnx.Rngs(self.seed + 1))
        params = nnx.split(critic, nnx.Param)[1].to_pure_dict()
        return {"critic_params": params, "critic_opt_state": self.critic_tx.init(params)}

    def extra_shardings(self, shapes, mesh) -> dict:
        critic_sh = sharding.param_shardings(
            nnx.split(_abstract_critic(self.model_config), nnx.Param)[1], mesh
        )
        opt_sh = optax.tree_map_params(
            self.critic_tx,
            lambda _, s: s,
            shapes.critic_opt_state,
            critic_sh,
            transform_non_params=lambda _: sharding.replicated(mesh),
        )
        return {"critic_params": critic_sh, "critic_opt_state": opt_sh}

    def _values(self, critic_params, batch: Batch) -> jax.Array:
        """Critic values of the completion positions, [R, Lc] float32."""
        critic = nnx.merge(self.critic_graphdef, critic_params)
        positions = positions_from_mask(batch.attention_mask)
        values = critic(batch.tokens[:, :-1], positions[:, :-1], batch.attention_mask[:, :-1])
        return values[:, self.prompt_len - 1 :]

    def token_rewards(self, batch: Batch, rewards: jax.Array) -> jax.Array:
        """Per-token rewards [R, Lc] float32: ``rewards`` [R] on each row's last completion
        token, minus ``kl_coef * kl_t`` on every completion token when ``kl_in == "reward"``
        (``kl_t = losses.kl(old_logprobs, ref_logprobs, kl_kind)``: k1 is
        ``old_logprobs - ref_logprobs``, TRL PPOTrainer's ``-kl_coef * kl`` non-score reward).
        Masked positions are 0; a row without tokens gets nothing."""
        m = batch.completion_mask > 0
        rows = jnp.arange(m.shape[0])
        last = jnp.maximum(m.sum(-1).astype(jnp.int32) - 1, 0)
        out = jnp.zeros(m.shape, jnp.float32).at[rows, last].set(rewards.astype(jnp.float32))
        if self.needs_policy_logprobs:
            old = jnp.where(m, batch.old_logprobs, 0.0)
            ref = jnp.where(m, batch.ref_logprobs, 0.0)
            out = out - self.kl_coef * losses.kl(old, ref, self.kl_kind)
        return jnp.where(m, out, 0.0)

    def finish_batch(self, state: PPOState, batch: Batch, rewards: jax.Array) -> PPOBatch:
        """Critic values, per-token rewards (`token_rewards`), GAE, whitening.

        Args: rewards [R] float32. Returns the `PPOBatch` with per-token advantages [R, Lc]
        (whitened over the batch's tokens), ``returns`` (GAE advantages + values, not whitened)
        and ``old_values`` [R, Lc] float32.
        """
        values = self._values(state.critic_params, batch) * batch.completion_mask
        adv, returns = losses.gae(
            self.token_rewards(batch, rewards),
            values,
            batch.completion_mask,
            gamma=self.gamma,
            lam=self.lam,
        )
        adv = losses.whiten(adv, batch.completion_mask)
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(Batch)}
        return PPOBatch(**{**fields, "advantages": adv}, returns=returns, old_values=values)

    def extra_update(self, state: PPOState, batch: PPOBatch, accumulate):
        """One critic step on the clipped value loss (token-mean), through the float32 master copy
        under low-precision parameters (`state.apply_optimizer`); skipped when non-finite."""

        def critic_loss(critic_params, batch, denominator=None):
            values = self._values(critic_params, batch)
            loss, aux = losses.value_loss(
                values,
                batch.old_values,
                batch.returns,
                batch.completion_mask,
                clip_range=self.value_clip,
                denominator=denominator,
            )
            return self.vf_coef * loss, aux

        den = losses.loss_denominator(batch.completion_mask, "token-mean")
        vloss, _, grads = accumulate(critic_loss, state.critic_params, batch, den)
        params, opt = apply_optimizer(
            self.critic_tx, grads, state.critic_opt_state, state.critic_params
        )
        ok = jnp.isfinite(vloss)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        state = state.replace(
            critic_params=keep(params, state.critic_params),
            critic_opt_state=keep(opt, state.critic_opt_state),
        )
        return state, {"value_loss": vloss}
