"""The main job: `python -m experiments.run --config=configs/arithmetic.py:grpo --workdir=DIR`.

Overrides: `--config.steps=10 --config.rollout.prompts_per_step=16`. A misspelled key gives a
one-line error naming the closest valid keys. The logic lives in `grpo_jax.train`.

Multi-host (every process runs the same command): `jax.distributed.initialize` is called
  - with `--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (or the env vars
    GRPO_JAX_COORDINATOR, GRPO_JAX_NUM_PROCESSES, GRPO_JAX_PROCESS_ID), e.g. plain GPU hosts;
  - with no arguments (JAX reads the cluster: TPU pod workers, Slurm, Open MPI) when
    `--distributed=on`, or by default (`auto`) when such a multi-process cluster is detected.
`--distributed=off` never initialises. CPU processes use the gloo collectives.
"""
import os
import re
import sys

from absl import app
from absl import flags
from ml_collections import config_flags

_CONFIG = config_flags.DEFINE_config_file("config", "configs/arithmetic.py:grpo",
                                          "Experiment config file, with an argument after ':'.")
_WORKDIR = flags.DEFINE_string("workdir", "workdirs/default", "Where checkpoints, metrics and "
                               "the summary are written; an existing run there is resumed.")
_DISTRIBUTED = flags.DEFINE_enum("distributed", "auto", ["auto", "on", "off"],
                                 "jax.distributed.initialize: auto (when a coordinator is given or a "
                                 "multi-process TPU pod / Slurm / MPI job is detected), on, off.")
_COORDINATOR = flags.DEFINE_string("coordinator_address", None, "HOST:PORT of process 0's "
                                   "coordinator (default: $GRPO_JAX_COORDINATOR).")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None, "Number of processes "
                                      "(default: $GRPO_JAX_NUM_PROCESSES).")
_PROCESS_ID = flags.DEFINE_integer("process_id", None, "This process's index "
                                   "(default: $GRPO_JAX_PROCESS_ID).")
_INIT_TIMEOUT = flags.DEFINE_integer("distributed_timeout_s", 300, "Seconds to wait for every "
                                     "process to join before failing (instead of hanging).")


def _detected_cluster() -> str | None:
  """The multi-process cluster JAX can configure itself from, if any."""
  env = os.environ
  if len([h for h in env.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]) > 1:
    return "TPU pod"
  if int(env.get("SLURM_NTASKS", env.get("SLURM_NPROCS", "1")) or 1) > 1 and "SLURM_JOB_ID" in env:
    return "Slurm"
  if int(env.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
    return "Open MPI"
  return None


def initialize_distributed(mode: str = "auto", coordinator: str | None = None,
                           num_processes: int | None = None, process_id: int | None = None,
                           timeout_s: int = 300) -> bool:
  """Joins this process to a multi-process JAX job; returns whether it did.

  Flags win over the environment (GRPO_JAX_COORDINATOR, GRPO_JAX_NUM_PROCESSES,
  GRPO_JAX_PROCESS_ID). Must run before anything touches a JAX device.

  Raises:
    ValueError: a coordinator without the process count / id (or the reverse).
  """
  env = os.environ
  coordinator = coordinator or env.get("GRPO_JAX_COORDINATOR") or None
  num_processes = num_processes if num_processes is not None else (
      int(env["GRPO_JAX_NUM_PROCESSES"]) if env.get("GRPO_JAX_NUM_PROCESSES") else None)
  process_id = process_id if process_id is not None else (
      int(env["GRPO_JAX_PROCESS_ID"]) if env.get("GRPO_JAX_PROCESS_ID") else None)
  if mode == "off":
    return False
  explicit = coordinator is not None
  if explicit and (num_processes is None or process_id is None):
    raise ValueError("--coordinator_address needs --num_processes and --process_id (or "
                     "GRPO_JAX_NUM_PROCESSES / GRPO_JAX_PROCESS_ID)")
  if not explicit and (num_processes is not None or process_id is not None) and mode == "auto":
    raise ValueError("--num_processes / --process_id need --coordinator_address (or "
                     "GRPO_JAX_COORDINATOR)")
  cluster = _detected_cluster()
  if mode == "auto" and not explicit and cluster is None:
    return False
  import jax
  if not jax.config.jax_cpu_collectives_implementation:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU cross-process collectives
  kwargs = {"initialization_timeout": timeout_s}
  if explicit:
    kwargs.update(coordinator_address=coordinator, num_processes=num_processes, process_id=process_id)
  jax.distributed.initialize(**kwargs)
  print(f"process {jax.process_index()}/{jax.process_count()} ({'explicit coordinator ' + coordinator if explicit else cluster or 'auto'}): "
        f"{jax.local_device_count()} local / {jax.device_count()} global devices", flush=True)
  return True


def _load_config(argv):
  """The config named by `--config` (without overrides), or None if it cannot be loaded."""
  config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
  if config_arg is None and "--config" in argv[:-1]:
    config_arg = argv[argv.index("--config") + 1]
  if config_arg is None:
    return None
  from ml_collections.config_flags import config_flags as cf
  try:
    return cf._LoadConfigModule("config", config_arg.split(":", 1)[0]).get_config(
        *([config_arg.split(":", 1)[1]] if ":" in config_arg else []))
  except Exception:  # noqa: BLE001 -- absl reports config-file errors itself
    return None


def _config_key_errors(argv):
  """Checks `--config.a.b=...` keys before absl does, so typos get a clean message."""
  overrides = [m.group(1) for a in argv for m in [re.match(r"--config\.([\w.]+)(=|$)", a)] if m]
  config = _load_config(argv) if overrides else None
  if config is None:
    return None
  from grpo_jax import config_utils
  valid = set(config_utils.all_keys(config))
  for key in overrides:
    if key not in valid:
      close = config_utils.closest_keys(config, key)
      hint = (f"; did you mean {', '.join('config.' + c for c in close)}?" if close else
              "; the valid keys are listed (commented) in configs/common.py")
      return f"unknown config key config.{key}{hint}"
  return None


def _parse_flags(argv):
  """absl flag parsing, but a bad flag value is one `error: ...` line (exit 2), not FATAL + usage."""
  try:
    return flags.FLAGS(argv)
  except flags.Error as e:
    message = " ".join(str(e).split())
    hint = ""
    m = re.match(r"flag --config\.([\w.]+)=", message)
    config = _load_config(argv) if m else None
    if config is not None:
      value = config
      try:
        for part in m.group(1).split("."):
          value = value[part]
        hint = (f"; config.{m.group(1)} takes a value of type {type(value).__name__} "
                f"(e.g. --config.{m.group(1)}={value})")
      except (KeyError, AttributeError, TypeError):
        pass
    print(f"error: {message}{hint}", file=sys.stderr)
    sys.exit(2)


def main(argv):
  del argv
  try:
    initialize_distributed(_DISTRIBUTED.value, _COORDINATOR.value, _NUM_PROCESSES.value,
                           _PROCESS_ID.value, _INIT_TIMEOUT.value)
  except ValueError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  try:
    config = _CONFIG.value
    config.get("steps")  # a config file that failed to load raises here
  except OSError as e:
    reason = str(e).strip().splitlines()[-1].strip()
    print(f"error: --config: {reason}; give a config file and argument, e.g. "
          "--config=configs/arithmetic.py:grpo", file=sys.stderr)
    sys.exit(2)
  from grpo_jax import checkpointing, config_utils, train
  try:
    train.train_and_evaluate(config, _WORKDIR.value)
  except config_utils.ConfigError as e:  # bad config, paths or data: nothing was trained
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
  except (FloatingPointError, checkpointing.CheckpointError) as e:  # the run stopped; state is on disk
    print(f"error: {e}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
  error = _config_key_errors(sys.argv)
  if error:
    print(f"error: {error}", file=sys.stderr)
    sys.exit(2)
  app.run(main, flags_parser=_parse_flags)
