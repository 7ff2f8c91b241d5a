"""``grpo-jax <command> [flags]``: the repository's ``experiments/<command>.py`` from any directory.

  grpo-jax run --config=configs/arithmetic.py:grpo --workdir=/tmp/w   # = python -m experiments.run
  grpo-jax evaluate --workdir=/tmp/w                                  # = python -m experiments.evaluate

The scripts (``experiments/``) and configs (``configs/``) live beside ``grpo_jax/`` in the
checkout and are *not* installed as top-level packages (names that common would collide with
other projects'); this entry point puts the checkout first on ``sys.path`` of its own process
only. Inside the checkout ``python -m experiments.<command>`` is the same thing.
"""

from __future__ import annotations

import os
import runpy
import sys


def checkout_root() -> str:
    """The directory holding ``grpo_jax/``, ``experiments/`` and ``configs/`` (an editable install
    or a checkout on ``sys.path``).

    Raises:
      SystemExit: (code 2) the scripts are not beside the package (a non-editable install).
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(root, "experiments")):
        print(
            f"grpo-jax: no experiments/ beside {os.path.dirname(os.path.abspath(__file__))}: "
            "install the checkout with `pip install -e .` (the scripts are not packaged)",
            file=sys.stderr,
        )
        raise SystemExit(2)
    return root


def commands(root: str) -> list[str]:
    """The experiment scripts: `experiments/<name>.py` modules and `experiments/<name>/`
    packages with a `__main__.py`, names starting with `_` excluded."""
    folder = os.path.join(root, "experiments")
    names = []
    for f in os.listdir(folder):
        if f.startswith("_"):
            continue
        if f.endswith(".py"):
            names.append(f[:-3])
        elif os.path.isfile(os.path.join(folder, f, "__main__.py")):
            names.append(f)
    return sorted(names)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    root = checkout_root()
    valid = commands(root)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\ncommands: " + ", ".join(valid))
        return
    if argv[0] not in valid:
        print(
            f"grpo-jax: unknown command {argv[0]!r}; choose from {', '.join(valid)}",
            file=sys.stderr,
        )
        raise SystemExit(2)
    sys.path.insert(0, root)
    sys.argv = [f"grpo-jax {argv[0]}"] + argv[1:]
    runpy.run_module(f"experiments.{argv[0]}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
