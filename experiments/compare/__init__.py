"""GRPO vs Prompt-GDRO vs Rollout-GDRO: a powered, equal-compute, resumable comparison with a
learning-rate sweep chosen on a validation split.

  python -m experiments.compare --out=reports                      # the default (~65 min, 2 CPUs)
  python -m experiments.compare --out=reports --estimate_only      # time one job, print estimate
  python -m experiments.compare --out=reports --max_minutes=30     # stop launching after 30 min
  python -m experiments.compare --out=/tmp/c --config_arg=heavy_tailed,smoke --seeds=2 \\
      --sweep_seeds=1 --lrs=1e-4,3e-4 --steps=4 --eval_every=2 --last_evals=2   # a toy run

Protocol:

1. **Methods** (`plan.METHODS`, in report order): name -> (algorithm, overrides as dotted config
   paths, e.g. ``{"gdro.prompt.apply": "resample"}``) on ``configs/arithmetic.py:<algorithm>,
   <--config_arg>`` with the corrected controller defaults (``docs/gdro.md``);
   ``--paper_gdro`` applies the paper's controllers first. ``--methods`` picks a subset.
2. **Paired seeds**: every method of a seed starts RL from the same supervised warm start and is
   evaluated with the same keys (``fold_in(PRNGKey(seed + 7), step)``).
3. **Validation / test split** (`split_heldout`): even held-out index -> validation, odd -> test.
4. **Learning-rate sweep** (``--lrs``) per method on ``--sweep_seeds`` (N = the first N final
   seeds, or a list); the lr with the highest mean validation ``--select_metric`` over the last
   ``--last_evals`` evaluations wins (`select_lr`; ties: the first lr). Sweep runs of final
   seeds are reused as their final runs.
5. **Final runs**: every ``--seeds`` seed at the chosen lr; every number is on the test half.
6. **Statistics**: paired bootstrap over seeds and test problems (`paired_bootstrap`) of the
   relative gain vs GRPO (pass@8, mean@8; pass@1/8/32 on the training mix and on a
   ``--hard_weights`` level mix), the absolute difference and the paired effect size d_z.
7. **Equal compute**: P prompts and ``R = P * n_bar`` rollouts per step for every method; with
   ``--token_budget=T`` every run instead goes on until it has generated T completion tokens
   (every sampling round counted, so arms that discard or add rollouts get the same generation
   compute), evaluated at as many evenly spaced token counts as ``--eval_every`` gives steps,
   with the same keys per seed; the report adds the tokens, rollouts and CPU seconds each arm
   needs to reach GRPO's final validation pass@8 (`statistics.compute_to_grpo_level`).
8. **Diagnostics** (`diagnostics`): per-prompt true WSE (`grpo_jax.metrics.
   weighted_standard_error`) vs uniform, expected vs measured informative groups, rollouts per
   prompt by true-p stratum, Prompt-GDRO's weight ratio / ESS, the share of steps on which the
   controller had data; step x bin heatmaps.
9. **Report extras**: ``--preregistration=PATH`` (included verbatim near the top) and
   ``--criterion`` (per arm: is the 95% CI lower bound of the relative test pass@8 gain > 0?
   and, with Holm's step-down over the arms, is its one-sided bootstrap p-value rejected at
   0.025?); gains by the warm start's per-problem success.

True success rates ``p_i``: ``--oracle_json=PATH`` (``experiments/oracle.py``'s output, or by
hand: ``{"p": {"<prompt id>": p}, "problems": {"<prompt id>": "3+4"} (optional, checked)}``,
ids = the RL pool's training indices), else estimated from ``--oracle_samples`` samples per RL
prompt of each seed's warm-start model (0 = skip); fixed over training either way.

Files: ``--out/gdro_vs_grpo.md`` (report), ``gdro_vs_grpo.json`` (every number),
``gdro_vs_grpo/*.png`` and ``gdro_vs_grpo/runs/`` (per job ``<method>_lr<lr>_s<seed>.{json,npz,
jsonl}``, ``warm_s<seed>.{json,npz}`` + ``_params.pkl``; see `jobs`). **Resume**: a rerun skips
every job whose files exist and whose recorded settings match (a mismatch is an error naming
the file and field), so ``--max_minutes`` splits a long run over sessions; ``--report_only``
rebuilds the report from the files alone.

Modules: `plan` (methods, configs, seeds, a study's settings `ComparisonPlan`, the job plan,
wall estimate), `jobs` (warm start / RL jobs, job files, worker pool), `statistics`,
`diagnostics`, `report` (figures, markdown), `cli` (`run_comparison(ComparisonPlan(...),
out_dir)`, ``main``).
"""

from experiments.compare.cli import estimate_only, main, run_comparison
from experiments.compare.diagnostics import (
    P_STRATA_EDGES,
    P_STRATA_LABELS,
    arm_diagnostics,
    controller_data_share,
    expected_informative,
    load_oracle,
    measured_informative,
    p_stratum,
    rollouts_by_stratum,
)
from experiments.compare.jobs import (
    SettingsMismatch,
    enable_compilation_cache,
    evaluate_per_problem,
    load_job,
    rl_job,
    save_job,
    warm_start_job,
)
from experiments.compare.plan import (
    DEFAULT_CONFIG,
    DEFAULT_LRS,
    HARD_WEIGHTS,
    LABELS,
    METHODS,
    METRICS,
    PAPER,
    PASS_K,
    REPORT_NAME,
    ComparisonPlan,
    apply_overrides,
    estimate_wall,
    eval_steps,
    job_name,
    label,
    load_config_module,
    method_config,
    parse_level_weights,
    parse_seeds,
    plan_jobs,
    split_config_arg,
    split_heldout,
)
from experiments.compare.report import make_figures, write_report
from experiments.compare.statistics import (
    bootstrap_relative_gain,
    paired_bootstrap,
    per_problem_scores,
    select_lr,
    true_wse,
)

_parse_seeds = parse_seeds  # the names of the single-module version
_save_job = save_job
_load_job = load_job

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_LRS",
    "HARD_WEIGHTS",
    "LABELS",
    "METHODS",
    "METRICS",
    "PAPER",
    "PASS_K",
    "P_STRATA_EDGES",
    "P_STRATA_LABELS",
    "REPORT_NAME",
    "ComparisonPlan",
    "SettingsMismatch",
    "apply_overrides",
    "arm_diagnostics",
    "bootstrap_relative_gain",
    "controller_data_share",
    "enable_compilation_cache",
    "estimate_only",
    "estimate_wall",
    "eval_steps",
    "evaluate_per_problem",
    "expected_informative",
    "job_name",
    "label",
    "load_config_module",
    "load_job",
    "load_oracle",
    "main",
    "make_figures",
    "measured_informative",
    "method_config",
    "p_stratum",
    "paired_bootstrap",
    "parse_level_weights",
    "parse_seeds",
    "per_problem_scores",
    "plan_jobs",
    "rl_job",
    "rollouts_by_stratum",
    "run_comparison",
    "save_job",
    "select_lr",
    "split_config_arg",
    "split_heldout",
    "true_wse",
    "warm_start_job",
    "write_report",
]
