"""PPO with a learned critic: the baseline GRPO removes (Schulman et al. 2017; GAE: Schulman et
al. 2016, Eq. 16). The critic is a copy of the policy's architecture with a scalar value head
(`models.transformer.CriticModel`); the outcome reward sits on each completion's last token, the
KL to the reference (if any) is a per-token reward penalty, advantages are whitened over tokens.
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
from grpo_jax.state import Batch, TrainState, make_optimizer


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


@dataclasses.dataclass(frozen=True)
class PPO(Learner):
    """The PPO learner (fields from ``config.ppo``; KL from ``config.algorithm.kl_coef``).

    Attributes:
      gamma, lam: GAE discount and lambda; value_clip: value-loss clip range; vf_coef: value-loss
      coefficient; critic_lr: critic learning rate; kl_coef: per-token KL reward penalty.
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

    state_cls = PPOState
    per_token_advantages = True

    @classmethod
    def from_config(cls, config, model_config, total_updates: int, prompt_len: int = 0) -> PPO:
        p = config.ppo
        return cls(
            model_config=model_config,
            critic_graphdef=nnx.split(_abstract_critic(model_config), nnx.Param)[0],
            prompt_len=prompt_len,
            seed=config.seed,
            critic_tx=make_optimizer(config.optimizer, total_updates, learning_rate=p.critic_lr),
            gamma=p.gamma,
            lam=p.lam,
            value_clip=p.value_clip,
            vf_coef=p.vf_coef,
            critic_lr=p.critic_lr,
            kl_coef=config.algorithm.kl_coef,
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

    def finish_batch(self, state: PPOState, batch: Batch, rewards: jax.Array) -> PPOBatch:
        """Critic values, outcome reward on the last token (minus the KL penalty), GAE, whitening.

        Args: rewards [R] float32. Returns the `PPOBatch` with per-token advantages [R, Lc].
        """
        values = self._values(state.critic_params, batch) * batch.completion_mask
        rows = jnp.arange(values.shape[0])
        last = jnp.maximum(batch.completion_mask.sum(-1).astype(jnp.int32) - 1, 0)
        token_rewards = jnp.zeros_like(values).at[rows, last].set(rewards)
        if self.kl_coef > 0:
            token_rewards = token_rewards - self.kl_coef * (batch.old_logprobs - batch.ref_logprobs)
        adv, returns = losses.gae(
            token_rewards, values, batch.completion_mask, gamma=self.gamma, lam=self.lam
        )
        adv = losses.whiten(adv, batch.completion_mask)
        fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(Batch)}
        return PPOBatch(**{**fields, "advantages": adv}, returns=returns, old_values=values)

    def extra_update(self, state: PPOState, batch: PPOBatch, accumulate):
        """One critic step on the clipped value loss (token-mean); skipped when non-finite."""

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
        updates, opt = self.critic_tx.update(grads, state.critic_opt_state, state.critic_params)
        params = optax.apply_updates(state.critic_params, updates)
        ok = jnp.isfinite(vloss)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, old)
        state = state.replace(
            critic_params=keep(params, state.critic_params),
            critic_opt_state=keep(opt, state.critic_opt_state),
        )
        return state, {"value_loss": vloss}
