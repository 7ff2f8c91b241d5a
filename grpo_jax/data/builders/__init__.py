"""TFDS builders for the local math datasets (array_record; no TensorFlow, never downloading).

One `tfds.core.GeneratorBasedBuilder` per dataset, registered as ``grpo_<name>``:
``grpo_gsm8k``, ``grpo_math500``, ``grpo_dapo_math`` (BuilderConfigs ``en_dedup`` and ``full``),
``grpo_aime24``, ``grpo_aime25``, ``grpo_amc23``, ``grpo_minerva_math``, ``grpo_olympiadbench``.
(The ``grpo_`` prefix avoids clashing with TFDS's own catalogue names.)

They read the JSONL files of a local data directory - the constructor's ``source_dir`` or the
download config's ``manual_dir`` - with exactly the conversion and filters of
`grpo_jax.data.datasets`, so both reading paths return identical examples::

    b = GrpoGsm8k(data_dir=cache, source_dir="/path/to/shared/data")   # file_format=array_record
    b.download_and_prepare(download_config=tfds.download.DownloadConfig(manual_dir=...))
    ds = tfds.data_source("grpo_gsm8k", split="test", data_dir=cache, download=False)

Works with tensorflow-datasets 4.9.10 without TensorFlow installed (array_record writer +
`tfds.data_source`); `tfds.load`/`as_dataset` (tf.data) are *not* available without TF.
Note ``dataset_info_from_configs`` cannot be used for builders outside TFDS's own package
layout (it reads package metadata files), so `_info` builds `tfds.core.DatasetInfo` directly.

Stored features per example: ``problem``, ``answer`` (Text), ``answers`` (Sequence of Text),
``level``, ``source_index``, ``position`` (int64; ``position`` = index in the final list, because
TFDS stores records in a hashed order), ``extra_json`` (Text: the remaining fields as JSON).
Bad rows are always skipped at preparation time and recorded in the dataset metadata
(``<split>/num_skipped`` and the first error message); `load_via_tfds` raises that message when
called with ``bad_rows="error"``, like the JSONL path.

`load_via_tfds` prepares into ``<data_dir>/grpo_jax/<fingerprint>/`` where the fingerprint is a
hash of the dataset's source files, so a different or edited source directory never reuses a
stale cache. ``data_dir`` defaults to ``$TFDS_DATA_DIR`` or ``~/tensorflow_datasets``.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import numpy as np
import tensorflow_datasets as tfds

from grpo_jax.data import datasets as _ds

__all__ = ["BUILDERS", "builder_for", "fingerprint", "load_via_tfds"]

_CORE_FIELDS = ("problem", "answer", "answers", "level", "source_index", "id", "dataset")

_FEATURES = dict(
    problem=tfds.features.Text(),
    answer=tfds.features.Text(),
    answers=tfds.features.Sequence(tfds.features.Text()),
    level=np.int64,
    source_index=np.int64,
    position=np.int64,
    extra_json=tfds.features.Text(),
)


class _LocalJsonlBuilder(tfds.core.GeneratorBasedBuilder, skip_registration=True):
    """Base builder: one of `grpo_jax.data.datasets.DATASETS`, read from a local directory."""

    VERSION = tfds.core.Version("1.0.0")
    RELEASE_NOTES = {"1.0.0": "Initial release: local JSONL -> array_record."}
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        "Nothing is downloaded. Pass source_dir=<data dir> to the builder or "
        "DownloadConfig(manual_dir=<data dir>), the directory holding the dataset folder "
        "(e.g. shared/data with gsm8k/, math500/, dapo_math_17k/ ...)."
    )
    DATASET: str = ""

    def __init__(self, *, source_dir: str | os.PathLike | None = None, **kwargs):
        self._source_dir = pathlib.Path(source_dir) if source_dir else None
        kwargs.setdefault("file_format", "array_record")
        super().__init__(**kwargs)

    def _info(self) -> tfds.core.DatasetInfo:
        return tfds.core.DatasetInfo(
            builder=self,
            description=f"{self.DATASET} from a local copy (grpo_jax.data.datasets).",
            features=tfds.features.FeaturesDict(_FEATURES),
            metadata=tfds.core.MetadataDict(),
        )

    def _split_generators(self, dl_manager):
        src = self._source_dir or pathlib.Path(dl_manager.manual_dir)
        spec = _ds.DATASETS[self.DATASET]
        return {split: self._generate_examples(split, src) for split in spec.splits}

    def _generate_examples(self, split: str, src: pathlib.Path):
        config = self.builder_config.name if self.builder_config else None
        rows = list(_ds.read_rows(self.DATASET, split, src))
        errors: list[str] = []
        examples, skipped = _ds.convert_rows(self.DATASET, rows, bad_rows="skip", errors=errors)
        first_error = errors[0] if errors else ""
        examples, counts = _ds.filter_examples(self.DATASET, config, examples)
        self.info.metadata[f"{split}/num_rows"] = len(rows)
        self.info.metadata[f"{split}/num_skipped"] = skipped
        self.info.metadata[f"{split}/first_error"] = first_error
        for key, value in counts.items():
            self.info.metadata[f"{split}/{key}"] = value
        for position, ex in enumerate(examples):
            extra = {k: v for k, v in ex.items() if k not in _CORE_FIELDS}
            yield (
                position,
                {
                    "problem": ex["problem"],
                    "answer": ex["answer"],
                    "answers": ex.get("answers", []),
                    "level": int(ex.get("level", -1)),
                    "source_index": int(ex["source_index"]),
                    "position": position,
                    "extra_json": json.dumps(extra, ensure_ascii=False, sort_keys=True),
                },
            )


def _make(name: str, cls_name: str, configs: tuple[str, ...] = ()):
    attrs = {
        "DATASET": name,
        "__module__": __name__,
        "__doc__": f"TFDS builder for `{name}` read from a local data directory.",
    }
    if configs:
        attrs["BUILDER_CONFIGS"] = [
            tfds.core.BuilderConfig(name=c, description=f"{name} config {c!r}") for c in configs
        ]
        attrs["DEFAULT_BUILDER_CONFIG_NAME"] = _ds.DATASETS[name].default_config
    return type(cls_name, (_LocalJsonlBuilder,), attrs)


GrpoGsm8k = _make("gsm8k", "GrpoGsm8k")
GrpoMath500 = _make("math500", "GrpoMath500")
GrpoDapoMath = _make("dapo_math", "GrpoDapoMath", ("en_dedup", "full"))
GrpoAime24 = _make("aime24", "GrpoAime24")
GrpoAime25 = _make("aime25", "GrpoAime25")
GrpoAmc23 = _make("amc23", "GrpoAmc23")
GrpoMinervaMath = _make("minerva_math", "GrpoMinervaMath")
GrpoOlympiadbench = _make("olympiadbench", "GrpoOlympiadbench")

BUILDERS: dict[str, type[_LocalJsonlBuilder]] = {
    cls.DATASET: cls
    for cls in (
        GrpoGsm8k,
        GrpoMath500,
        GrpoDapoMath,
        GrpoAime24,
        GrpoAime25,
        GrpoAmc23,
        GrpoMinervaMath,
        GrpoOlympiadbench,
    )
}


def fingerprint(name: str, source_dir=None) -> str:
    """sha256 (first 16 hex) over the dataset's source files (all splits) and the builder version."""
    spec = _ds.DATASETS[name]
    h = hashlib.sha256(f"{name}:{_LocalJsonlBuilder.VERSION}".encode())
    for split in sorted(spec.splits):
        for path in _ds.source_files(name, split, source_dir):
            h.update(path.name.encode())
            with open(path, "rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()[:16]


def builder_for(name: str, *, config: str | None = None, source_dir=None, data_dir=None):
    """A prepared-or-preparable builder of dataset `name` under the fingerprinted data dir."""
    if name not in BUILDERS:
        raise ValueError(f"no TFDS builder for {name!r}; builders: {', '.join(BUILDERS)}")
    src = _ds.resolve_source_dir(name, source_dir)
    root = pathlib.Path(
        data_dir or os.environ.get("TFDS_DATA_DIR") or pathlib.Path.home() / "tensorflow_datasets"
    )
    cache = root / "grpo_jax" / fingerprint(name, src)
    kwargs = {"config": config} if config else {}
    return BUILDERS[name](data_dir=str(cache), source_dir=src, **kwargs), cache, src


def load_via_tfds(
    name: str,
    split: str,
    *,
    config: str | None = None,
    source_dir=None,
    data_dir=None,
    bad_rows: str = "error",
) -> tuple[list[dict], dict]:
    """Load a split through its TFDS builder (prepare on first use, then `tfds.data_source`).

    Returns the same ``(examples, stats)`` as `grpo_jax.data.datasets.load_with_stats`.
    """
    if bad_rows not in ("error", "skip"):
        raise ValueError(f"bad_rows must be 'error' or 'skip', got {bad_rows!r}")
    builder, cache, src = builder_for(name, config=config, source_dir=source_dir, data_dir=data_dir)
    if not builder.is_prepared():
        builder.download_and_prepare(
            download_config=tfds.download.DownloadConfig(manual_dir=str(src))
        )
    meta = builder.info.metadata or {}
    if bad_rows == "error" and meta.get(f"{split}/num_skipped", 0):
        raise ValueError(meta[f"{split}/first_error"])
    full_name = builder.info.full_name.rsplit("/", 1)[0]  # "grpo_dapo_math/en_dedup"
    source = tfds.data_source(full_name, split=split, data_dir=str(cache), download=False)
    records = source.__getitems__(list(range(len(source))))
    examples: list[dict | None] = [None] * len(records)
    for rec in records:
        ex = {
            "problem": _str(rec["problem"]),
            "answer": _str(rec["answer"]),
            "level": int(rec["level"]),
            "source_index": int(rec["source_index"]),
        }
        answers = [_str(a) for a in rec["answers"]]
        ex.update(json.loads(_str(rec["extra_json"])))
        if answers:
            ex["answers"] = answers
        examples[int(rec["position"])] = ex
    if any(ex is None for ex in examples):
        raise RuntimeError(f"TFDS cache {cache} is inconsistent (missing positions); delete it")
    _ds.finalize(name, examples)
    stats = {
        "num_rows": int(meta.get(f"{split}/num_rows", len(examples))),
        "num_skipped": int(meta.get(f"{split}/num_skipped", 0)),
        "num_dropped_cjk": int(meta.get(f"{split}/num_dropped_cjk", 0)),
        "num_dropped_duplicates": int(meta.get(f"{split}/num_dropped_duplicates", 0)),
        "num_examples": len(examples),
    }
    return examples, stats


def _str(x) -> str:
    return x.decode("utf-8") if isinstance(x, (bytes, np.bytes_)) else str(x)
