"""Built-in tool environments: a calculator (integer arithmetic, for the character-level
arithmetic task) and model-written Python in the sandbox (`grpo_jax.tools.sandbox`)."""

from __future__ import annotations

import ast
import operator
import re

from grpo_jax.envs.base import Environment, EnvStep, register_environment
from grpo_jax.tools.sandbox import SandboxLimits, run_python

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def _evaluate(node) -> int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand)
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        a, b = _evaluate(node.left), _evaluate(node.right)
        if max(abs(a), abs(b)) > 10**18:
            raise ValueError("number too large")
        return _OPS[type(node.op)](a, b)
    raise ValueError("not integer arithmetic")


def calculate(expression: str) -> str:
    """``+ - *`` on integers (Python's precedence), as text; ``"error"`` for anything else."""
    try:
        return str(_evaluate(ast.parse(expression.strip(), mode="eval")))
    except (SyntaxError, ValueError, RecursionError):
        return "error"


@register_environment("calculator")
class Calculator(Environment):
    """A policy turn that ends with ``)`` calls the calculator on the text after its last
    ``(``; the observation is ``=<value>``, then the policy writes its answer (the turn scored).
    E.g. ``(123+456)`` -> ``=579``, then ``579<eos>``."""

    stop_strings = (")",)

    def __init__(self, max_turns: int = 2):
        self.max_turns = int(max_turns)

    def step(self, state, turn_text: str) -> EnvStep:
        call = turn_text.rsplit("(", 1)[-1].rstrip(")")
        return EnvStep(observation="=" + calculate(call), done=False)

    def demonstration(self, example: dict) -> list[tuple[str, bool]]:
        """``(problem)`` trained, ``=value`` not, then the answer trained."""
        problem = str(example["problem"])
        return [
            (f"({problem})", True),
            ("=" + calculate(problem), False),
            (str(example["answer"]), True),
        ]


@register_environment("python")
class Python(Environment):
    """Tool-integrated reasoning: a policy turn that ends with the stop string runs the code
    between the last ``code_open`` marker and the stop in the sandbox (a fresh limited
    interpreter per call: `grpo_jax.tools.sandbox`); the observation is its output (or its
    error line), wrapped in ``output_open`` / ``output_close``."""

    def __init__(
        self,
        max_turns: int = 4,
        stop: str = "```\n",
        code_open: str = "```python\n",
        output_open: str = "```output\n",
        output_close: str = "```\n",
        cpu_seconds: float = 5.0,
        wall_seconds: float = 10.0,
    ):
        self.max_turns = int(max_turns)
        self.stop_strings = (stop,)
        self.code_open, self.stop = code_open, stop
        self.output_open, self.output_close = output_open, output_close
        self.limits = SandboxLimits(cpu_seconds=cpu_seconds, wall_seconds=wall_seconds)

    def step(self, state, turn_text: str) -> EnvStep:
        if self.code_open not in turn_text:
            return EnvStep(observation="", done=False)
        code = turn_text.rsplit(self.code_open, 1)[-1]
        code = re.sub(re.escape(self.stop) + r"\s*$", "", code)
        out = run_python(code, self.limits).observation()
        return EnvStep(observation=self.output_open + out + self.output_close, done=False)
