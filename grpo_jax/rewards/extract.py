"""Final-answer extraction from model completions and reference solutions (pure, in-process).

Formats recognised, in the order tried per task (`extract_answer`):

* ``math``:  last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces, may span lines)
             → last ``Answer: ...`` line → last ``#### ...``.
* ``gsm8k``: last ``#### ...`` (GSM8K reference format) → last ``\\boxed{}`` → ``Answer:`` line
             → the last number in the text (lm-eval-harness "flexible extract"); the result is
             reduced to its last number, commas removed (``"$1,000."`` → ``"1000"``)
             unless it contains LaTeX (a backslash), which is passed on as it is.

An answer is only taken from the *last* occurrence: with two boxed answers the last one counts.
The "format" of a completion is OK when the answer came from the task's primary marker
(``\\boxed`` for math; ``####`` or ``\\boxed`` for gsm8k).
"""

from __future__ import annotations

import re

__all__ = [
    "answer_line",
    "extract_answer",
    "gsm8k_marker",
    "last_boxed",
    "last_number",
    "normalize_number",
]

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\b")
_ANSWER_LINE_RE = re.compile(
    r"^[ \t>*#_]*(?:final\s+answer|answer)[ \t*_]*[:：][ \t*_]*(.*)$", re.IGNORECASE | re.MULTILINE
)
_GSM8K_RE = re.compile(r"####[ \t]*(.*)")
_NUMBER_RE = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?|-?\d+(?:\.\d+)?|-?\.\d+")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``) in `text`, braces balanced.

    ``\\boxed{\\frac{a}{b}}`` gives ``\\frac{a}{b}`` (the whole nested argument); the brace-less
    form ``\\boxed 5`` gives ``5``. A last box that is never closed (a truncated completion) gives
    None rather than falling back to an earlier box. Returns None when there is no box or the
    box is empty.
    """
    matches = list(_BOXED_RE.finditer(text))
    if not matches:
        return None
    start = matches[-1].end()
    i = start
    while i < len(text) and text[i] in " \t":
        i += 1
    if i < len(text) and text[i] == "{":
        depth = 0
        j = i
        while j < len(text):
            c = text[j]
            if c == "\\":  # skip escaped characters such as \{ \}
                j += 2
                continue
            if c == "{":
                depth += 1
            elif c == "}":
                depth -= 1
                if depth == 0:
                    content = text[i + 1 : j].strip()
                    return content or None
            j += 1
        return None  # unbalanced
    m = re.match(r"[^\s$]+", text[i:])  # "\boxed 5"
    if m and i > start:
        return m.group(0).rstrip(".") or None
    return None


def _strip_math_delims(s: str) -> str:
    s = s.strip().rstrip(".").strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if len(s) >= len(left) + len(right) and s.startswith(left) and s.endswith(right):
            s = s[len(left) : len(s) - len(right)].strip()
            break
    return s.rstrip(".").strip()


def answer_line(text: str) -> str | None:
    """Content of the last ``Answer: ...`` (or ``Final answer: ...``) line.

    If the marker ends its line, the next non-empty line is taken. Surrounding ``$`` / ``\\( \\)``
    delimiters and a trailing period are removed. None if absent or empty.
    """
    matches = list(_ANSWER_LINE_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    content = m.group(1).strip()
    if not content:
        rest = text[m.end() :].lstrip("\n")
        for line in rest.splitlines():
            if line.strip():
                content = line.strip()
                break
    content = _strip_math_delims(content) if content else ""
    return content or None


def gsm8k_marker(text: str) -> str | None:
    """Text after the last ``####`` (GSM8K's reference format) on its line; None if absent."""
    matches = list(_GSM8K_RE.finditer(text))
    if not matches:
        return None
    content = _strip_math_delims(matches[-1].group(1))
    return content or None


def normalize_number(s: str) -> str:
    """Drop thousands separators, a leading ``+`` and trailing zeros of a decimal number string."""
    s = s.replace(",", "").lstrip("+")
    if "." in s:
        s = s.rstrip("0").rstrip(".")
    if s in ("", "-"):
        s = "0"
    return s


def last_number(text: str) -> str | None:
    """The last number in `text` (``1,000`` read as one number), normalised; None if none."""
    nums = _NUMBER_RE.findall(text)
    return normalize_number(nums[-1]) if nums else None


def extract_answer(text: str, task: str = "math") -> tuple[str | None, str]:
    """Extract the final answer of a completion.

    Args:
      text: completion (or reference solution) text.
      task: ``"math"`` or ``"gsm8k"`` (see module docstring for the order of formats tried).

    Returns:
      ``(answer, method)``: the answer string (None if nothing was found) and the format that
      produced it: ``"boxed"``, ``"answer_line"``, ``"####"``, ``"last_number"`` or ``"none"``.

    Raises:
      ValueError: unknown task.
    """
    if task == "math":
        order = (("boxed", last_boxed), ("answer_line", answer_line), ("####", gsm8k_marker))
    elif task == "gsm8k":
        order = (
            ("####", gsm8k_marker),
            ("boxed", last_boxed),
            ("answer_line", answer_line),
            ("last_number", last_number),
        )
    else:
        raise ValueError(f"extract_answer: unknown task {task!r} (expected 'math' or 'gsm8k')")
    for method, fn in order:
        ans = fn(text)
        if ans is not None:
            if task == "gsm8k" and "\\" not in ans:  # keep LaTeX (\frac{36}{2}) for math-verify
                num = last_number(ans)
                ans = num if num is not None else ans
            return ans, method
    return None, "none"


PRIMARY_FORMATS = {"math": ("boxed",), "gsm8k": ("####", "boxed")}


def split_top_level(s: str) -> list[str]:
    """Split at commas that are not inside (), [], {} (a multi-answer prediction)."""
    parts, depth, cur = [], 0, []
    i = 0
    while i < len(s):
        c = s[i]
        if c == "\\" and i + 1 < len(s):  # keep \{ \, etc. intact
            cur.append(s[i : i + 2])
            i += 2
            continue
        if c in "([{":
            depth += 1
        elif c in ")]}":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(c)
        i += 1
    parts.append("".join(cur).strip())
    return [p for p in parts if p]


def integer_answer_is_correct(completion: str, gold: str | int) -> bool:
    """Exact integer match of a completion against the gold answer (the arithmetic reward).

    Args:
      completion: decoded completion text up to (not including) EOS. Surrounding whitespace is
        ignored; anything else (a second number, words, ``"19.0"``) makes it wrong.
      gold: the gold integer or its decimal string.

    Returns:
      True iff ``completion.strip()`` is an optionally ``-``-signed decimal integer equal to gold.
    """
    text = completion.strip()
    if not re.fullmatch(r"-?\d{1,30}", text):
        return False
    return int(text) == int(gold)
