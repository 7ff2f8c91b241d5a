"""Renders a run's curves and GDRO heatmaps from its metrics.jsonl.

`python -m experiments.report --workdir=DIR` writes DIR/report/*.png: reward and pass rate,
losses, per-phase time, held-out evaluation, and (Prompt-/Rollout-GDRO runs) step x bin
heatmaps of the data share, Prompt-GDRO weight q and rollouts per prompt n_b. A run without
per-bin metrics (GRPO: every share 0, every bin reward NaN) gets no heatmap file; the command
says so.
"""

import os

import numpy as np
from absl import flags

from grpo_jax import cli


def informative(rows, key) -> bool:
    """Whether ``key``'s per-bin lists hold anything to plot (a finite, non-zero value)."""
    values = [np.asarray(r[key], float).ravel() for r in rows if isinstance(r.get(key), list)]
    return any(bool(np.any(np.isfinite(v) & (v != 0))) for v in values)


def heatmap(ax, rows, key, title):
    steps = [r["step"] for r in rows if isinstance(r.get(key), list)]
    data = [r[key] for r in rows if isinstance(r.get(key), list)]
    if not data:
        return False
    arr = np.asarray(data, float)
    im = ax.imshow(
        arr.T,
        aspect="auto",
        origin="lower",
        interpolation="nearest",
        extent=(steps[0] - 0.5, steps[-1] + 0.5, -0.5, arr.shape[1] - 0.5),
    )
    ax.set_xlabel("step")
    ax.set_ylabel("bin (0 = hardest)")
    ax.set_title(title)
    ax.figure.colorbar(im, ax=ax)
    return True


def render(workdir: str) -> list[str]:
    """Writes the PNGs; returns their paths.

    Raises:
      FileNotFoundError: ``workdir`` or its ``metrics.jsonl`` does not exist.
    """
    path = os.path.join(workdir, "metrics.jsonl")
    if not os.path.isfile(path):
        what = "no such directory" if not os.path.isdir(workdir) else "no metrics.jsonl in it"
        raise FileNotFoundError(f"--workdir={workdir}: {what} (not a training run's workdir)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from grpo_jax import writers

    rows = writers.read_jsonl(path)
    train = [r for r in rows if "reward_mean" in r]
    out_dir = os.path.join(workdir, "report")
    os.makedirs(out_dir, exist_ok=True)
    paths = []

    def save(fig, name):
        path = os.path.join(out_dir, name)
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)
        paths.append(path)

    curves = [
        ("reward_mean", "reward"),
        ("pass_rate", "pass rate"),
        ("loss", "policy loss"),
        ("clip_fraction", "clip fraction"),
        ("completion_length", "completion length"),
        ("grad_norm", "gradient norm"),
    ]
    fig, axes = plt.subplots(2, 3, figsize=(13, 6.5))
    for ax, (key, title) in zip(axes.flat, curves):
        xs = [r["step"] for r in train if key in r]
        ax.plot(xs, [r[key] for r in train if key in r])
        ax.set_title(title)
        ax.set_xlabel("step")
    save(fig, "curves.png")

    phases = sorted({k for r in train for k in r if k.startswith("time/") and k != "time/step"})
    if phases:
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.stackplot(
            [r["step"] for r in train],
            *[[r.get(p, 0) for r in train] for p in phases],
            labels=[p[5:] for p in phases],
        )
        ax.set_xlabel("step")
        ax.set_ylabel("seconds")
        ax.legend(loc="upper right")
        ax.set_title("time per phase")
        save(fig, "time.png")

    evals = [r for r in rows if "eval/mean_at_1" in r]
    if evals:
        fig, ax = plt.subplots(figsize=(7, 4))
        for key in sorted(
            k
            for k in evals[0]
            if k.startswith("eval/") and "/" not in k[5:] and isinstance(evals[0][k], float)
        ):
            ax.plot([r["step"] for r in evals], [r[key] for r in evals], marker="o", label=key[5:])
        ax.set_xlabel("step")
        ax.legend()
        ax.set_title("held-out evaluation")
        save(fig, "eval.png")

    maps = [
        ("gdro/bin_share", "data share per bin"),
        ("gdro/q", "Prompt-GDRO weight q"),
        ("rollout_gdro/n_b", "Rollout-GDRO rollouts per prompt n_b"),
        ("gdro/bin_reward", "mean reward per bin"),
    ]
    present = [(k, t) for k, t in maps if informative(train, k)]
    if present:
        fig, axes = plt.subplots(1, len(present), figsize=(5 * len(present), 4), squeeze=False)
        for ax, (key, title) in zip(axes[0], present):
            heatmap(ax, train, key, title)
        save(fig, "gdro_heatmaps.png")
    return paths


def main(argv):
    del argv
    paths = render(flags.FLAGS["workdir"].value)
    for p in paths:
        print(p)
    if not any(p.endswith("gdro_heatmaps.png") for p in paths):
        print("gdro_heatmaps.png: nothing to plot (no per-bin GDRO metrics in metrics.jsonl)")


def define_flags():
    """The command-line flags (defined only when run as a script: importing this module, e.g.
    from a test beside other experiments modules, must not clash with their flags)."""
    flags.DEFINE_string("workdir", None, "A run's workdir (holds metrics.jsonl).", required=True)


if __name__ == "__main__":
    define_flags()
    cli.run_absl(main)
