"""Sequence packing for the update: rows of a padded batch placed end to end in fixed-size
token buffers, so the forward and backward passes spend no compute on padding.

A padded batch is ``[R, L]`` with each row's real tokens one contiguous span (our layout:
left-padded prompt, then the completion, then right padding), ``starts[r]`` its first index and
``lengths[r]`` its token count. `plan` assigns whole rows to ``B`` buffers of ``T`` tokens
(first-fit decreasing, rows never split, never dropped: a row longer than ``T`` raises), with
``B`` rounded up to a bucket so the compiled shapes stay static across steps. `pack` /
`unpack` move any per-token array between the two layouts; `PackPlan.segment_ids` (0 =
padding, k >= 1 = the k-th row of the buffer) and `PackPlan.positions` (restarting at 0 for
each row) are what the attention and the rotary embedding read, so that a token attends only
to earlier tokens of its own row.

Everything here is host numpy (the plan) plus two gathers (`pack`, `unpack`) that trace under
``jax.jit`` with the plan's index arrays as arguments.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PackPlan:
    """Where each row's tokens go (host numpy; shapes depend only on ``B`` and ``T``).

    Attributes:
      buffer_of: [R] int32, the buffer holding row r.
      offset: [R] int32, row r's first slot in its buffer.
      starts, lengths: [R] int32, row r's span in the padded layout.
      src_row, src_col: [B, T] int32, the padded-layout (row, column) each packed slot reads
        (0, 0 for padding slots, which `segment_ids` marks 0).
      segment_ids: [B, T] int32, 0 = padding, k >= 1 = the k-th row placed in the buffer.
      positions: [B, T] int32, the token's position within its row (0 at the row's first token;
        0 for padding).
    """

    buffer_of: np.ndarray
    offset: np.ndarray
    starts: np.ndarray
    lengths: np.ndarray
    src_row: np.ndarray
    src_col: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray

    @property
    def num_buffers(self) -> int:
        return int(self.segment_ids.shape[0])

    @property
    def buffer_len(self) -> int:
        return int(self.segment_ids.shape[1])

    @property
    def num_tokens(self) -> int:
        """Real tokens placed (= ``lengths.sum()``, checked when the plan is made)."""
        return int((self.segment_ids > 0).sum())


def num_buckets(n: int, multiple: int = 1) -> int:
    """The buffer count compiled for ``n`` needed buffers: the next power of two at least
    ``n``, rounded up to a multiple of ``multiple`` (the mesh's batch shards), so a run
    compiles O(log R) update shapes instead of one per step."""
    b = 1 << max(int(n) - 1, 0).bit_length()
    return -(-b // multiple) * multiple


def plan(starts, lengths, buffer_len: int, *, multiple: int = 1, num_buffers=None) -> PackPlan:
    """Packs rows (span ``[starts[r], starts[r] + lengths[r])``) into buffers of ``buffer_len``.

    First-fit decreasing over the rows by length (ties by row index, so the plan is a pure
    function of its inputs); a row is never split across buffers.

    Args:
      starts, lengths: [R] ints >= 0; a row of length 0 is placed nowhere.
      buffer_len: T, tokens per buffer.
      multiple: the buffer count is a multiple of it (data-parallel shards: every shard gets
        whole buffers, none is dropped).
      num_buffers: a fixed buffer count (None: `num_buckets` of what first-fit needs).

    Returns: the `PackPlan`.
    Raises:
      ValueError: a row longer than ``buffer_len``; negative starts / lengths; the rows do not
        fit ``num_buffers``; the placed token count differs from ``lengths.sum()`` (a row would
        be dropped).
    """
    starts = np.asarray(starts, np.int64).reshape(-1)
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    if starts.shape != lengths.shape:
        raise ValueError(f"packing: starts {starts.shape} and lengths {lengths.shape} differ")
    if (starts < 0).any() or (lengths < 0).any():
        raise ValueError("packing: starts and lengths must be >= 0")
    T = int(buffer_len)
    if T < 1:
        raise ValueError(f"packing: buffer_len must be >= 1, got {buffer_len}")
    if lengths.size and lengths.max() > T:
        r = int(lengths.argmax())
        raise ValueError(
            f"packing: row {r} has {int(lengths[r])} tokens, more than buffer_len={T} (rows are "
            "never split: raise the buffer length)"
        )
    order = sorted(range(len(lengths)), key=lambda r: (-int(lengths[r]), r))
    free: list[int] = []  # tokens left per open buffer
    buffer_of = np.full(len(lengths), -1, np.int32)
    offset = np.zeros(len(lengths), np.int32)
    for r in order:
        n = int(lengths[r])
        if n == 0:
            continue
        b = next((i for i, f in enumerate(free) if f >= n), None)
        if b is None:
            free.append(T)
            b = len(free) - 1
        buffer_of[r], offset[r] = b, T - free[b]
        free[b] -= n
    need = len(free)
    B = num_buckets(need, multiple) if num_buffers is None else int(num_buffers)
    if need > B:
        raise ValueError(f"packing: the rows need {need} buffers of {T}, more than {B}")
    src_row = np.zeros((B, T), np.int32)
    src_col = np.zeros((B, T), np.int32)
    segment_ids = np.zeros((B, T), np.int32)
    positions = np.zeros((B, T), np.int32)
    seg_count = np.zeros(B, np.int32)
    for r in sorted(np.flatnonzero(buffer_of >= 0), key=lambda r: (buffer_of[r], offset[r])):
        b, o, n = int(buffer_of[r]), int(offset[r]), int(lengths[r])
        seg_count[b] += 1
        src_row[b, o : o + n] = r
        src_col[b, o : o + n] = starts[r] + np.arange(n)
        segment_ids[b, o : o + n] = seg_count[b]
        positions[b, o : o + n] = np.arange(n)
    out = PackPlan(
        buffer_of, offset, starts.astype(np.int32), lengths.astype(np.int32),
        src_row, src_col, segment_ids, positions,
    )  # fmt: skip
    if out.num_tokens != int(lengths.sum()):  # the open-instruct#1271 failure: never silent
        raise ValueError(
            f"packing: {out.num_tokens} tokens placed of {int(lengths.sum())}: a row would be "
            "dropped"
        )
    return out


def pack(x, src_row, src_col, segment_ids, fill=0):
    """``x`` [R, L, ...] in the padded layout -> [B, T, ...] packed (padding slots ``fill``).
    Index arrays from a `PackPlan` (numpy or traced)."""
    y = jnp.asarray(x)[src_row, src_col]
    keep = (segment_ids > 0).reshape(segment_ids.shape + (1,) * (y.ndim - 2))
    return jnp.where(keep, y, jnp.asarray(fill, y.dtype))


def unpack(y, buffer_of, offset, starts, lengths, length: int, fill=0):
    """``y`` [B, T, ...] packed -> [R, length, ...] in the padded layout (outside each row's
    span: ``fill``). Index arrays from a `PackPlan` (numpy or traced)."""
    cols = jnp.arange(length)[None, :]  # [1, L]
    rel = cols - starts[:, None]  # [R, L]: position within the row
    inside = (rel >= 0) & (rel < lengths[:, None])
    b = jnp.broadcast_to(jnp.maximum(buffer_of, 0)[:, None], rel.shape)
    t = jnp.clip(offset[:, None] + rel, 0, y.shape[1] - 1)
    x = y[b, t]
    keep = inside.reshape(inside.shape + (1,) * (x.ndim - 2))
    return jnp.where(keep, x, jnp.asarray(fill, x.dtype))


def plan_for_batch(attention_mask, buffer_len: int, *, multiple: int = 1) -> PackPlan:
    """The `plan` of the model input of a padded batch (``attention_mask[:, :-1]``, host
    numpy [R, L] bool; each row's real tokens one contiguous span, as our layout has them).

    Raises: ValueError as `plan`, or for a row whose real tokens are not contiguous."""
    m = np.asarray(attention_mask, bool)[:, :-1]
    lengths = m.sum(axis=1)
    starts = np.where(lengths > 0, m.argmax(axis=1), 0)
    ends = starts + lengths
    cols = np.arange(m.shape[1])[None]
    if ((cols >= starts[:, None]) & (cols < ends[:, None]) != m).any():
        raise ValueError("packing: a row's real tokens are not one contiguous span")
    return plan(starts, lengths, buffer_len, multiple=multiple)


def packed_hidden(model, tokens, plan_arrays, length: int):
    """The model's final hidden states [R, length, E] of the padded batch ``tokens`` [R, >=
    length] computed on packed buffers (0 outside each row's span): the transformer body runs
    on B x T tokens instead of R x length. ``plan_arrays``: (src_row, src_col, segment_ids,
    positions, buffer_of, offset, starts, lengths) of a `PackPlan` (`arrays`)."""
    src_row, src_col, seg, positions, buffer_of, offset, starts, lengths = plan_arrays
    packed = pack(tokens, src_row, src_col, seg)
    hidden, _ = model(packed, positions, seg > 0, segment_ids=seg, return_hidden=True)
    return unpack(hidden, buffer_of, offset, starts, lengths, length)


def arrays(p: PackPlan) -> tuple:
    """The plan's index arrays in `packed_hidden`'s order (jit arguments)."""
    return (
        p.src_row, p.src_col, p.segment_ids, p.positions, p.buffer_of, p.offset, p.starts,
        p.lengths,
    )  # fmt: skip
