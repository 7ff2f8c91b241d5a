"""``python -m experiments.benchmark --hf_checkpoint=DIR --suite=math``: an alias of
`experiments.evaluate` (same flags, same code; see its docstring)."""

from absl import app

from experiments.evaluate import main, parse_flags

if __name__ == "__main__":
    app.run(main, flags_parser=parse_flags)
