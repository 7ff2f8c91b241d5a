"""Synthetic arithmetic task with five difficulty levels.

The task exists so that the whole GRPO / GDRO stack can be trained and tested end to end on a CPU
with a tiny character-level transformer (2 layers, width 64-128, vocabulary of 51 symbols:
`grpo_jax.models.tokenizer.CharTokenizer`).

Prompt / completion format (keep it exactly; `format_prompt` and `sft_examples` produce it)::

    prompt      "12+7="          (problem + "=")
    completion  "19" <eos>       (the exact integer answer, then the EOS token)

Levels (each is a different *kind* of problem, not only bigger numbers; see `LEVELS`):

====== =============================================== ================ =========== ==========
level  problem                                          example          max prompt  answers
====== =============================================== ================ =========== ==========
1      a+b, a in 0..99, b in 0..9                       ``23+4=``        6 chars     0..108
2      a+b, a, b in 10..99 (two-digit add, carries)     ``47+38=``       6 chars     20..198
3      a+b-c, a, b, c in 10..99                         ``45+67-89=``    9 chars     -79..188
4      a*b, a in 2..99, b in 2..9                       ``37*6=``        5 chars     4..891
5      three operations on 2-digit operands, exactly    ``12+34*5-67=``  11 chars    -980..1089
       one ``*``, whose right operand has one digit
====== =============================================== ================ =========== ==========

Ladder (``generator="ladder"``, the "frontier" testbed of configs/arithmetic.py): a fine-grained
difficulty ``d = 1..LADDER_MAX`` (9), ``d + 1`` digits in all over two addends: the first has
``ceil((d+1)/2)`` digits, the second ``floor((d+1)/2)`` (a k-digit operand is uniform in
``[10^(k-1), 10^k - 1]``, ``[0, 9]`` for k = 1), their order swapped with probability 1/2.
``d=1`` ``3+5``; ``d=2`` ``47+6``; ``d=3`` ``47+38``; ``d=4`` ``472+38``; ... ``d=9``
``47213+38571`` (12-character prompt, answers up to 6 digits). Difficulty grows with the length
of the carry chains the model must resolve while writing the answer most significant digit first.

Answers are exact Python integers (usual precedence: ``*`` before ``+``/``-``, left to right),
written in decimal with a leading ``-`` when negative (at most 5 characters).

Train / eval split: eval problems are drawn first (i.i.d. from each level's distribution); train
problems are drawn from the same distribution *excluding* every eval problem string, so eval is
disjoint from train as a set of problems. With ``num_sft > 0`` a third pool, the supervised
warm-start (SFT) pool, is drawn last (its own mix ``sft_levels`` / ``sft_level_weights``),
excluding every eval *and* train problem: the RL pool is never seen in SFT
(``ArithmeticConfig.train_pool="sft"`` makes `make_arithmetic` return it in place of train). Levels 2-5 have thousands of distinct problems, so
duplicates are rare; level 1 has 1,000 distinct problems and level 4 has 784, so with large
`num_train` examples of those levels repeat (each still gets its own id).

Example dicts follow the project-wide schema::

    {"id": int, "problem": str, "answer": str, "level": int, "dataset": "arithmetic"}

with ``id`` equal to the example's index in the returned list (what `PromptSource` and the GDRO
classifier key on). Train and eval are separate lists, each with ids ``0..len-1``.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from grpo_jax.rewards.extract import integer_answer_is_correct as answer_is_correct

__all__ = [
    "ArithmeticConfig",
    "LADDER_MAX",
    "LEVELS",
    "answer_is_correct",
    "answer_reward",
    "evaluate_expression",
    "format_prompt",
    "ladder_problem",
    "level_counts",
    "make_splits",
    "mix_mean",
    "make_arithmetic",
    "sft_examples",
]

DATASET_NAME = "arithmetic"


# --------------------------------------------------------------------------------------------
# Problem generators. Each takes a numpy Generator and returns the problem string (no "=").
# --------------------------------------------------------------------------------------------
def _level1(rng: np.random.Generator) -> str:
    return f"{int(rng.integers(0, 100))}+{int(rng.integers(0, 10))}"


def _level2(rng: np.random.Generator) -> str:
    return f"{int(rng.integers(10, 100))}+{int(rng.integers(10, 100))}"


def _level3(rng: np.random.Generator) -> str:
    a, b, c = (int(x) for x in rng.integers(10, 100, size=3))
    return f"{a}+{b}-{c}"


def _level4(rng: np.random.Generator) -> str:
    return f"{int(rng.integers(2, 100))}*{int(rng.integers(2, 10))}"


def _level5(rng: np.random.Generator) -> str:
    # Four operands a o1 b o2 c o3 d; exactly one of o1..o3 is "*", whose right operand has one
    # digit (keeps answers <= 4 digits); the other two operators are "+" or "-".
    mul_pos = int(rng.integers(0, 3))
    ops = ["*" if i == mul_pos else ("+" if rng.integers(0, 2) == 0 else "-") for i in range(3)]
    operands = [int(rng.integers(10, 100))]
    for op in ops:
        operands.append(int(rng.integers(2, 10)) if op == "*" else int(rng.integers(10, 100)))
    text = str(operands[0])
    for op, x in zip(ops, operands[1:]):
        text += f"{op}{x}"
    return text


LEVELS: dict[int, Callable[[np.random.Generator], str]] = {
    1: _level1,
    2: _level2,
    3: _level3,
    4: _level4,
    5: _level5,
}

LADDER_MAX = 9  # hardest ladder difficulty: 5-digit + 5-digit


def _operand(rng: np.random.Generator, digits: int) -> int:
    lo = 0 if digits == 1 else 10 ** (digits - 1)
    return int(rng.integers(lo, 10**digits))


def ladder_problem(d: int, rng: np.random.Generator) -> str:
    """A ladder problem of difficulty ``d`` in ``1..LADDER_MAX``: two addends with ``d + 1``
    digits in all (``ceil((d+1)/2)`` and ``floor((d+1)/2)``), in random order (no ``=``)."""
    if not 1 <= d <= LADDER_MAX:
        raise ValueError(f"ladder difficulty must be in 1..{LADDER_MAX}, got {d}")
    hi, lo = (d + 2) // 2, (d + 1) // 2
    a, b = _operand(rng, hi), _operand(rng, lo)
    if rng.integers(0, 2):
        a, b = b, a
    return f"{a}+{b}"


GENERATORS = ("levels", "ladder")


def _generator(kind: str, level: int) -> Callable[[np.random.Generator], str]:
    if kind == "ladder":
        return lambda rng: ladder_problem(level, rng)
    return LEVELS[level]


_EXPR_RE = re.compile(r"^\d+(?:[+\-*]\d+)*$")
_TOKEN_RE = re.compile(r"\d+|[+\-*]")


def evaluate_expression(problem: str) -> int:
    """Exact integer value of an arithmetic problem string such as ``"12+34*5-67"``.

    Args:
      problem: non-negative integer literals joined by ``+``, ``-``, ``*`` (no spaces, no
        parentheses, no unary minus). ``*`` binds tighter; ``+``/``-`` are left-associative.

    Returns:
      The value as a Python int (arbitrary precision, no floating point).

    Raises:
      ValueError: if `problem` is not of that form.
    """
    if not isinstance(problem, str) or not _EXPR_RE.match(problem):
        raise ValueError(f"not an arithmetic problem of the form 'a+b*c-d': {problem!r}")
    tokens = _TOKEN_RE.findall(problem)
    total, sign = 0, 1
    term = int(tokens[0])
    for op, num in zip(tokens[1::2], tokens[2::2]):
        if op == "*":
            term *= int(num)
        else:
            total += sign * term
            sign = 1 if op == "+" else -1
            term = int(num)
    return total + sign * term


def format_prompt(problem: str) -> str:
    """The prompt string the model sees for an arithmetic problem: ``problem + "="``."""
    return problem + "="


def answer_reward(
    completions: Sequence[str], golds: Sequence[str | int], *, scale: str = "pm1"
) -> np.ndarray:
    """Arithmetic reward per completion: float32 [R], +1/-1 (``scale="pm1"``) or 1/0 (``"01"``).

    Same scoring as ``RewardFn(RewardConfig(task="arithmetic"))`` (which also returns stats).
    """
    if len(completions) != len(golds):
        raise ValueError(f"{len(completions)} completions but {len(golds)} golds")
    if scale not in ("pm1", "01"):
        raise ValueError(f"scale must be 'pm1' or '01', got {scale!r}")
    ok = np.array([answer_is_correct(c, g) for c, g in zip(completions, golds)], dtype=bool)
    return np.where(ok, 1.0, -1.0 if scale == "pm1" else 0.0).astype(np.float32)


# --------------------------------------------------------------------------------------------
# Config and generation.
# --------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class ArithmeticConfig:
    """Configuration of the synthetic arithmetic task.

    Attributes:
      num_train: number of training examples.
      num_eval: number of evaluation examples (disjoint problems from train).
      levels: which difficulty levels (subset of 1..5) to include.
      level_weights: relative frequency of each entry of `levels` in the *train* split (need not
        sum to 1). None = uniform, unless `heavy_tailed` is set.
      heavy_tailed: if True (and `level_weights` is None) the train mix is the power law
        ``w_k ∝ rank_k ** -heavy_tail_exponent`` over `levels` in the given order (rank 1, 2, ...):
        with five levels and exponent 2 the shares are 68/17/8/4/3 % - mostly easy problems with a
        thin tail of hard ones, the setting where GDRO's re-weighting matters.
      heavy_tail_exponent: exponent of the power law above.
      eval_uniform: if True the eval split has equal counts per level (so per-level accuracy is
        measurable); if False it follows the train mix.
      seed: generation seed (the same config always produces the same examples).
      generator: ``"levels"`` (the five problem kinds of `LEVELS`) or ``"ladder"``
        (`ladder_problem`; `levels` are then ladder difficulties in ``1..LADDER_MAX``).
      num_sft: size of the separate supervised warm-start pool (0 = none: SFT, if any, uses the
        train pool). Its problems are disjoint from train and eval.
      sft_levels: levels of the SFT pool (None = `levels`).
      sft_level_weights: relative frequency of each of `sft_levels` (None = the train mix when
        `sft_levels` is None, else uniform).
      train_pool: which pool `make_arithmetic` returns first: ``"rl"`` (the train pool) or
        ``"sft"`` (the SFT pool; build a warm-start experiment with it, then RL with ``"rl"``).
    """

    num_train: int = 2000
    num_eval: int = 200
    levels: tuple[int, ...] = (1, 2, 3, 4, 5)
    level_weights: tuple[float, ...] | None = None
    heavy_tailed: bool = False
    heavy_tail_exponent: float = 2.0
    eval_uniform: bool = True
    seed: int = 0
    generator: str = "levels"
    num_sft: int = 0
    sft_levels: tuple[int, ...] | None = None
    sft_level_weights: tuple[float, ...] | None = None
    train_pool: str = "rl"

    def __post_init__(self):
        # Accept lists (e.g. from a ConfigDict.to_dict()) and keep the dataclass hashable.
        for name, kind in (
            ("levels", int),
            ("level_weights", float),
            ("sft_levels", int),
            ("sft_level_weights", float),
        ):
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, tuple(kind(v) for v in value))
        if self.generator not in GENERATORS:
            raise ValueError(f"generator must be one of {GENERATORS}, got {self.generator!r}")
        if self.train_pool not in ("rl", "sft"):
            raise ValueError(f"train_pool must be 'rl' or 'sft', got {self.train_pool!r}")
        if self.num_sft < 0:
            raise ValueError(f"num_sft must be >= 0, got {self.num_sft}")
        if self.train_pool == "sft" and self.num_sft == 0:
            raise ValueError("train_pool='sft' needs num_sft > 0")
        self._check_levels()

    def _check_levels(self) -> None:
        known = range(1, LADDER_MAX + 1) if self.generator == "ladder" else LEVELS
        for name in ("levels", "sft_levels"):
            lvs = getattr(self, name) or ()
            unknown = [lv for lv in lvs if lv not in known]
            if unknown:
                raise ValueError(
                    f"{name}: unknown level(s) {unknown} for generator {self.generator!r}; "
                    f"known: {sorted(known)}"
                )
        if self.sft_level_weights is not None and len(self.sft_level_weights) != len(
            self.sft_levels or self.levels
        ):
            raise ValueError("sft_level_weights needs one entry per SFT level")
        if self.num_train < 0 or self.num_eval < 0:
            raise ValueError(
                f"num_train/num_eval must be >= 0, got {self.num_train}, {self.num_eval}"
            )
        if not self.levels:
            raise ValueError("levels must not be empty")
        if len(set(self.levels)) != len(self.levels):
            raise ValueError(f"levels: duplicates in {self.levels}")
        if self.level_weights is not None:
            if len(self.level_weights) != len(self.levels):
                raise ValueError(
                    f"level_weights has {len(self.level_weights)} entries, levels has {len(self.levels)}"
                )
            if any(w < 0 for w in self.level_weights) or sum(self.level_weights) <= 0:
                raise ValueError(
                    f"level_weights must be >= 0 with a positive sum: {self.level_weights}"
                )

    def train_weights(self) -> np.ndarray:
        """Normalised train mix over `levels`, float64 [len(levels)]."""
        if self.level_weights is not None:
            w = np.asarray(self.level_weights, dtype=np.float64)
        elif self.heavy_tailed:
            w = np.arange(1, len(self.levels) + 1, dtype=np.float64) ** (-self.heavy_tail_exponent)
        else:
            w = np.ones(len(self.levels))
        return w / w.sum()

    def sft_mix(self) -> tuple[tuple[int, ...], np.ndarray]:
        """(levels, normalised weights float64) of the SFT pool."""
        if self.sft_levels is None:
            lv = self.levels
            w = self.train_weights() if self.sft_level_weights is None else self.sft_level_weights
        else:
            lv = self.sft_levels
            w = np.ones(len(lv)) if self.sft_level_weights is None else self.sft_level_weights
        w = np.asarray(w, np.float64)
        return lv, w / w.sum()


def level_counts(total: int, weights: Sequence[float]) -> list[int]:
    """Split `total` into integer counts proportional to `weights` (largest remainder method).

    Deterministic (ties go to the earlier entry) and exact: the counts sum to `total`.
    """
    w = np.asarray(weights, dtype=np.float64)
    w = w / w.sum()
    raw = w * total
    counts = np.floor(raw).astype(np.int64)
    rest = total - int(counts.sum())
    order = np.argsort(-(raw - counts), kind="stable")
    counts[order[:rest]] += 1
    return [int(c) for c in counts]


def _draw(
    level: int, n: int, rng: np.random.Generator, exclude: set[str], kind: str = "levels"
) -> list[str]:
    gen = _generator(kind, level)
    out: list[str] = []
    attempts = 0
    while len(out) < n:
        p = gen(rng)
        attempts += 1
        if p in exclude:
            if attempts > 1000 * (n + 10):
                raise RuntimeError(f"level {level}: cannot draw problems outside the eval set")
            continue
        out.append(p)
    return out


def make_splits(config: ArithmeticConfig = ArithmeticConfig()) -> dict[str, list[dict]]:
    """Generate every pool of the arithmetic task.

    Args:
      config: `ArithmeticConfig`.

    Returns:
      ``{"train": [...], "sft": [...], "eval": [...]}``: lists of example dicts ``{"id",
      "problem", "answer", "level", "dataset"}``; ``id`` is the index within its own list;
      ``answer`` is the exact integer answer as a decimal string; levels are shuffled together
      (seeded). No eval problem string occurs in train or sft, and no train problem in sft
      ("sft" is empty when ``num_sft = 0``). Adding an SFT pool leaves train and eval unchanged.
    """
    rng = np.random.default_rng([config.seed, 0xA417])
    kind = config.generator
    train_w = config.train_weights()
    eval_w = np.ones(len(config.levels)) if config.eval_uniform else train_w
    n_eval = level_counts(config.num_eval, eval_w)
    n_train = level_counts(config.num_train, train_w)

    eval_rows: list[tuple[str, int]] = []
    train_rows: list[tuple[str, int]] = []
    for level, ne, nt in zip(config.levels, n_eval, n_train):
        lv_rng = np.random.default_rng([config.seed, 0xA417, level])
        ev = _draw(level, ne, lv_rng, exclude=set(), kind=kind)
        tr = _draw(level, nt, lv_rng, exclude=set(ev), kind=kind)
        eval_rows += [(p, level) for p in ev]
        train_rows += [(p, level) for p in tr]

    sft_rows: list[tuple[str, int]] = []
    if config.num_sft:
        seen = {p for p, _ in eval_rows} | {p for p, _ in train_rows}
        sft_lv, sft_w = config.sft_mix()
        for level, ns in zip(sft_lv, level_counts(config.num_sft, sft_w)):
            lv_rng = np.random.default_rng([config.seed, 0x5F7, level])
            sft_rows += [(p, level) for p in _draw(level, ns, lv_rng, exclude=seen, kind=kind)]

    def finish(rows: list[tuple[str, int]], r: np.random.Generator) -> list[dict]:
        order = r.permutation(len(rows))
        return [
            {
                "id": i,
                "problem": rows[j][0],
                "answer": str(evaluate_expression(rows[j][0])),
                "level": rows[j][1],
                "dataset": DATASET_NAME,
            }
            for i, j in enumerate(order)
        ]

    train, evals = finish(train_rows, rng), finish(eval_rows, rng)
    sft = finish(sft_rows, np.random.default_rng([config.seed, 0x5F7]))
    return {"train": train, "sft": sft, "eval": evals}


def make_arithmetic(config: ArithmeticConfig = ArithmeticConfig()) -> tuple[list[dict], list[dict]]:
    """``(train, eval)`` of `make_splits`; ``train`` is the SFT pool when
    ``config.train_pool == "sft"`` (so a warm-start experiment trains on it)."""
    splits = make_splits(config)
    return splits["sft" if config.train_pool == "sft" else "train"], splits["eval"]


def mix_mean(per_level: Mapping, weights: Mapping) -> float:
    """Mean of a per-level metric under another level mix: ``sum_l w_l x_l / sum_l w_l``.

    Args:
      per_level: level -> value (float), or -> dict with ``"mean_at_1"`` (the ``per_level``
        entry of `grpo_jax.evaluation.evaluate_policy`); keys may be int or str.
      weights: level -> weight >= 0 (e.g. `ArithmeticConfig.train_weights` by level); levels
        missing from `weights` count 0.
    """
    w = {int(k): float(v) for k, v in weights.items()}
    num = den = 0.0
    for k, x in per_level.items():
        x = x["mean_at_1"] if isinstance(x, Mapping) else x
        num += w.get(int(k), 0.0) * float(x)
        den += w.get(int(k), 0.0)
    if den <= 0:
        raise ValueError("mix_mean: the weights of the given levels sum to 0")
    return num / den


def sft_examples(examples: Sequence[dict]) -> list[tuple[str, str]]:
    """(prompt, completion) string pairs for supervised warm-up: ``("12+7=", "19")``.

    The trainer appends EOS after the completion tokens.
    """
    return [(format_prompt(ex["problem"]), str(ex["answer"])) for ex in examples]
