"""The command line: the ``grpo-jax <command>`` console script, and the one way every script
in ``experiments/`` reports bad input and keeps library logs quiet.

Bad input (a missing or empty workdir, an unknown flag, a bad value; `BAD_INPUT`) is one
``error: ...`` line on stderr and exit status 2, never a traceback: absl scripts call
`run_absl`, argparse scripts build an `ArgumentParser` and decorate ``main`` with `entry_point`.
Library INFO logs (absl, Orbax, JAX) are off unless ``--verbosity`` is given (argparse
scripts never set up absl's handler: Python's default WARNING level applies).
"""

from __future__ import annotations

import argparse
import functools
import os
import runpy
import sys
from collections.abc import Callable
from typing import Any, NoReturn

from absl import app, flags
from absl import logging as absl_logging

# What a script reports as bad input: one `error:` line and exit 2. `ValueError` covers
# `errors.ConfigError` and `UsageError`; `OSError` a missing, unreadable or unwritable path.
BAD_INPUT = (ValueError, OSError)

_USAGE = """grpo-jax <command> [flags]: the repository's experiments/<command>.py from any directory.

  grpo-jax run --config=configs/arithmetic.py:grpo --workdir=/tmp/w   # = python -m experiments.run
  grpo-jax evaluate --workdir=/tmp/w                                  # = python -m experiments.evaluate

The scripts (experiments/) and configs (configs/) live beside grpo_jax/ in the checkout and are
not installed as top-level packages (names that common would collide with other projects');
this entry point puts the checkout first on sys.path of its own process only. Inside the
checkout `python -m experiments.<command>` is the same thing."""


class UsageError(ValueError):
    """A bad command line: an unknown flag, a malformed value, positional arguments."""


def one_line(e: BaseException | str) -> str:
    """The message of ``e`` on one line; an `OSError` as ``<path>: <reason>`` when it names one."""
    if isinstance(e, OSError) and e.filename and e.strerror:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split()) or type(e).__name__


def fail(e: BaseException | str) -> NoReturn:
    """Prints ``error: <message>`` (one line) on stderr and exits with status 2."""
    sys.stdout.flush()
    print(f"error: {one_line(e)}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def entry_point(main: Callable[..., Any]) -> Callable[..., Any]:
    """Decorates a script's ``main``: `BAD_INPUT` raised in it becomes one ``error:`` line on
    stderr and ``SystemExit(2)`` (no traceback; with ``--verbosity`` given, the traceback);
    anything else (a bug) keeps its traceback."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except BAD_INPUT as e:
            if _verbose():
                raise
            fail(e)

    return wrapper


def _verbose() -> bool:
    """Whether an absl script was given ``--verbosity`` (then bad input keeps its traceback)."""
    return flags.FLAGS.is_parsed() and flags.FLAGS["verbosity"].present


def quiet_library_logs() -> None:
    """Library INFO logs (absl, Orbax, JAX) off unless ``--verbosity`` was given: warnings and
    errors still print. Call after absl has parsed the flags."""
    if not flags.FLAGS["verbosity"].present:
        absl_logging.set_verbosity(absl_logging.WARNING)


def run_absl(
    main: Callable[[list[str]], Any],
    argv: list[str] | None = None,
    flags_parser: Callable[[list[str]], list[str]] | None = None,
) -> None:
    """``absl.app.run(main)`` for a script, with one-line errors and quiet library logs.

    A flag that does not parse (unknown name, bad value; `absl.flags.Error`), a positional
    argument, or `BAD_INPUT` raised by ``main`` or ``flags_parser`` is one ``error: ...`` line
    on stderr and exit 2; library INFO logs are off unless ``--verbosity`` is given.

    Args:
      main: called with ``argv`` (the program name only); its return value is the exit status.
      argv: the command line (default ``sys.argv``).
      flags_parser: parses ``argv`` into the remaining arguments (default ``absl.flags.FLAGS``);
        it may raise `UsageError` with a more helpful message.
    """

    def parse(args):
        try:
            return (flags_parser or flags.FLAGS)(args)
        except (flags.Error, *BAD_INPUT) as e:
            fail(e)

    @entry_point
    def checked_main(args):
        quiet_library_logs()
        if len(args) > 1:
            raise UsageError(f"unexpected arguments: {' '.join(args[1:])}")
        return main(args)

    app.run(checked_main, argv=argv, flags_parser=parse)


def positive_int(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (else argparse's one-line error names the flag)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


class ArgumentParser(argparse.ArgumentParser):
    """`argparse.ArgumentParser` whose errors (unknown flag, bad value) raise `UsageError`: with
    `entry_point` they are one ``error:`` line and exit 2, not usage text."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def checkout_root() -> str:
    """The directory holding ``grpo_jax/``, ``experiments/`` and ``configs/`` (an editable install
    or a checkout on ``sys.path``).

    Raises:
      SystemExit: (code 2) the scripts are not beside the package (a non-editable install).
    """
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if not os.path.isdir(os.path.join(root, "experiments")):
        fail(
            f"grpo-jax: no experiments/ beside {os.path.dirname(os.path.abspath(__file__))}: "
            "install the checkout with `pip install -e .` (the scripts are not packaged)"
        )
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
        print(_USAGE + "\n\ncommands: " + ", ".join(valid))
        return
    if argv[0] not in valid:
        fail(f"grpo-jax: unknown command {argv[0]!r}; choose from {', '.join(valid)}")
    sys.path.insert(0, root)
    sys.argv = [f"grpo-jax {argv[0]}"] + argv[1:]
    runpy.run_module(f"experiments.{argv[0]}", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
