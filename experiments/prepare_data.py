"""Builds every preset's data files (the layout of `grpo_jax.data.datasets`) in one directory.

  python -m experiments.prepare_data --out=DIR                      # online: the public sources
  python -m experiments.prepare_data --out=DIR --from=/path/to/shared/data   # a local copy
  python -m experiments.prepare_data --out=DIR --dataset=gsm8k,dapo_math

Then point runs at it: ``--config.data.source_dir=DIR`` or ``GRPO_JAX_DATA_DIR=DIR``.

Each file comes from the public repository and commit recorded in the data's SOURCE.txt files
(raw files at a pinned commit; every download is checked against its sha256). DAPO-Math-17k's
``dapo_math_17k.derived.part{1,2}.jsonl`` are derived, as the shared data's SOURCE.txt says,
from the verl-format parquet (MasterVito/SvS ``data/dapo_math_17k.parquet``, 17,917 rows): one
row ``{"problem": prompt[0].content, "answer": reward_model.ground_truth, "index":
extra_info.index}`` per parquet row, in order, no de-duplication, split 8,959 + 8,958; the
English de-duplicated subset (``config="en_dedup"``) is a filter applied at load time, not a
file. With ``--from`` files are copied from the local directory (the parquet, when present,
is re-derived rather than its parts copied) and checked against the same sha256s.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import urllib.request

from absl import flags

from grpo_jax import cli

_GSM8K = "openai/grade-school-math/3101c7d5072418e28b9008a6636bde82a006892c"
_MATH500 = "hkust-nlp/simpleRL-reason/cf1c7858bfc145a27aa733e75d930d34f0d318a6"
_QWEN = "QwenLM/Qwen2.5-Math/a45202bd16f1ec06f433442dc1152d0074773465"
_AREAL = "inclusionAI/AReaL/f55fe685c661b0117d888fcae47d6f46e9a85087"
_SVS = "MasterVito/SvS/9fd8f35375b31b8632b52e715296c264a3ad4176"

# dataset -> [(file under DIR, "repo/commit/path" on GitHub, sha256)]
SOURCES: dict[str, list[tuple[str, str, str]]] = {
    "gsm8k": [
        (
            "gsm8k/train.jsonl",
            f"{_GSM8K}/grade_school_math/data/train.jsonl",
            "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
        ),
        (
            "gsm8k/test.jsonl",
            f"{_GSM8K}/grade_school_math/data/test.jsonl",
            "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
        ),
        ("gsm8k/LICENSE", f"{_GSM8K}/LICENSE", ""),
    ],
    "math500": [
        (
            "math500/test.jsonl",
            f"{_MATH500}/examples/simplelr_math_eval/data/math500/test.jsonl",
            "35dc41080a3680858b27fa7e0533d2d547825316fc5dafe5d316f4ccc5a06132",
        ),
        ("math500/LICENSE", f"{_MATH500}/examples/simplelr_math_eval/LICENSE", ""),
    ],
    "aime24": [
        (
            "aime24/test.jsonl",
            f"{_QWEN}/evaluation/data/aime24/test.jsonl",
            "af2b8bd2aa911b6333ad0df32f3ca05c7ae8ed10f1731f4372c8ae26990bf7ac",
        ),
        ("aime24/LICENSE", f"{_QWEN}/evaluation/LICENSE", ""),
    ],
    "aime25": [
        (
            "aime25/test.jsonl",
            f"{_AREAL}/evaluation/data/aime25/test.jsonl",
            "b4e273c02d3e7fe1b74b59eae768fc8230bfb0f79539890cb56f4361caac0331",
        ),
        ("aime25/LICENSE", f"{_AREAL}/evaluation/LICENSE", ""),
    ],
    "amc23": [
        (
            "amc23/test.jsonl",
            f"{_QWEN}/evaluation/data/amc23/test.jsonl",
            "43707e1ca784602d8479de24ee8ce36609dbebc46dd152b0b12a46611aa898a4",
        ),
        ("amc23/LICENSE", f"{_QWEN}/evaluation/LICENSE", ""),
    ],
    "minerva_math": [
        (
            "minerva_math/test.jsonl",
            f"{_QWEN}/evaluation/data/minerva_math/test.jsonl",
            "0e656b430d3a0a1dab6aa853f453ba3805e28e2cabe4fc72486a897cc09d8ba2",
        ),
        ("minerva_math/LICENSE", f"{_QWEN}/evaluation/LICENSE", ""),
    ],
    "olympiadbench": [
        (
            "olympiadbench/test.jsonl",
            f"{_QWEN}/evaluation/data/olympiadbench/test.jsonl",
            "bb8c1e38a16ea9eacb77530315a674d883f267fbff79183effc53681b4fcc416",
        ),
        ("olympiadbench/LICENSE", f"{_QWEN}/evaluation/LICENSE", ""),
    ],
    "dapo_math": [
        (
            "dapo_math_17k/dapo_math_17k.parquet",
            f"{_SVS}/data/dapo_math_17k.parquet",
            "246ae23df97c9eae8126cb4da780e9a0a31d10110e16eed144bcecbf2132d535",
        ),
        ("dapo_math_17k/LICENSE.SvS-Apache-2.0", f"{_SVS}/LICENSE", ""),
    ],
}
DAPO_PARTS = (
    (
        "dapo_math_17k/dapo_math_17k.derived.part1.jsonl",
        "55c96ebffc7656070231675caf8f19e019bbdbd695f90400d2fef1651466652f",
    ),
    (
        "dapo_math_17k/dapo_math_17k.derived.part2.jsonl",
        "f948a57d917acd726935a27e7e03acfef0992d95c78d5d85eeb452ee2793b359",
    ),
)
DAPO_PART1_ROWS = 8959


def sha256_file(path: str) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB chunks)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _check(path: str, sha: str, origin: str) -> None:
    if sha and sha256_file(path) != sha:
        raise ValueError(f"{origin}: sha256 of {path} is {sha256_file(path)}, expected {sha}")


def _fetch(rel: str, source: str, sha: str, out: str, from_dir: str) -> bool:
    """One file into ``out/rel``; False when a local copy lacks an optional (license) file."""
    dest = os.path.join(out, rel)
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    if from_dir:
        src = os.path.join(from_dir, rel)
        if not os.path.isfile(src):
            if not sha:  # a license file the local copy names differently
                return False
            raise FileNotFoundError(f"{src} not found (building from --from={from_dir})")
        shutil.copyfile(src, dest)
        origin = src
    else:
        owner, repo, commit, path = source.split("/", 3)
        url = f"https://raw.githubusercontent.com/{owner}/{repo}/{commit}/{path}"
        tmp = dest + ".part"
        with urllib.request.urlopen(url, timeout=120) as r, open(tmp, "wb") as f:
            shutil.copyfileobj(r, f)
        os.replace(tmp, dest)
        origin = url
    _check(dest, sha, origin)
    os.chmod(dest, 0o644)
    return True


def derive_dapo_parts(parquet: str, out: str) -> list[str]:
    """The shared data's DAPO JSONL parts from the verl-format parquet (see module docstring)."""
    import pyarrow.parquet as pq

    rows = pq.read_table(parquet).to_pylist()
    lines = [
        json.dumps(
            {
                "problem": r["prompt"][0]["content"],
                "answer": r["reward_model"]["ground_truth"],
                "index": r["extra_info"]["index"],
            },
            ensure_ascii=False,
        )
        + "\n"
        for r in rows
    ]
    written = []
    for (rel, sha), part in zip(DAPO_PARTS, (lines[:DAPO_PART1_ROWS], lines[DAPO_PART1_ROWS:])):
        dest = os.path.join(out, rel)
        with open(dest, "w", encoding="utf-8", newline="\n") as f:
            f.writelines(part)
        _check(dest, sha, f"derived from {parquet}")
        os.chmod(dest, 0o644)
        written.append(dest)
    return written


def prepare(out: str, names=None, from_dir: str = "") -> dict:
    """Builds the files of ``names`` (default: every preset) under ``out``; returns
    ``{dataset: [files]}``. Raises ValueError on a checksum mismatch, FileNotFoundError on a
    missing local file."""
    names = list(names or SOURCES)
    unknown = [n for n in names if n not in SOURCES]
    if unknown:
        raise ValueError(f"unknown dataset(s) {unknown}; presets: {', '.join(SOURCES)}")
    done = {}
    for name in names:
        files = []
        if name == "dapo_math" and from_dir:
            parquet = os.path.join(from_dir, SOURCES[name][0][0])
            if not os.path.isfile(parquet):  # a copy without the parquet: copy the parts
                for rel, sha in DAPO_PARTS:
                    _fetch(rel, "", sha, out, from_dir)
                    files.append(os.path.join(out, rel))
                _fetch(*SOURCES[name][1], out, from_dir)
                done[name] = files
                continue
        for rel, source, sha in SOURCES[name]:
            if _fetch(rel, source, sha, out, from_dir):
                files.append(os.path.join(out, rel))
        if name == "dapo_math":
            files += derive_dapo_parts(os.path.join(out, SOURCES[name][0][0]), out)
        done[name] = files
        print(f"{name}: {len(files)} file(s) in {out}", flush=True)
    return done


def main(argv):
    del argv
    if not flags.FLAGS["out"].value:
        raise cli.UsageError("pass --out=DIR")
    prepare(flags.FLAGS["out"].value, flags.FLAGS["dataset"].value, flags.FLAGS["from"].value)
    print(
        f"done: --config.data.source_dir={flags.FLAGS['out'].value} (or GRPO_JAX_DATA_DIR={flags.FLAGS['out'].value})"
    )


def define_flags():
    """The command-line flags (defined only when run as a script: importing this module, e.g.
    from a test beside other experiments modules, must not clash with their flags)."""
    flags.DEFINE_string("out", None, "Directory to write (created).")
    flags.DEFINE_string("from", "", "A local copy to build from (default: download).")
    flags.DEFINE_list("dataset", list(SOURCES), "Presets to build (default: all).")


if __name__ == "__main__":
    define_flags()
    cli.run_absl(main)
