"""The main job: `python -m experiments.run --config=configs/arithmetic.py:grpo --workdir=DIR`.

Overrides: `--config.steps=10 --config.rollout.prompts_per_step=16`. A misspelled key gives a
one-line error naming the closest valid keys. The logic lives in `grpo_jax.train`.

Multi-host (every process runs the same command): `jax.distributed.initialize` is called
  - with `--coordinator_address=HOST:PORT --num_processes=N --process_id=I` (or the env vars
    GRPO_JAX_COORDINATOR, GRPO_JAX_NUM_PROCESSES, GRPO_JAX_PROCESS_ID), e.g. plain GPU hosts;
  - with no arguments (JAX reads the cluster: TPU pod workers, Slurm, Open MPI) when
    `--distributed=on`, or by default (`auto`) when such a multi-process cluster is detected.
`--distributed=off` never initialises. CPU processes use the gloo collectives.

Two groups (docs/disaggregated.md; `grpo_jax.disaggregated`): with `--role=train` /
`--role=generate` processes [0, `--train_processes`) train and the rest generate, each group on
its own devices; every process runs the same command but for its `--role` and `--process_id`,
with `--config.rollout.max_staleness` >= 1. Supported: one training and one generation process.
"""

import os
import signal
import sys


def _exit_before_training(signum, frame, peer=None):
    """SIGTERM / SIGINT before the training loop installs its own handler: nothing is saved yet
    (nothing to flush either: no checkpoint manager exists), so the process leaves at once
    (in a two-group run, after telling the other side: ``peer``, `disaggregated.Peer.leave`).
    After the run's own handling has ended (its files closed) a signal changes nothing: ignored."""
    del frame
    if getattr(sys.modules.get("grpo_jax.preemption"), "handled_runs_ended", 0):
        return
    name = signal.Signals(signum).name
    print(f"{name} before the run started: nothing saved; exiting.", file=sys.stderr, flush=True)
    if peer is not None:
        peer.leave("stopped", f"{name} before the run started")
    os._exit(130 if signum == signal.SIGINT else 0)


if __name__ == "__main__":  # first: a signal during the imports below is this one line too
    for _s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(_s, _exit_before_training)

import functools  # noqa: E402
import re  # noqa: E402
import traceback  # noqa: E402

from absl import flags  # noqa: E402
from ml_collections import config_flags  # noqa: E402

from grpo_jax import cli, distributed  # noqa: E402

_DEFAULT_CONFIG = "configs/arithmetic.py:grpo"


def _load_config(argv):
    """``(config, None)``: the config named by `--config` (without overrides); ``(None, reason)``
    when it cannot be loaded (one line)."""
    config_arg = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if config_arg is None and "--config" in argv[:-1]:
        config_arg = argv[argv.index("--config") + 1]
    config_arg = config_arg or _DEFAULT_CONFIG
    path, _, arg = config_arg.partition(":")
    from ml_collections.config_flags import config_flags as cf

    try:
        module = cf._LoadConfigModule("config", path)
    except Exception as e:
        reason = str(e).strip().splitlines()[-1].strip()
        return None, (
            f"--config={config_arg}: cannot load {path} ({reason}); give a config file and "
            f"argument, e.g. --config={_DEFAULT_CONFIG}"
        )
    try:
        return module.get_config(*([arg] if ":" in config_arg else [])), None
    except Exception as e:
        return (
            None,
            f"--config={config_arg}: get_config({arg!r}) failed: {type(e).__name__}: {' '.join(str(e).split())}",
        )


def _config_key_errors(argv):
    """Checks the config file and the `--config.a.b=...` keys before absl does, so a missing file
    or a typo gets a one-line message."""
    overrides = [m.group(1) for a in argv for m in [re.match(r"--config\.([\w.]+)(=|$)", a)] if m]
    config, error = _load_config(argv)
    if error:
        return error
    from grpo_jax import config_utils

    valid = set(config_utils.all_keys(config))
    for key in overrides:
        if key not in valid:
            close = config_utils.closest_keys(config, key)
            hint = (
                f"; did you mean {', '.join('config.' + c for c in close)}?"
                if close
                else "; the valid keys are listed (commented) in configs/common.py"
            )
            return f"unknown config key config.{key}{hint}"
    return None


def _resolve_config_path(argv):
    """``--config=configs/x.py:arg`` from any directory (``grpo-jax run``): a relative path that
    does not exist here is looked up in the checkout (beside its ``configs`` package)."""
    import os

    for i, a in enumerate(argv):
        if a.startswith("--config="):
            path, sep, arg = a.split("=", 1)[1].partition(":")
            if path and not os.path.exists(path) and not os.path.isabs(path):
                import configs

                root = os.path.dirname(os.path.dirname(os.path.abspath(configs.__file__)))
                candidate = os.path.join(root, path)
                if os.path.exists(candidate):
                    argv[i] = f"--config={candidate}{sep}{arg}"
    return argv


if __name__ == "__main__":  # before DEFINE_config_file, which applies --config.* overrides at once
    sys.argv = _resolve_config_path(sys.argv)
    _ERROR = _config_key_errors(sys.argv)
    if _ERROR:
        cli.fail(_ERROR)

_CONFIG = config_flags.DEFINE_config_file(
    "config", _DEFAULT_CONFIG, "Experiment config file, with an argument after ':'."
)
_WORKDIR = flags.DEFINE_string(
    "workdir",
    "workdirs/default",
    "Where checkpoints, metrics and the summary are written; an existing run there is resumed.",
)
_DISTRIBUTED = flags.DEFINE_enum(
    "distributed",
    "auto",
    ["auto", "on", "off"],
    "jax.distributed.initialize: auto (when a coordinator is given or a "
    "multi-process TPU pod / Slurm / MPI job is detected), on, off.",
)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address",
    None,
    "HOST:PORT of process 0's coordinator (default: $GRPO_JAX_COORDINATOR).",
)
_NUM_PROCESSES = flags.DEFINE_integer(
    "num_processes", None, "Number of processes (default: $GRPO_JAX_NUM_PROCESSES)."
)
_PROCESS_ID = flags.DEFINE_integer(
    "process_id", None, "This process's index (default: $GRPO_JAX_PROCESS_ID)."
)
_ALLOW_CHANGES = flags.DEFINE_list(
    "allow_changes",
    [],
    "Config fields (or sections), comma-separated, that a resume may change although they change "
    "the trajectory, e.g. --allow_changes=reward.format_reward,optimizer.learning_rate "
    "(grpo_jax.config_utils.SAFE_TO_CHANGE lists the fields that never need it).",
)
_ROLE = flags.DEFINE_enum(
    "role",
    "single",
    ["single", "train", "generate"],
    "single: every process trains and generates (the usual run); train / generate: this "
    "process's group in a two-group run (docs/disaggregated.md).",
)
_TRAIN_PROCESSES = flags.DEFINE_integer(
    "train_processes",
    1,
    "Two-group run: processes [0, T) train, [T, num_processes) generate.",
)
_CHANNEL_HOST = flags.DEFINE_string(
    "channel_host",
    None,
    "Two-group run: the address the other group reaches this process's weight / rollout "
    "channels at (default: this host name's address; give the interface the other hosts route "
    "to).",
)
_HEARTBEAT = flags.DEFINE_integer(
    "distributed_heartbeat_s",
    100,
    "Seconds without a process's heartbeat before the job counts it dead (a two-group run's "
    "trainer then stops with an error line instead of waiting).",
)
_PRINT_CONFIG = flags.DEFINE_bool(
    "print_config", False, "Print the resolved config (file + overrides) and exit."
)
_INIT_TIMEOUT = flags.DEFINE_integer(
    "distributed_timeout_s",
    300,
    "Seconds to wait for every process to join before failing (instead of hanging).",
)


def _parse_flags(argv):
    """absl flag parsing; a bad ``--config.a.b`` value's `cli.UsageError` names the type it takes."""
    try:
        return flags.FLAGS(argv)
    except flags.Error as e:
        message = " ".join(str(e).split())
        hint = ""
        m = re.match(r"flag --config\.([\w.]+)=", message)
        config = _load_config(argv)[0] if m else None
        if config is not None:
            value = config
            try:
                for part in m.group(1).split("."):
                    value = value[part]
                hint = (
                    f"; config.{m.group(1)} takes a value of type {type(value).__name__} "
                    f"(e.g. --config.{m.group(1)}={value})"
                )
            except (KeyError, AttributeError, TypeError):
                pass
        raise cli.UsageError(f"{message}{hint}") from None


def _ignore_late_signals():
    """After the run (finished, preempted or refused; its checkpoint and files are closed): a
    later SIGTERM / SIGINT changes nothing, so it is ignored. Without this the interpreter's
    teardown would restore the default actions, and a signal in the last milliseconds would
    kill the process (a signal death instead of the run's exit status)."""
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, signal.SIG_IGN)


def _fail(message, code):
    """One `error: ...` line and exit, without the interpreter's shutdown (a failed Orbax save
    leaves pending writes whose shutdown errors would print a hundred tracebacks)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    os._exit(code)


def _loaded_config():
    """The run's config (file + overrides); a file that failed to load: `cli.UsageError`."""
    try:
        config = _CONFIG.value
        config.get("steps")  # a config file that failed to load raises here
    except OSError as e:
        reason = str(e).strip().splitlines()[-1].strip()
        raise cli.UsageError(
            f"--config: {reason}; give a config file and argument, e.g. "
            "--config=configs/arithmetic.py:grpo"
        ) from None
    return config


def _groups(config):
    """The two-group split of a ``--role=train|generate`` process (None for ``single``), checked
    before the job is joined where the flags (or GRPO_JAX_*) give the process count and index.

    Raises:
      cli.UsageError: no distributed job, a role that is not the process's group, or a split
        or config `disaggregated.Groups.check` refuses.
    """
    role = _ROLE.value
    if role == "single":
        return None
    from grpo_jax import disaggregated

    _, n, pid = distributed.job_settings(None, _NUM_PROCESSES.value, _PROCESS_ID.value)
    if _DISTRIBUTED.value == "off" or not n:
        raise cli.UsageError(
            f"--role={role} is one group of a two-group jax.distributed job: give "
            "--coordinator_address, --num_processes and --process_id (or GRPO_JAX_*)"
        )
    groups = disaggregated.Groups(
        _TRAIN_PROCESSES.value, n, host=_CHANNEL_HOST.value, stale_s=_HEARTBEAT.value
    )
    try:
        groups.check(config)
    except ValueError as e:
        raise cli.UsageError(str(e)) from None
    if pid is not None and pid >= 0 and groups.role(pid) != role:
        raise cli.UsageError(
            f"--role={role} on process {pid}: processes [0, {groups.train_processes}) train "
            f"and [{groups.train_processes}, {n}) generate"
        )
    return groups


def _generate(config, groups, peer) -> int:
    """The generation group's process: builds its experiment on its own devices and runs the
    generation loop until the trainer's end; returns the exit status (1 when the trainer
    failed, 130 after a SIGINT here, else 0). A failure here: one ``error:`` line, told to the
    trainer (`disaggregated.Peer.leave`), exit status 2 (bad input) or 1."""
    from grpo_jax import config_utils, disaggregated, preemption, steps
    from grpo_jax.experiment import build_experiment

    with preemption.Preemption() as sig:  # a signal: passed to the trainer (`generate`)
        try:
            config_utils.validate(config)
            exp = build_experiment(config, devices=groups.devices)
            try:
                done, end = disaggregated.generate(exp, steps.make_steps(exp), groups, sig=sig)
            finally:
                exp.close()
        except Exception as e:
            if not isinstance(e, cli.BAD_INPUT):  # a bug, or the machine: its traceback
                traceback.print_exc()
            message = cli.one_line(e)
            print(f"error: {message}", file=sys.stderr, flush=True)
            peer.leave("failed", message)
            # a wait that ran out or a broken transfer is an OSError, but not bad input
            bad_input = isinstance(e, cli.BAD_INPUT) and not isinstance(
                e, (TimeoutError, ConnectionError)
            )
            return 2 if bad_input else 1
    how = {"done": "finished", "stopped": "stopped", "failed": "failed"}[end["status"]]
    why = f" ({end['message']})" if end["message"] else ""
    print(f"generation group: {done} batches generated; the training process {how}{why}")
    sys.stdout.flush()
    peer.leave("stopped" if sig.requested else "done")
    if end["status"] == "failed":
        return 1
    return 130 if sig.signum == signal.SIGINT else 0


def main(argv):
    del argv
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, _exit_before_training)
    groups = None if _PRINT_CONFIG.value else _groups(_loaded_config())
    try:  # a signal meanwhile: `_exit_before_training` (the join waits in slices)
        distributed.initialize(  # a bad setting: ValueError, one `error:` line (cli.run_absl)
            _DISTRIBUTED.value,
            _COORDINATOR.value,
            _NUM_PROCESSES.value,
            _PROCESS_ID.value,
            _INIT_TIMEOUT.value,
            heartbeat_timeout_s=_HEARTBEAT.value,
            recoverable=groups is not None,  # the two groups watch each other (Peer)
        )
    except distributed.JoinError as e:  # without the interpreter's shutdown (JAX's threads)
        _fail(e, 1)
    peer = groups.peer(_ROLE.value) if groups is not None else None
    if peer is not None:  # the generator's heartbeat; the trainer's relay of its signals
        peer.start()
    # again: jax.distributed.initialize installs a SIGTERM handler of its own (its preemption
    # notifier), which logs the signal and lets the process go on
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, functools.partial(_exit_before_training, peer=peer))
    config = _loaded_config()
    if _PRINT_CONFIG.value:
        print(config)
        return
    if peer is not None and peer.role == "generate":
        code = _generate(config, groups, peer)  # has said its end (Peer.leave): gone at once
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    from grpo_jax import checkpointing, disaggregated, train
    from grpo_jax.rewards import failures as reward_failures

    end, gone = ("failed", ""), False
    # errors.ConfigError (bad config, paths or data: nothing was trained) passes through:
    # one `error:` line, exit 2 (cli.run_absl)
    try:
        try:
            result = train.train_and_evaluate(
                config, _WORKDIR.value, allow_changes=_ALLOW_CHANGES.value, group=groups
            )
            end = ("stopped", result["signal"]) if result.get("preempted") else ("done", "")
        except BaseException as e:
            end, gone = ("failed", cli.one_line(e)), isinstance(e, disaggregated.PeerEnded)
            raise
        finally:
            _ignore_late_signals()
            if peer is not None:  # the generation process leaves first (unless it is gone)
                peer.leave(*end, wait=not gone)
    except disaggregated.PeerEnded as e:  # the last complete checkpoint is intact
        _fail(f"{e}; the last checkpoint is intact: rerun both processes to resume", 1)
    except checkpointing.CheckpointSaveError as e:  # the last complete checkpoint is intact
        _fail(e, 1)
    except (
        FloatingPointError,  # non-finite updates, or finite divergence (DivergenceError)
        reward_failures.RewardFailureError,
        checkpointing.CheckpointError,
        checkpointing.WorkdirError,
    ) as e:  # the run stopped (or never started); what was saved is on disk
        _fail(e, 1)
    except OSError as e:  # a file the run writes or reads (full disk, vanished, no permission)
        what = f"{e.filename}: " if e.filename else ""
        _fail(f"{what}{e.strerror or e} (errno {e.errno}); the last checkpoint is intact", 1)
    if result.get("preempted") and result.get("signal") == "SIGINT":
        sys.exit(130)


if __name__ == "__main__":
    cli.run_absl(main, flags_parser=_parse_flags)
