"""grpo_jax: critic-free RL for language models (GRPO and the GDRO controllers) in JAX/Flax.

Modules are imported on use (`from grpo_jax import advantages, losses`), so importing the
package stays cheap for notebooks.
"""

__version__ = "0.1.0"
