"""grpo_jax: critic-free RL for language models (GRPO and the GDRO controllers) in JAX/Flax.

Modules are imported on use (`from grpo_jax import advantages, losses`), so importing the
package stays cheap for notebooks. Training from Python (a config, rows, reward callables):
`grpo_jax.api.train` (docs/byo.md).
"""

__version__ = "0.1.0"
