"""``python -m experiments.benchmark --hf_checkpoint=DIR --suite=math``: an alias of
`experiments.evaluate` (same flags, same code; see its docstring)."""

from experiments.evaluate import main
from grpo_jax import cli

if __name__ == "__main__":
    cli.run_absl(main)
