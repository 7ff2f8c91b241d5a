"""Sequence packing for the update: rows of a padded batch placed end to end in fixed-size
token buffers, so the forward and backward passes spend no compute on padding.

A padded batch is ``[R, L]`` with each row's real tokens one contiguous span (our layout:
left-padded prompt, then the completion, then right padding), ``starts[r]`` its first index and
``lengths[r]`` its token count. `plan` assigns whole rows to ``B`` buffers of ``T`` tokens
(first-fit decreasing, rows never split, never dropped: a row longer than ``T`` raises), with
``B`` rounded up to a bucket (`num_buckets`) so the compiled shapes stay static across steps. `pack` /
`unpack` move any per-token array between the two layouts; `PackPlan.segment_ids` (0 =
padding, k >= 1 = the k-th row of the buffer) and `PackPlan.positions` (restarting at 0 for
each row) are what the attention and the rotary embedding read, so that a token attends only
to earlier tokens of its own row.

The update (`config.algorithm.pack_sequences`) cuts the buffers into micro-batches of at most
``k`` buffers, a token budget per forward/backward (`micro_batches`, `MicroBatches`), and plans a
step's mini-batches on the host with the device's shuffle (`step_plan`, `StepPlan`), counting
tokens in and out; `grpo_jax.steps` runs the model on the buffers.

Everything here is host numpy (the plans) plus two gathers (`pack`, `unpack`) that trace under
``jax.jit`` with the plan's index arrays as arguments.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

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
    """The buffer (or micro-batch) count compiled for ``n`` needed: the smallest of 1, 2, 3,
    4, 6, 8, 12, 16, 24, ... (powers of two and 1.5 x them) at least ``n``, rounded up to a
    multiple of ``multiple`` (the mesh's batch shards). A run compiles O(log R) update shapes
    instead of one per step and computes at most a third more than it needs."""
    n = max(int(n), 1)
    b = 1 << (n - 1).bit_length()  # the next power of two
    if b >= 4 and 3 * b // 4 >= n:
        b = 3 * b // 4
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
    starts, lengths, T = _checked_rows(starts, lengths, buffer_len)
    buffer_of, offset, need = _first_fit(lengths, T)
    B = num_buckets(need, multiple) if num_buffers is None else int(num_buffers)
    if need > B:
        raise ValueError(f"packing: the rows need {need} buffers of {T}, more than {B}")
    return _placed(starts, lengths, T, buffer_of, offset, B)


def _placed(starts, lengths, T: int, buffer_of, offset, B: int) -> PackPlan:
    """The `PackPlan` of a first-fit assignment (`_first_fit`) in ``B`` buffers, its tokens
    counted."""
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


def _checked_rows(starts, lengths, buffer_len):
    """(starts, lengths) as [R] int64 and T, checked: a row that cannot be placed raises."""
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
    return starts, lengths, T


def _first_fit(lengths: np.ndarray, T: int) -> tuple[np.ndarray, np.ndarray, int]:
    """First-fit decreasing (ties by row index): (buffer_of [R] int32, -1 for an empty row;
    offset [R] int32; the number of buffers opened)."""
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
    return buffer_of, offset, len(free)


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
    rel = cols - starts[:, None]  # position within the row
    inside = (rel >= 0) & (rel < lengths[:, None])
    b = jnp.broadcast_to(jnp.maximum(buffer_of, 0)[:, None], rel.shape)
    t = jnp.clip(offset[:, None] + rel, 0, y.shape[1] - 1)
    x = y[b, t]
    keep = inside.reshape(inside.shape + (1,) * (x.ndim - 2))
    return jnp.where(keep, x, jnp.asarray(fill, x.dtype))


def spans(attention_mask) -> tuple[np.ndarray, np.ndarray]:
    """(starts, lengths) [R] int64 of the model input of a padded batch
    (``attention_mask[:, :-1]``, host [R, L] bool).

    Raises: ValueError for a row whose real tokens are not one contiguous span (our layout: a
    left-padded prompt, then the completion, then right padding)."""
    m = np.asarray(attention_mask, bool)[:, :-1]
    lengths = m.sum(axis=1)
    starts = np.where(lengths > 0, m.argmax(axis=1), 0)
    cols = np.arange(m.shape[1])[None]
    inside = (cols >= starts[:, None]) & (cols < (starts + lengths)[:, None])
    if (inside != m).any():
        r = int(np.flatnonzero((inside != m).any(axis=1))[0])
        raise ValueError(f"packing: row {r}'s real tokens are not one contiguous span")
    return starts, lengths


class MicroBatches(NamedTuple):
    """A packed pass over ``R`` rows: ``M`` micro-batches of ``k`` buffers of ``T`` tokens
    (host numpy or device int32; a pytree, so it is a jit argument; a jit sees only the shapes,
    so a run compiles once per bucket of ``M`` and ``H``, `num_buckets`).

    Attributes:
      src_row, src_col, segment_ids, positions: [M, k, T], as `PackPlan`'s with the buffer axis
        cut into micro-batches.
      head_slot: [M, k, H], per buffer the slots whose next-token log-probs are wanted (the LM
        head runs on these only, buffer by buffer; 0 where unused).
      head_row, head_col: [M, k, H], where each goes in the [R, C] output (row R where unused:
        a scatter with ``mode="drop"`` skips it).
      micro_of: [R], the micro-batch holding row r (-1 for a row without tokens).
    """

    src_row: np.ndarray
    src_col: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    head_slot: np.ndarray
    head_row: np.ndarray
    head_col: np.ndarray
    micro_of: np.ndarray

    @property
    def num_micro(self) -> int:
        return int(self.segment_ids.shape[-3])


def _scored(starts, lengths, scored):
    """(first, count) [R] int64 of `micro_batches`' ``scored``, checked inside each row."""
    if scored is None:
        return starts, lengths
    first, count = (np.broadcast_to(np.asarray(x, np.int64), starts.shape) for x in scored)
    bad = (count < 0) | ((count > 0) & ((first < starts) | (first + count > starts + lengths)))
    if bad.any():
        r = int(np.flatnonzero(bad)[0])
        raise ValueError(
            f"packing: row {r}'s scored positions [{first[r]}, {first[r] + count[r]}) lie "
            f"outside its tokens [{starts[r]}, {starts[r] + lengths[r]})"
        )
    return first, count


def _scored_per_buffer(buffer_of, count) -> int:
    """Scored positions of the fullest buffer of a first-fit assignment."""
    placed = buffer_of >= 0
    return int(np.bincount(buffer_of[placed], weights=count[placed], minlength=1).max())


def _shape(n: int, rows: int, k: int, multiple: int) -> tuple[int, int]:
    """(M, k') for ``n`` needed buffers of ``rows`` rows with tokens, at most ``k`` buffers
    per micro-batch: M = `num_buckets` of the micro-batches needed, never more than the rows
    could fill; a single micro-batch holds only the bucketed buffers it needs (a multiple of
    ``multiple``), so a packed pass never computes more rows' worth than the padded one."""
    M = min(num_buckets(-(-n // k)), max(1, -(-rows // k)))
    return (M, k) if M > 1 else (1, min(k, num_buckets(n, multiple)))


def micro_batches(
    starts,
    lengths,
    buffer_len: int,
    buffers_per_micro: int,
    *,
    multiple: int = 1,
    scored=None,
    shape: tuple[int, int] | None = None,
    head_len: int | None = None,
) -> MicroBatches:
    """Rows packed into buffers of ``buffer_len`` tokens (`plan`), the buffers cut into
    micro-batches of at most ``buffers_per_micro`` (a forward/backward's token budget is
    ``buffers_per_micro * buffer_len``), with the positions whose next-token log-prob is wanted.

    Args:
      starts, lengths: [R], each row's span (as `plan`).
      buffer_len, buffers_per_micro: T and the most buffers k per micro-batch (a multiple of
        ``multiple``, the mesh's batch shards).
      scored: (first, count), [R] or scalars: row r's positions ``first .. first + count - 1``
        (in the padded layout) go to output columns ``0 .. count - 1`` (our completions:
        first = Lp - 1, count = the completion's tokens). None: every position of the span.
      shape, head_len: a fixed (M, k') and H (None: `_shape` and `num_buckets` of what the
        rows need, H at most T).
    Raises:
      ValueError: as `plan` (a row longer than a buffer, a row that would be dropped); scored
        positions outside their row; more buffers or scored positions than ``shape`` or
        ``head_len`` allow.
    """
    k, T = int(buffers_per_micro), int(buffer_len)
    if k < 1:
        raise ValueError(f"packing: buffers_per_micro must be >= 1, got {buffers_per_micro}")
    starts, lengths, T = _checked_rows(starts, lengths, T)
    first, count = _scored(starts, lengths, scored)
    buffer_of, offset, need = _first_fit(lengths, T)
    need_h = _scored_per_buffer(buffer_of, count)
    M, k = _shape(need, int((lengths > 0).sum()), k, multiple) if shape is None else shape
    H = min(num_buckets(need_h), T) if head_len is None else int(head_len)
    if need > M * k or need_h > H:
        raise ValueError(
            f"packing: the rows need {need} buffers and {need_h} scored positions in one, more "
            f"than {M} x {k} and {H}"
        )
    p = _placed(starts, lengths, T, buffer_of, offset, M * k)
    R = len(lengths)
    head_slot = np.zeros((M * k, H), np.int32)
    head_row = np.full((M * k, H), R, np.int32)
    head_col = np.zeros((M * k, H), np.int32)
    used = np.zeros(M * k, np.int64)
    for r in np.flatnonzero((p.buffer_of >= 0) & (count > 0)):
        b, c = int(p.buffer_of[r]), int(count[r])
        u, t0 = int(used[b]), int(p.offset[r] + first[r] - starts[r])
        head_slot[b, u : u + c] = t0 + np.arange(c)
        head_row[b, u : u + c] = r
        head_col[b, u : u + c] = np.arange(c)
        used[b] += c
    if int(used.sum()) != int(count.sum()):  # never silent
        raise ValueError(f"packing: {int(used.sum())} scored positions of {int(count.sum())}")
    buffers, head = (M, k, T), (M, k, H)
    return MicroBatches(
        p.src_row.reshape(buffers), p.src_col.reshape(buffers), p.segment_ids.reshape(buffers),
        p.positions.reshape(buffers), head_slot.reshape(head), head_row.reshape(head),
        head_col.reshape(head), np.where(p.buffer_of >= 0, p.buffer_of // k, -1).astype(np.int32),
    )  # fmt: skip


class StepPlan(NamedTuple):
    """The packed update of one RL step: ``rows`` [I, N, mb] int32, the batch rows of pass i's
    mini-batch n (the same shuffle as the padded update's); ``micro`` the `MicroBatches` of each
    mini-batch (leading axes [I, N]; row indices local to the mini-batch), all of one shape."""

    rows: np.ndarray
    micro: MicroBatches


def step_plan(
    attention_mask, rows, buffer_len: int, buffers_per_micro: int, *, multiple=1, scored=None
) -> StepPlan:
    """Plans every mini-batch of a step (`micro_batches`), counting tokens in and out.

    Args:
      attention_mask: host [R, L] bool, the step's batch.
      rows: [I, N, mb] ints, pass i's mini-batch n (each pass a permutation of the R rows).
      buffer_len, buffers_per_micro, multiple, scored: as `micro_batches` (``scored`` over the
        R rows); every mini-batch gets the same (M, k') and H.
    Raises:
      ValueError: a pass that does not visit every row exactly once, or whose placed tokens
        differ from the batch's (a row would be dropped or doubled; open-instruct#1271), or as
        `micro_batches`.
    """
    starts, lengths = spans(attention_mask)
    first, count = _scored(starts, lengths, scored)
    rows = np.asarray(rows, np.int64)
    R = len(lengths)
    I, N, _ = rows.shape
    for i in range(I):
        if not np.array_equal(np.sort(rows[i].reshape(-1)), np.arange(R)):
            raise ValueError(f"packing: pass {i}'s mini-batches do not hold each of {R} rows once")
    shapes, heads = [], []
    for i in range(I):
        for n in range(N):
            r = rows[i, n]
            buffer_of, _, need = _first_fit(lengths[r], int(buffer_len))
            shapes.append(_shape(need, int((lengths[r] > 0).sum()), buffers_per_micro, multiple))
            heads.append(_scored_per_buffer(buffer_of, count[r]))
    M = max(m for m, _ in shapes)
    shape = (M, buffers_per_micro) if M > 1 else (1, max(k for _, k in shapes))
    H = min(num_buckets(max(heads)), int(buffer_len))
    parts = [
        [
            micro_batches(
                starts[rows[i, n]],
                lengths[rows[i, n]],
                buffer_len,
                buffers_per_micro,
                scored=(first[rows[i, n]], count[rows[i, n]]),
                shape=shape,
                head_len=H,
            )  # fmt: skip
            for n in range(N)
        ]
        for i in range(I)
    ]
    for i in range(I):
        placed = sum(int((p.segment_ids > 0).sum()) for p in parts[i])
        if placed != int(lengths.sum()):
            raise ValueError(
                f"packing: pass {i} places {placed} tokens of the batch's {int(lengths.sum())}"
            )
    fields = range(len(MicroBatches._fields))
    micro = MicroBatches(
        *(np.stack([np.stack([p[f] for p in ps]) for ps in parts]) for f in fields)
    )
    return StepPlan(rows.astype(np.int32), micro)
