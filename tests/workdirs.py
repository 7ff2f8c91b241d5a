"""Every file of two run workdirs compared, for the resume tests: an interrupted and resumed run
must leave what the uninterrupted run leaves.

Only timing is exempt, and each exemption is named here:

- ``metrics.jsonl`` keys starting with `TIMING_PREFIXES` (``time/``, ``tokens_per_s/``,
  ``reward/seconds``), and TensorBoard scalars of those tags;
- ``summary.json``'s ``wall_seconds`` and ``sft.sft_seconds`` (the checkpoints' ``meta`` has
  the same ``sft.sft_seconds``, and ``wall_seconds``, the run's seconds so far);
- Orbax's ``_CHECKPOINT_METADATA`` ``init_timestamp_nsecs`` / ``commit_timestamp_nsecs``;
- TensorBoard events' ``wall_time`` and the event files' names (a creation time and host).

Two things are compared by meaning rather than by bytes: the checkpoint arrays (OCDBT stores
them under random file names, so the state is restored and compared leaf by leaf), and the
``commit_success.txt`` markers (they name the workdir's own path). A checkpoint that a signal
interrupted during its step's evaluation carries that step's metrics row (``pending_eval_row``,
redone on resume); it must agree with the uninterrupted run's row of that step. Every other
file, including any new one, must be byte-identical.
"""

import json
import os
import re
import struct
import warnings

import numpy as np

TIMING_PREFIXES = ("time/", "tokens_per_s/", "reward/seconds")
_SUMMARY_TIMING = (("wall_seconds",), ("sft", "sft_seconds"))
_ORBAX_TIMING = ("init_timestamp_nsecs", "commit_timestamp_nsecs")
_PENDING = "pending_eval_row"
# OCDBT's data files and manifests: names and bytes are storage layout (random file names)
_STORAGE = re.compile(r"^checkpoints/\d+/state/(ocdbt\.process_\d+/)?(manifest\.ocdbt|d/.*)$")
_STORAGE_DIR = re.compile(r"/d/[^/]+$")


def _files(workdir) -> set[str]:
    out = set()
    for root, _, names in os.walk(workdir):
        for name in names:
            rel = os.path.relpath(os.path.join(root, name), workdir)
            if _STORAGE.match(rel):
                rel = _STORAGE_DIR.sub("/d/*", rel)
            elif rel.startswith("tensorboard/events.out.tfevents."):
                rel = "tensorboard/events.out.tfevents.*"  # one file per (resumed) process
            out.add(rel)
    return out


def _drop(tree: dict, *paths: tuple) -> dict:
    tree = json.loads(json.dumps(tree))  # a copy
    for path in paths:
        node = tree
        for key in path[:-1]:
            node = node.get(key, {})
        node.pop(path[-1], None)
    return tree


def untimed(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(TIMING_PREFIXES)}


def _jsonl(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def tensorboard_events(directory) -> list[tuple]:
    """(step, tag, value) of every summary value TensorBoard would show for ``directory``:
    the event files read in order, a ``SessionLog.START`` at step s hiding every earlier event
    of step >= s (how TensorBoard purges what a restarted run rewrites); timing tags dropped."""
    from tensorboardX.proto import event_pb2

    events: list[tuple] = []
    for name in sorted(os.listdir(directory)):
        with open(os.path.join(directory, name), "rb") as f:
            data = f.read()
        at = 0
        while at < len(data):  # TFRecord: u64 length, u32 crc, payload, u32 crc
            (n,) = struct.unpack("<Q", data[at : at + 8])
            event = event_pb2.Event.FromString(data[at + 12 : at + 12 + n])
            at += 12 + n + 4
            if event.session_log.status == event_pb2.SessionLog.START:
                events = [e for e in events if e[0] < event.step]
            for v in event.summary.value:
                tag = v.tag
                if not tag.startswith(TIMING_PREFIXES):
                    events.append((event.step, tag, v.SerializeToString()))
    return events


def _state(step_dir):
    import orbax.checkpoint as ocp

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Sharding info not provided")
        return ocp.PyTreeCheckpointer().restore(os.path.join(step_dir, "state"))


def _same_tree(a, b) -> bool:
    import jax

    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    return jax.tree.structure(a) == jax.tree.structure(b) and all(
        np.asarray(x).dtype == np.asarray(y).dtype and np.array_equal(x, y) for x, y in zip(la, lb)
    )


def _meta_problems(ref_meta, meta, ref_rows, rel) -> list[str]:
    pending = meta.pop(_PENDING, None)
    problems = []
    if pending is not None:  # the step's row as it was before its evaluation
        step = int(rel.split("/")[1])
        want = [untimed(r) for r in ref_rows if r["step"] == step]
        got = untimed({k: v for k, v in pending.items() if k != "samples"})
        if not want or any(want[0].get(k) != v for k, v in got.items()):
            problems.append(f"{rel}: the pending row differs from the reference's row {step}")
    timing = (("sft", "sft_seconds"), ("wall_seconds",))
    if _drop(ref_meta, *timing) != _drop(meta, *timing):
        problems.append(f"{rel} differs")
    return problems


def differences(reference, workdir) -> list[str]:
    """What differs between two workdirs (empty: nothing but the named timing fields)."""
    reference, workdir = str(reference), str(workdir)
    fa, fb = _files(reference), _files(workdir)
    problems = [f"{workdir}: {n} only in the reference" for n in sorted(fa - fb)]
    problems += [f"{workdir}: {n} not in the reference" for n in sorted(fb - fa)]
    ref_rows = _jsonl(os.path.join(reference, "metrics.jsonl"))
    for rel in sorted(fa & fb):
        a, b = os.path.join(reference, rel), os.path.join(workdir, rel)
        if _STORAGE.match(rel) or rel.startswith("tensorboard/"):
            continue  # below: the restored state; the merged event stream
        if rel == "metrics.jsonl":
            same = [untimed(r) for r in ref_rows] == [untimed(r) for r in _jsonl(b)]
        elif rel == "summary.json":
            same = _drop(json.load(open(a)), *_SUMMARY_TIMING) == _drop(
                json.load(open(b)), *_SUMMARY_TIMING
            )
        elif rel.endswith("/_CHECKPOINT_METADATA"):
            drop = [(k,) for k in _ORBAX_TIMING]
            same = _drop(json.load(open(a)), *drop) == _drop(json.load(open(b)), *drop)
        elif rel.endswith("commit_success.txt"):
            same = open(a).read().replace(reference, "") == open(b).read().replace(workdir, "")
        elif re.match(r"^checkpoints/\d+/meta/metadata$", rel):
            problems += _meta_problems(json.load(open(a)), json.load(open(b)), ref_rows, rel)
            continue
        else:
            same = open(a, "rb").read() == open(b, "rb").read()
        if not same:
            problems.append(f"{workdir}: {rel} differs from the reference")
    for step_dir in sorted({"/".join(n.split("/")[:2]) for n in fa & fb if _STORAGE.match(n)}):
        if not _same_tree(
            _state(os.path.join(reference, step_dir)), _state(os.path.join(workdir, step_dir))
        ):
            problems.append(f"{workdir}: {step_dir}'s state differs from the reference")
    tb = os.path.join(reference, "tensorboard"), os.path.join(workdir, "tensorboard")
    if (
        os.path.isdir(tb[0])
        and os.path.isdir(tb[1])
        and tensorboard_events(tb[0]) != tensorboard_events(tb[1])
    ):
        problems.append(f"{workdir}: the TensorBoard events differ from the reference")
    return problems
