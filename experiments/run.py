"""The main job: `python -m experiments.run --config=configs/arithmetic.py:grpo --workdir=DIR`.

Overrides: `--config.steps=10 --config.rollout.prompts_per_step=16`. A misspelled key gives a
one-line error naming the closest valid keys. The logic lives in `grpo_jax.train`.
"""
import re
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/arithmetic.py:grpo",
                                          "Experiment config file, with an argument after ':'.")
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/default", "Where checkpoints, metrics and "
                               "the summary are written; an existing run there is resumed.")


def _config_key_errors(argv):
  """Checks `--config.a.b=...` keys before absl does, so typos get a clean message."""
  config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if config_arg is None and "--config" in argv:
    config_arg = argv[argv.index("--config") + 1]
  overrides = [m.group(1) for a in argv for m in [re.match(r"--config\.([\w.]+)(=|$)", a)] if m]
  if not overrides or config_arg is None:
    return None
  from ml_collections.config_flags import config_flags as cf
  from grpo_jax import config_utils
  try:
    config = cf._LoadConfigModule("config", config_arg.split(":", 1)[0]).get_config(
        *([config_arg.split(":", 1)[1]] if ":" in config_arg else []))
  except Exception:  # noqa: BLE001 -- absl reports config-file errors itself
    return None
  valid = set(config_utils.all_keys(config))
  for key in overrides:
    if key not in valid:
      close = config_utils.closest_keys(config, key)
      hint = f"; did you mean {', '.join('config.' + c for c in close)}?" if close else ""
      return f"unknown config key config.{key}{hint}"
  return None


def main(argv):
  del argv
  from grpo_jax import config_utils, train
  try:
    train.train_and_evaluate(_CONFIG.value, _WORKDIR.value)
  except config_utils.ConfigError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  error = _config_key_errors(sys.argv)
  if error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
  app.run(main)
