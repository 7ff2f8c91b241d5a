"""What a comparison runs: the methods, their configs, the seeds, the study's settings
(`ComparisonPlan`), the job plan and its wall time."""

from __future__ import annotations

import dataclasses
import math
import os
import sys
from collections.abc import Mapping, Sequence

import numpy as np

# method name -> (algorithm, overrides as dotted paths from the config root: value). The order
# is the report's order.
METHODS: dict[str, tuple[str, dict]] = {
    "grpo": ("grpo", {}),
    "prompt_gdro_aw": ("prompt_gdro", {"gdro.prompt.apply": "advantage_weight"}),
    "prompt_gdro_rs": ("prompt_gdro", {"gdro.prompt.apply": "resample"}),
    "rollout_gdro_bandit": ("rollout_gdro", {"gdro.rollout.allocator": "bandit"}),
    "rollout_gdro_sqrt": ("rollout_gdro", {"gdro.rollout.allocator": "sqrt"}),
    # the pre-registered mechanism test (reports/gdro_mechanism/preregistration.md)
    "prompt_gdro_eta5": ("prompt_gdro", {"gdro.prompt.eta": 5.0}),
    "prompt_gdro_eta10": ("prompt_gdro", {"gdro.prompt.eta": 10.0}),
    "prompt_gdro_paper": (
        "prompt_gdro",
        {"gdro.classifier.mode": "paper", "gdro.prompt.mode": "paper"},
    ),
    "rollout_gdro_sqrt_any": (
        "rollout_gdro",
        {"gdro.rollout.allocator": "sqrt", "gdro.classifier.statistic": "any_correct"},
    ),
    "rollout_gdro_shrunk": ("rollout_gdro", {"gdro.rollout.allocator": "shrunk"}),
    "rollout_gdro_bandit_paper": (
        "rollout_gdro",
        {
            "gdro.rollout.allocator": "bandit",
            "gdro.classifier.mode": "paper",
            "gdro.rollout.mode": "paper",
        },
    ),
    # the field's curricula (grpo_jax/algorithms/field.py; reports/gdro_fair_test/)
    "dapo": ("dapo", {}),
    # the window estimate: with n_bar = 4 the group's own rate makes the band DAPO's rule
    "online_filter": ("online_filter", {"curricula.filter.estimate": "window"}),
    "learnability": ("learnability", {}),
    "greso": ("greso", {}),
}
# the arms of the mechanism test, in its report's order
MECHANISM_METHODS = (
    "grpo",
    "prompt_gdro_eta5",
    "prompt_gdro_eta10",
    "prompt_gdro_paper",
    "rollout_gdro_sqrt",
    "rollout_gdro_sqrt_any",
    "rollout_gdro_shrunk",
    "rollout_gdro_bandit_paper",
)
# the arms of the fair test (reports/gdro_fair_test/preregistration.md), in its report's order
FAIR_TEST_METHODS = (
    "grpo",
    "prompt_gdro_eta10",
    "prompt_gdro_paper",
    "rollout_gdro_bandit_paper",
    "rollout_gdro_sqrt",
    "learnability",
    "online_filter",
    "greso",
    "dapo",
)
LABELS = {
    "grpo": "GRPO",
    "prompt_gdro_aw": "Prompt-GDRO (advantage_weight)",
    "prompt_gdro_rs": "Prompt-GDRO (resample)",
    "rollout_gdro_bandit": "Rollout-GDRO (bandit)",
    "rollout_gdro_sqrt": "Rollout-GDRO (sqrt)",
    "prompt_gdro_eta5": "Prompt-GDRO (eta 5)",
    "prompt_gdro_eta10": "Prompt-GDRO (eta 10)",
    "prompt_gdro_paper": "Prompt-GDRO (paper)",
    "rollout_gdro_sqrt_any": "Rollout-GDRO (sqrt, any-correct)",
    "rollout_gdro_shrunk": "Rollout-GDRO (shrunk)",
    "rollout_gdro_bandit_paper": "Rollout-GDRO (paper bandit)",
    "dapo": "DAPO dynamic sampling",
    "online_filter": "Online difficulty filter (Bae et al.)",
    "learnability": "Learnability sampling (p(1-p))",
    "greso": "GRESO pre-rollout skipping",
}
PAPER = "+10.6% (Prompt-GDRO) / +10.1% (Rollout-GDRO) relative pass@8 over GRPO on Qwen3-Base"
REPORT_NAME = "gdro_vs_grpo"
DEFAULT_LRS = (3e-5, 1e-4, 3e-4)
DEFAULT_CONFIG = "configs/arithmetic.py"
METRICS = ("pass_at_k", "mean_at_k")
PASS_K = 8  # the paper's pass@8, estimated from all evaluation samples (Chen et al. 2021)
EXTRA_PASS_K = (1, 8, 32)  # the compact table's pass@k (those with k <= samples)
HARD_WEIGHTS = {2: 1.0, 3: 2.0, 4: 3.0, 5: 4.0}  # level -> weight of the hard-weighted mix


@dataclasses.dataclass(frozen=True)
class ComparisonPlan:
    """What one comparison runs and reports (`cli.run_comparison`): built by
    ``python -m experiments.compare`` from its flags (same names, same defaults but
    ``methods``), by tests directly. Checked when the comparison starts (``ValueError``).

    ``seeds``: the final paired seeds, N (= 0..N-1), a list, or the flag's text ('3,5' / '5,');
    ``sweep_seeds``: the lr-sweep seeds, N (= the first N final seeds) or a list; ``lrs``: the
    sweep's learning rates; ``methods``: names of `METHODS` (GRPO among them).
    ``config_arg``: the config argument after the algorithm (``get_config('<algo>,<arg>')``;
    ``'file.py:arg'`` for another config file); ``steps`` / ``prompts_per_step``: RL steps and
    P (0 = the config's); ``rl_prompts``: the RL pool, the first N problems; ``eval_every``:
    evaluate every N RL steps; ``token_budget``: generated tokens per RL run (0 = ``steps``
    steps). ``last_evals``: a run's score is the mean of its last N evaluations, on
    ``select_metric`` (`METRICS`) to choose each method's lr on validation. ``oracle_json``
    (``{"p": {"<prompt id>": p}}``) or, without it, ``oracle_samples`` samples per RL prompt
    (0 = skip) give the true success rates. ``n_boot``: bootstrap replicates; ``hard_weights``:
    level -> weight of the hard-weighted mix; ``preregistration``: a markdown file included
    verbatim near the report's top; ``criterion``: evaluate the pre-registered criterion.
    """

    seeds: Sequence[int] | int | str = 10
    sweep_seeds: Sequence[int] | int = 3
    lrs: Sequence[float] = DEFAULT_LRS
    methods: Sequence[str] = tuple(METHODS)
    config_arg: str = "heavy_tailed"
    paper_gdro: bool = False
    steps: int = 80
    prompts_per_step: int = 0
    rl_prompts: int = 512
    eval_every: int = 20
    token_budget: int = 0
    last_evals: int = 3
    select_metric: str = "pass_at_k"
    oracle_json: str = ""
    oracle_samples: int = 16
    n_boot: int = 2000
    hard_weights: Mapping[int, float] = dataclasses.field(
        default_factory=lambda: dict(HARD_WEIGHTS)
    )
    preregistration: str = ""
    criterion: bool = False

    def job_settings(self) -> dict:
        """The keywords of every RL job but ``lr`` (`jobs.rl_job`, `jobs.rl_settings`)."""
        return {
            "config_arg": self.config_arg,
            "steps": self.steps,
            "rl_prompts": self.rl_prompts,
            "paper_gdro": self.paper_gdro,
            "prompts_per_step": self.prompts_per_step,
            "eval_every": self.eval_every,
            "token_budget": int(self.token_budget),
        }


def label(method: str) -> str:
    return LABELS.get(method, method)


def algorithm(method: str) -> str:
    return METHODS[method][0]


def overrides(method: str) -> dict:
    return dict(METHODS[method][1])


def ordered_methods(selected: Sequence[str]) -> list[str]:
    """``selected`` in ``METHODS`` order (the report's order).

    Raises:
      ValueError: an unknown method or no GRPO baseline.
    """
    for m in selected:
        if m not in METHODS:
            raise ValueError(f"method {m!r}: choose from {list(METHODS)}")
    if "grpo" not in selected:
        raise ValueError("methods must include 'grpo' (the baseline of the relative gain)")
    return [m for m in METHODS if m in selected]


def apply_overrides(config, values: Mapping) -> None:
    """Sets ``config.<dotted path> = value`` for each item of ``values``.

    Raises:
      ValueError: a path whose field does not exist in the config.
    """
    for path, value in values.items():
        *parents, field = path.split(".")
        node = config
        for part in parents:
            if part not in node:
                raise ValueError(f"override {path!r}: the config has no field {part!r}")
            node = node[part]
        if field not in node:
            raise ValueError(f"override {path!r}: the config has no field {field!r}")
        node[field] = value


def method_config(
    method: str,
    seed: int,
    *,
    config_arg: str = "heavy_tailed",
    steps: int = 0,
    rl_prompts: int = 0,
    lr: float | None = None,
    paper_gdro: bool = False,
    prompts_per_step: int = 0,
):
    """The ``configs/arithmetic.py:<algo>,<config_arg>`` config of ``method`` for one seed.

    Args:
      method: a key of ``METHODS``.
      seed: ``config.seed`` (init, data order, sampling).
      config_arg: the argument after the algorithm (``heavy_tailed``, ``frontier``, ...), or
        ``"<file.py>:<argument>"`` for another config file whose ``get_config`` takes
        ``"<algorithm>[,<argument>]"``.
      steps, prompts_per_step: RL steps and ``rollout.prompts_per_step`` (0 = the config's).
      rl_prompts: ``data.max_train_examples`` (0 = all training problems).
      lr: ``optimizer.learning_rate`` (None = the config's).
      paper_gdro: the paper's controllers (``common.paper_gdro``) with the failure-rate signal;
        default: the corrected defaults. Applied before the method's overrides.

    Raises:
      ValueError: unknown method or an override of a missing field.
    """
    from configs import common

    if method not in METHODS:
        raise ValueError(f"method {method!r}: choose from {list(METHODS)}")
    algo, values = METHODS[method]
    path, arg = split_config_arg(config_arg)
    c = load_config_module(path).get_config(f"{algo},{arg}" if arg else algo)
    c.seed = int(seed)
    if steps:
        c.steps = int(steps)
    if prompts_per_step:
        c.rollout.prompts_per_step = int(prompts_per_step)
    if lr is not None:
        c.optimizer.learning_rate = float(lr)
    c.data.max_train_examples = int(rl_prompts)
    if paper_gdro:
        # the paper's GDRO with the failure-rate signal: the surrogate is ~0 at ratio 1 with one
        # update per batch (docs/gdro.md)
        common.paper_gdro(c)
        c.gdro.prompt.signal = c.gdro.rollout.signal = "failure_rate"
    apply_overrides(c, values)
    c.mesh.num_devices = 1  # one CPU device per process (tests force 8 virtual ones)
    c.logging.progress_bar = False
    c.logging.tensorboard = False
    return c


def split_config_arg(config_arg: str) -> tuple[str, str]:
    """``"<file.py>:<argument>"`` -> (file, argument); a bare argument -> (`DEFAULT_CONFIG`, it)."""
    head, sep, tail = (config_arg or "").partition(":")
    if head.endswith(".py"):
        return head, tail
    if sep:
        raise ValueError(f"config_arg {config_arg!r}: expected '<file.py>:<argument>'")
    return DEFAULT_CONFIG, config_arg or ""


def load_config_module(path: str):
    """The config module at ``path`` (relative to the working directory or to the repository)."""
    import importlib.util

    full = path
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isabs(full) and not os.path.exists(full):
        full = os.path.join(root, path)
    if not os.path.exists(full):
        raise FileNotFoundError(f"--config {path}: no such file")
    name = "grpo_jax_compare_config_" + os.path.splitext(os.path.basename(full))[0]
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, full)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.modules[name] = mod
    return mod


def eval_steps(steps: int, every: int) -> list[int]:
    """The RL steps after which a run is evaluated: every ``every`` steps and the last one."""
    steps = int(steps)
    out = list(range(every, steps, every)) if every and every > 0 else []
    return out + [steps]


def split_heldout(num: int) -> tuple[np.ndarray, np.ndarray]:
    """(validation, test) indices into the held-out list: even index -> validation, odd ->
    test. The arithmetic generator shuffles the held-out list over levels, so each half holds
    about half of every level. Deterministic and disjoint; together they cover ``range(num)``."""
    idx = np.arange(int(num))
    return idx[0::2], idx[1::2]


def parse_seeds(spec, default_count: int = 10) -> list[int]:
    """``10`` -> seeds 0..9; ``"3,5"`` or ``"5,"`` -> those seeds; a sequence -> as given."""
    if spec is None:
        return list(range(default_count))
    if isinstance(spec, int):
        return list(range(spec))
    if isinstance(spec, str):
        parts = [p for p in spec.split(",") if p.strip()]
        if "," not in spec:
            return list(range(int(spec)))
        return [int(p) for p in parts]
    return [int(s) for s in spec]


def parse_level_weights(spec: str) -> dict[int, float]:
    """``"2:1,3:2"`` -> {2: 1.0, 3: 2.0}.

    Raises:
      ValueError: an item that is not ``level:weight`` or a negative weight.
    """
    out = {}
    for item in (x.strip() for x in spec.split(",")):
        if not item:
            continue
        level, sep, weight = item.partition(":")
        if not sep:
            raise ValueError(f"--hard_weights item {item!r}: expected 'level:weight'")
        out[int(level)] = float(weight)
        if out[int(level)] < 0:
            raise ValueError(f"--hard_weights item {item!r}: the weight must be >= 0")
    return out


def job_name(method: str | None, lr: float | None, seed: int) -> str:
    return f"warm_s{seed}" if method is None else f"{method}_lr{float(lr):.3g}_s{seed}"


def plan_jobs(
    seeds: Sequence[int], sweep_seeds, methods: Sequence[str], lrs: Sequence[float]
) -> dict:
    """The sweep and final seeds and the job counts.

    ``sweep_seeds``: an int N = the first N of ``seeds`` (prefix; their sweep runs at the chosen
    lr are reused as final runs), or explicit seeds (those also in ``seeds`` are reused).

    Returns: {"seeds", "sweep_seeds", "final_only_seeds", "mode", "n_sweep", "n_final",
    "n_warm", "warm_seeds"}.
    """
    seeds = [int(s) for s in seeds]
    if isinstance(sweep_seeds, int):
        if not 1 <= sweep_seeds <= len(seeds):
            raise ValueError(f"sweep_seeds={sweep_seeds} must be in 1..{len(seeds)}")
        sw, mode = seeds[:sweep_seeds], "the first seeds of the final ones (prefix)"
    else:
        sw = [int(s) for s in sweep_seeds]
        if not sw:
            raise ValueError("sweep_seeds must not be empty")
        inter = set(sw) & set(seeds)
        mode = (
            "disjoint from the final seeds"
            if not inter
            else f"{len(inter)} of them also final seeds"
        )
    extra = [s for s in seeds if s not in sw]
    warm = list(dict.fromkeys(list(sw) + seeds))
    return {
        "seeds": seeds,
        "sweep_seeds": sw,
        "final_only_seeds": extra,
        "mode": mode,
        "n_sweep": len(methods) * len(lrs) * len(sw),
        "n_final": len(methods) * len(extra),
        "n_warm": len(warm),
        "warm_seeds": warm,
    }


def estimate_wall(
    warm_seconds: float, job_seconds: float, n_warm: int, n_jobs: int, workers: int
) -> float:
    """Wall seconds of ``n_warm`` warm starts then ``n_jobs`` RL jobs on ``workers`` processes,
    each taking the measured time (jobs run in waves of ``workers``)."""
    w = max(int(workers), 1)
    return math.ceil(n_warm / w) * warm_seconds + math.ceil(n_jobs / w) * job_seconds
