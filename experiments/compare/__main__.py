"""``python -m experiments.compare ...`` (flags: ``--help``; protocol: the package docstring)."""

import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from experiments.compare.cli import main  # jax is imported lazily, after the default

sys.exit(main())
